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


def test_a_mapping_written_after_the_close(kvfs: Mount) -> None:
    data = rand_bytes(2 * MiB, 60)
    kvfs.path("v").write_bytes(data)
    kvfs.ingested()
    fd = os.open(kvfs.path("w"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, data)
    # As C does it (Python's mmap keeps a duplicate descriptor): the mapping is all that is left.
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    addr = libc.mmap(None, len(data), mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    os.close(fd)  # the commit: the save is the staged file
    stored(kvfs, 2)
    ctypes.memmove(addr, MARK, len(MARK))
    assert kvfs.path("v").read_bytes() == data, "another name read bytes written through a mapping"
    assert libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(len(data))) == 0
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
