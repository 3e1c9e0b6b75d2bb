"""Opens racing saves: a restore while the last save is renamed over its name, a save while the
snapshot is being read. Whatever the timing, an open succeeds (on the old file or the new one),
a read-only open never gets EBUSY, and a save is not starved by readers.

Run in both modes: passthrough (the default where the kernel offers it) and served
(``KV_CHUNK_FS_FUSE_PASSTHROUGH=false``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import Mount
from helpers import rand_bytes

KiB = 1 << 10
VERSIONS = [rand_bytes(64 * KiB, 700 + i) for i in range(16)]
OPENS = 5000


@pytest.fixture(params=[False, True], ids=["idle", "cpu-hog"])
def hog(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Optionally a process that keeps a core busy: the races shift with the scheduling."""
    if not request.param:
        yield False
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield True
    finally:
        proc.kill()
        proc.wait()


class Loops:
    """Threads that each run a step over and over until told to stop; the first error of each is kept."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.errors: list[tuple[str, BaseException]] = []
        self.threads: list[threading.Thread] = []

    def start(self, name: str, step: Callable[[], None]) -> None:
        def loop() -> None:
            while not self.stop.is_set():
                try:
                    step()
                except BaseException as e:  # noqa: BLE001 - reported by the test
                    self.errors.append((name, e))
                    return

        thread = threading.Thread(target=loop, name=name)
        thread.start()
        self.threads.append(thread)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def save_by_rename(path: Path, data: bytes) -> None:
    """As the proxy saves: the bytes to ``NAME.tmp``, then renamed over ``NAME``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, path)


def test_opens_racing_renames_over_their_name_never_fail(kvfs: Mount, hog: bool) -> None:
    """One thread saves NAME.tmp and renames it over NAME, over and over; readers open NAME, read
    it whole and close it. The rename replaces the inode an open may be waiting on: the open gets
    the old file, the new one, or ESTALE (the kernel then looks the name up again), never an
    error. An ``O_TRUNC`` open racing renames over its name likewise."""
    name, other = kvfs.path("s"), kvfs.path("t")
    save_by_rename(name, VERSIONS[0])
    save_by_rename(other, VERSIONS[0])
    counter = iter(range(1, 1 << 30))
    opens = [0, 0]  # read-only opens, O_TRUNC opens
    lock = threading.Lock()

    def rename_loop(path: Path) -> Callable[[], None]:
        return lambda: save_by_rename(path, VERSIONS[next(counter) % len(VERSIONS)])

    def read_whole() -> None:
        with open(name, "rb") as f:
            data = f.read()
        with lock:
            opens[0] += 1
        if data not in VERSIONS:
            raise AssertionError(f"read {len(data)} bytes that are no version saved")

    def truncating_open() -> None:
        fd = os.open(other, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, VERSIONS[next(counter) % len(VERSIONS)])
        finally:
            os.close(fd)
        with lock:
            opens[1] += 1

    loops = Loops()
    loops.start("renames of s", rename_loop(name))
    loops.start("renames of t", rename_loop(other))
    loops.start("reader 1", read_whole)
    loops.start("reader 2", read_whole)
    loops.start("O_TRUNC opens", truncating_open)
    try:
        while opens[0] < OPENS and not loops.errors:
            time.sleep(0.05)
    finally:
        loops.join()
    assert not loops.errors, f"after {opens} opens: {loops.errors[:3]}"
    assert opens[0] >= OPENS and opens[1] > 0
    assert name.read_bytes() in VERSIONS and other.read_bytes() in VERSIONS
    log = kvfs.log()
    assert "Traceback" not in log and "AssertionError" not in log, log[-3000:]


def read_slowly(path: Path, hold: float, errors: list[tuple[str, BaseException]], stop: threading.Event) -> int:
    """Open ``path``, read it, keep it open ``hold`` seconds, over and over; the opens made. Each
    read is a prefix of a version (a reader that opens while a save writes sees its bytes so far)."""
    count = 0
    while not stop.is_set():
        try:
            with open(path, "rb") as f:
                data = f.read()
                count += 1
                stop.wait(hold)
        except OSError as e:
            errors.append((f"reader of {path.name}", e))
            return count
        if not any(v.startswith(data) for v in VERSIONS):
            errors.append((f"reader of {path.name}", AssertionError(f"{len(data)} bytes that are no version")))
            return count
    return count


def test_a_save_beside_readers_waits_only_for_the_opens_before_it(kvfs: Mount) -> None:
    """Readers open the snapshot back to back, some briefly, some holding it open a while (each well
    under the 2 s a writer waits), so that it is never without an open reader. Every save
    (``O_TRUNC``, as llama-server writes) succeeds: a writer waits only for the opens that were
    there when it came, later ones queue behind it; no reader ever gets EBUSY."""
    path = kvfs.path("s")
    path.write_bytes(VERSIONS[0])
    kvfs.ingested()
    errors: list[tuple[str, BaseException]] = []
    stop = threading.Event()
    counts: list[int] = []

    def reader(hold: float, delay: float) -> None:
        stop.wait(delay)
        counts.append(read_slowly(path, hold, errors, stop))

    readers = [threading.Thread(target=reader, args=args) for args in ((0.0, 0.0), (0.0, 0.0), (0.5, 0.0), (0.5, 0.25))]
    for t in readers:
        t.start()
    saves = 0
    try:
        stop.wait(0.5)
        for i in range(1, 25):
            if errors:
                break
            try:
                path.write_bytes(VERSIONS[i % len(VERSIONS)])
            except OSError as e:
                errors.append((f"save {i}", e))
                break
            saves += 1
    finally:
        stop.set()
        for t in readers:
            t.join()
    assert not errors, f"after {saves} saves: {errors[:3]}"
    assert saves == 24 and sum(counts) > 24
    assert path.read_bytes() == VERSIONS[24 % len(VERSIONS)]
    assert "EBUSY" not in kvfs.log()
