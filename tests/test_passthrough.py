"""Kernel passthrough: a file opened through a backing file is read, written and mmap'd by the
kernel, with no READ or WRITE reaching the daemon.

The filesystem is the benchmark's floor (benchmarks/nullfs.py) with ``--backing DIR --passthrough``:
its opens name the file on disk as their backing file, creates make one in DIR. It reports the
requests the kernel sent it (by opcode, counted by the session) and the reads and writes it served,
in the ``user.nullfs.stats`` attribute of its root. The same files served without passthrough show
that the counts are real (there every read and write reaches the daemon).

Where the kernel does not offer passthrough (before Linux 6.9, or built without it) the passthrough
test is skipped with the mount's own reason; where it offers it, a mount that still runs served fails.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import is_mounted

NULLFS = Path(__file__).resolve().parent.parent / "benchmarks" / "nullfs.py"
MiB = 1 << 20
PIECE = 64 << 10


class Floor:
    """nullfs serving ``back`` on ``mnt``."""

    def __init__(self, tmp: Path, passthrough: bool) -> None:
        self.back, self.mnt, self.log = tmp / "back", tmp / "mnt", tmp / "nullfs.log"
        self.back.mkdir()
        self.mnt.mkdir()
        (self.back / "old").write_bytes(os.urandom(2 * MiB + 77))  # there before the mount
        flags = ["--passthrough"] if passthrough else []
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(NULLFS), "--backing", str(self.back), *flags,
                                          str(self.mnt)], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 30
        while not is_mounted(self.mnt):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)

    def stats(self) -> dict:
        return json.loads(os.getxattr(self.mnt, "user.nullfs.stats"))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        finally:
            if is_mounted(self.mnt):
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], check=False)
        assert "ERROR" not in self.log.read_text(), self.log.read_text()


@pytest.fixture
def floor(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Floor]:
    f = Floor(tmp_path, request.param)
    try:
        yield f
    finally:
        f.stop()


def exercise(floor: Floor) -> tuple[int, bytes]:
    """Create, write, rewrite, read and mmap files through the mount; checks every byte against the
    file on disk and what was written. Returns the write() calls made and the new file's bytes."""
    data = bytearray(os.urandom(3 * MiB + 4321))
    writes = 0
    with open(floor.mnt / "new", "wb", buffering=0) as f:  # create + writes, as llama-server saves
        for i in range(0, len(data), PIECE):
            f.write(data[i : i + PIECE])
            writes += 1
    assert (floor.back / "new").read_bytes() == data, "the bytes written are not the backing file's"
    with open(floor.mnt / "new", "r+b", buffering=0) as f:  # rewrite in the middle
        f.seek(MiB + 5)
        f.write(b"middle")
        writes += 1
    data[MiB + 5 : MiB + 11] = b"middle"
    assert (floor.mnt / "new").read_bytes() == data
    assert (floor.mnt / "old").read_bytes() == (floor.back / "old").read_bytes()
    fd = os.open(floor.mnt / "new", os.O_RDWR)  # a shared mapping: read and written through the mount
    try:
        with mmap.mmap(fd, 0) as m:
            assert m[: len(data)] == data
            m[10:15] = b"mmap!"
            m.flush()
    finally:
        os.close(fd)
    data[10:15] = b"mmap!"
    assert (floor.back / "new").read_bytes() == data, "a write through the mapping did not reach the backing file"
    with open(floor.mnt / "old", "rb") as a, open(floor.mnt / "old", "rb") as b:  # two opens of one inode
        assert a.read(100) == b.read(100)
    return writes, bytes(data)


@pytest.mark.parametrize("floor", [True], indirect=True, ids=["passthrough"])
def test_passthrough_reads_and_writes_never_reach_the_daemon(floor: Floor) -> None:
    before = floor.stats()
    if before["mode"] != "passthrough":
        if "does not offer" in before["why"]:
            pytest.skip(f"FUSE passthrough is not available here: {before['why']}")
        pytest.fail(f"the kernel offers passthrough but the mount runs served: {before['why']}")
    writes, _ = exercise(floor)
    after = floor.stats()
    print(f"passthrough: requests {after['requests']}; {writes} write() calls")
    assert after["requests"].get("READ", 0) == 0 and after["requests"].get("WRITE", 0) == 0, after
    # The kernel asks for security.capability before a write unless told set-id bits are ours to
    # drop (HANDLE_KILLPRIV_V2): then once per inode and attribute refresh, not once per write.
    getxattrs = after["requests"]["GETXATTR"] - before["requests"].get("GETXATTR", 0)
    assert getxattrs <= 8 < writes, (getxattrs, writes)
    assert after["served_reads"] == after["served_writes"] == 0, after
    assert after["backing_refused"] == 0, after


@pytest.mark.parametrize("floor", [False], indirect=True, ids=["served"])
def test_served_files_send_their_reads_and_writes_to_the_daemon(floor: Floor) -> None:
    """The control: the same calls without passthrough are READ and WRITE requests, counted."""
    exercise_served(floor)
    after = floor.stats()
    assert after["requests"]["READ"] > 0 and after["served_reads"] == after["requests"]["READ"], after


def exercise_served(floor: Floor) -> None:
    """What ``exercise`` reads, served: nullfs drops written bytes, so only the file on disk is read."""
    assert (floor.mnt / "old").read_bytes() == (floor.back / "old").read_bytes()
    fd = os.open(floor.mnt / "old", os.O_RDONLY)
    try:
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
            assert m[:100] == (floor.back / "old").read_bytes()[:100]
    finally:
        os.close(fd)
