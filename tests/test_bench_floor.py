"""The benchmark's floor filesystem (benchmarks/nullfs.py) mounts, serves and unmounts: it runs
kv-chunk-fs's own trio loop, so a change there that only the real daemon survives shows here
(an idle-trim task that assumed kv-chunk-fs's Operations once left it hung before INIT)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from conftest import is_mounted

NULLFS = Path(__file__).resolve().parent.parent / "benchmarks" / "nullfs.py"


def test_nullfs_serves_writes_and_reads_then_unmounts(tmp_path: Path) -> None:
    io_on_floor(tmp_path, [], lambda data, got: len(got) == len(data))


def test_nullfs_keep_data_reads_back_what_was_written(tmp_path: Path) -> None:
    """--keep-data: the floor for restores that parse what they read (llama-server's)."""
    io_on_floor(tmp_path, ["--keep-data"], lambda data, got: got == data)


def io_on_floor(tmp_path: Path, flags: list[str], good: Callable[[bytes, bytes], bool]) -> None:
    mnt = tmp_path / "null"
    mnt.mkdir()
    log = open(tmp_path / "nullfs.log", "w")
    proc = subprocess.Popen([sys.executable, str(NULLFS), *flags, str(mnt)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not is_mounted(mnt):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "nullfs.log").read_text()
            time.sleep(0.05)
        data = os.urandom(3 << 20)
        seen: list[int] = []
        got: list[bytes] = []

        def io() -> None:  # in a thread: a loop that never answered INIT blocks it for good
            (mnt / "a").write_bytes(data)
            got.append((mnt / "a").read_bytes())
            seen.extend([(mnt / "a").stat().st_size, len(got[0])])

        worker = threading.Thread(target=io, daemon=True)
        worker.start()
        worker.join(60)
        assert seen == [len(data), len(data)], "the floor filesystem did not serve a write, stat and read"
        assert good(data, got[0]), "the floor filesystem read back the wrong bytes"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
            proc.wait()
        log.close()
        if is_mounted(mnt):  # a hung loop's mount outlives its process
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
            raise AssertionError("the floor filesystem left its mount behind")
