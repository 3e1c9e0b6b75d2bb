"""Cold pack bytes are read with O_DIRECT (``store/direct.py``): the aligned span around a run lands
in a buffer with slack, the run is the view at the right place; bytes the page cache holds are read
the usual way; a file system that refuses direct I/O is read the usual way. Same bytes, same checks."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import scatter_read, stream_store

from kvchunkfs.format.index import Index
from kvchunkfs.store import direct
from kvchunkfs.store.packs import ChunkCorrupt, PackStore

SIZES = [300_000, 5_000, 2_500_000, 70_001, 900_000, 1, 4096, 123_457]


def _store(root: Path, direct_wanted: bool = True) -> tuple[PackStore, Index, bytes]:
    """A store of chunks of ``SIZES``; skips a test about direct reads where they are off."""
    if direct_wanted and direct.local_disk(root.parent) is None:
        pytest.skip(f"{root.parent} is not on a local disk's file system: no direct reads there")
    return stream_store(root, SIZES)


def _read_all(store: PackStore, index: Index) -> bytes:
    try:
        return scatter_read(store, index)
    finally:
        store.close()


def _evict(store: PackStore) -> None:
    """Drop the packs' pages from the page cache (written back first: only clean pages go). Asked
    again until the kernel says none is left: a page still in another CPU's LRU batch survives a
    DONTNEED (on a loaded machine, the one a test just wrote); dropping the caches drains those."""
    for path in store.packs_dir.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            for attempt in range(20):
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                if not direct.resident(fd, 0, os.fstat(fd).st_size):
                    break
                if attempt >= 2:
                    Path("/proc/sys/vm/drop_caches").write_text("1")
        finally:
            os.close(fd)


def test_place_aligns_the_span_and_finds_the_run() -> None:
    whole = np.empty(3 << 20, np.uint8)
    for skew in (0, 1, 511, 4095):
        room = whole.data[skew : skew + (1 << 20) + direct.SLACK]
        for offset, length in [(0, 1), (1, 4095), (4095, 2), (4096, 4096), (123_457, 1 << 20), (8191, 0)]:
            p = direct.place(room, offset, length)
            assert p is not None
            assert direct.address(p.span) % direct.ALIGN == 0
            assert p.start % direct.ALIGN == 0 and len(p.span) % direct.ALIGN == 0
            assert p.start <= offset and offset + length <= p.start + len(p.span)
            assert len(p.run) == length
            head = offset - p.start
            assert direct.address(p.run) - direct.address(p.span) == head if length else True
    assert direct.place(whole.data[: (1 << 20) + direct.ALIGN], 100, 1 << 20) is None  # no room for the span


@pytest.mark.parametrize("cachestat", [True, False], ids=["cachestat", "mincore"])
def test_resident_sees_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cachestat: bool) -> None:
    if not cachestat:
        monkeypatch.setattr(direct, "_cachestat_works", False)  # as on a kernel before 6.5
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert not direct.resident(fd, 10_000, 500_000)
        os.pread(fd, 4096, 400_000)
        assert direct.resident(fd, 10_000, 500_000)
        assert not direct.resident(fd, 700_000, 100_000)
        if tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (6, 5):
            assert direct._cachestat_works == cachestat  # asked with cachestat (or told it is not there)
    finally:
        os.close(fd)


def test_cold_runs_are_read_direct_and_give_the_same_bytes(tmp_path: Path) -> None:
    store, index, whole = _store(tmp_path)
    try:
        for readers in (1, 3):
            _evict(store)
            assert scatter_read(store, index, readers) == whole, readers
        assert store.counters.direct_reads > 0
    finally:
        store.close()


def test_cached_pack_bytes_are_read_through_the_page_cache(tmp_path: Path) -> None:
    store, index, whole = _store(tmp_path, direct_wanted=False)  # just written: in the page cache
    assert _read_all(store, index) == whole
    assert store.counters.direct_reads == 0
    assert store.counters.pack_reads > 0


def test_a_changed_byte_fails_a_direct_read(tmp_path: Path) -> None:
    store, index, whole = _store(tmp_path)
    loc = store.locate_many([index.ids[2]])[index.ids[2]]
    with open(store.pack_path(loc.pack), "r+b") as f:
        f.seek(loc.offset + 1_000_003)
        f.write(bytes([whole[index.start(2) + 1_000_003] ^ 0x01]))
    try:
        # The pages evicted, the read is direct; on a loaded machine a page the kernel still held
        # in a per-CPU batch may make a try read through the page cache: that try proves nothing
        # about direct reads, so the read is tried again, evicted again.
        for _ in range(5):
            _evict(store)
            direct_before = store.counters.direct_reads
            with pytest.raises(ChunkCorrupt):
                scatter_read(store, index)
            if store.counters.direct_reads > direct_before:
                break
        assert store.counters.direct_reads > 0, "no try read the packs directly"
    finally:
        store.close()


def test_no_direct_io_reads_through_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that refuses O_DIRECT at open, or a device that refuses a direct read
    (EINVAL), is read the usual way from then on, with the same bytes."""
    store, index, whole = _store(tmp_path)
    monkeypatch.setattr(direct, "open_direct", lambda path: None)
    _evict(store)
    assert _read_all(store, index) == whole
    assert store.counters.direct_reads == 0 and not store.direct_reads

    store, index, whole = _store(tmp_path / "b")

    def refuse(*args: object) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(PackStore, "_read_direct", staticmethod(refuse))
    _evict(store)
    assert _read_all(store, index) == whole
    assert store.counters.direct_reads == 0 and not store.direct_reads


def test_a_direct_read_refused_midway_goes_on_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks handed out before a direct read was refused keep their bytes: the rest of the run
    is read the usual way into the same view, not over it at another place."""
    store, index, whole = _store(tmp_path)
    real = PackStore._read_direct

    def flaky(*args: object) -> object:
        it = real(*args)  # type: ignore[arg-type]
        yield next(it)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(PackStore, "_read_direct", staticmethod(flaky))
    _evict(store)
    try:
        assert scatter_read(store, index, readers=1) == whole
        assert not store.direct_reads
    finally:
        store.close()


def test_direct_reads_only_on_a_local_disk(tmp_path: Path) -> None:
    """Network, FUSE and memory file systems are read the usual way (a direct read there is a
    round trip, or passed on to a backing file that may refuse it)."""
    assert direct.local_disk("/proc") is None
    store = PackStore(tmp_path / "s")
    try:
        assert store.direct_reads == (direct.local_disk(tmp_path) is not None)
    finally:
        store.close()


def test_address_is_the_buffer_start() -> None:
    a = np.zeros(10_000, np.uint8)
    assert direct.address(a.data) == a.ctypes.data
    assert direct.address(a.data[100:]) == a.ctypes.data + 100
    assert ctypes.sizeof(ctypes.c_char) == 1
