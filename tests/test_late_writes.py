"""Writes after the committing close: a mapping kept after ``close()`` and a child's inherited
descriptor. Passed through, the kernel writes them into the staged file itself; no other name may
ever read them (a hot copy is content-addressed and shared), and the writer's own file reads them
once the last reference is gone (the kernel's RELEASE comes only then, mappings included). Both
modes: ``make served`` runs them again with passthrough off."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Mount
from helpers import rand_bytes, wait_closed

MiB = 1 << 20
MARK = b"POISONED-KV-CACHE"
libc = ctypes.CDLL(None, use_errno=True)


def stored(kvfs: Mount, saves: int) -> None:
    """Wait for the save to be stored if it is stored before the last release (up to 2 s: the
    old code did; this one stores it only after)."""
    deadline = time.monotonic() + 2
    while kvfs.stats()["saves"] < saves and time.monotonic() < deadline:
        time.sleep(0.02)


def check(kvfs: Mount, data: bytes) -> None:
    """The other name reads its own bytes; the writer's file what it wrote, also from its chunks."""
    late = MARK + data[len(MARK) :]
    assert kvfs.path("v").read_bytes() == data, "another name read bytes written after the close"
    wait_closed(kvfs)  # the last release
    kvfs.ingested()
    assert kvfs.path("w").read_bytes() == late, "the writes after the close were not saved"
    assert kvfs.path("v").read_bytes() == data
    kvfs.remount(["--hot-tier-size", "0"])
    assert kvfs.path("v").read_bytes() == data
    assert kvfs.path("w").read_bytes() == late
    kvfs.remount([])
    assert kvfs.path("v").read_bytes() == data, "a hot copy holds bytes that are not its checksum's"


class Mapping:
    """A writable shared mapping as C makes one (Python's mmap keeps a duplicate descriptor):
    after the close it is all that is left of the file description."""

    def __init__(self, fd: int, size: int) -> None:
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.size = size
        self.addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        assert self.addr not in (None, ctypes.c_void_p(-1).value)

    def write(self, data: bytes) -> None:
        ctypes.memmove(self.addr, data, len(data))

    def close(self) -> None:
        assert libc.munmap(ctypes.c_void_p(self.addr), ctypes.c_size_t(self.size)) == 0


def test_a_mapping_written_after_the_close(kvfs: Mount, tmp_path: Path) -> None:
    """Passed through, the kernel releases the file at the close while the mapping writes the
    staged file on; no other name ever reads those bytes, and the writer's file reads a whole
    version: what it wrote by its close, or with the later writes."""
    data = rand_bytes(2 * MiB, 60)
    late = MARK + data[len(MARK) :]
    kvfs.path("v").write_bytes(data)
    kvfs.ingested()
    fd = os.open(kvfs.path("w"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, data)
    mapping = Mapping(fd, len(data))
    try:
        os.close(fd)  # the commit: the save is the staged file
        stored(kvfs, 2)
        kvfs.ingested()
        mapping.write(MARK)
        assert kvfs.path("v").read_bytes() == data, "another name read bytes written through a mapping"
    finally:
        mapping.close()
    wait_closed(kvfs)
    kvfs.ingested()
    assert kvfs.path("w").read_bytes() in (data, late)
    kvfs.remount([])
    assert kvfs.path("v").read_bytes() == data, "a hot copy holds bytes that are not its checksum's"
    assert kvfs.path("w").read_bytes() in (data, late)


def test_a_mapping_written_before_its_save_is_stored_saves_it(kvfs: Mount, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Writes through the mapping before ingestion stored the save are stored with it."""
    hold = tmp_path / "hold-ingestion"
    monkeypatch.setenv("KVCFS_INGEST_HOLD", str(hold))
    kvfs.remount()
    data = rand_bytes(2 * MiB, 62)
    kvfs.path("v").write_bytes(data)
    kvfs.ingested()
    hold.touch()
    fd = os.open(kvfs.path("w"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, data)
    mapping = Mapping(fd, len(data))
    try:
        os.close(fd)
        mapping.write(MARK)
    finally:
        mapping.close()
    hold.unlink()
    check(kvfs, data)


def test_an_inherited_descriptor_written_after_the_close(kvfs: Mount) -> None:
    data = rand_bytes(2 * MiB, 61)
    kvfs.path("v").write_bytes(data)
    kvfs.ingested()
    fd = os.open(kvfs.path("w"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, data)
    child = subprocess.Popen(
        [sys.executable, "-c", f"import os,sys; sys.stdin.read(1); os.pwrite({fd}, {MARK!r}, 0)"],
        stdin=subprocess.PIPE,
        pass_fds=(fd,),
    )
    os.close(fd)  # the opener's own close commits; the child still has the file open
    stored(kvfs, 2)
    assert child.stdin is not None
    child.stdin.write(b"x")
    child.stdin.close()
    assert child.wait(timeout=30) == 0
    assert Path(kvfs.path("v")).read_bytes() == data, "another name read bytes a child wrote"
    check(kvfs, data)


def test_a_child_closing_its_copy_after_an_fsync_commits_nothing(kvfs: Mount) -> None:
    """After a client's fsync, a FLUSH from a child's copy of the descriptor is not a commit: the
    writer's later writes (passed through: unseen by the daemon) are saved at its own close."""
    v1, v2 = rand_bytes(2 * MiB, 63), rand_bytes(2 * MiB, 64)
    fd = os.open(kvfs.path("w"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, v1)
        os.fsync(fd)  # stored durably now
        child = subprocess.Popen([sys.executable, "-c", "pass"], pass_fds=(fd,))  # its exit closes its copy
        assert child.wait(timeout=30) == 0
        os.pwrite(fd, v2, 0)
    finally:
        os.close(fd)
    wait_closed(kvfs)
    kvfs.ingested()
    assert kvfs.path("w").read_bytes() == v2, "the writes after a child's close were lost"
    kvfs.remount([])
    assert kvfs.path("w").read_bytes() == v2
