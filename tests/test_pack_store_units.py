"""PackStore and its pack writer in-process: writes land at the pack's known end even when a rollback fails
(saves and GC's copies alike); the fd cache is bounded."""

from __future__ import annotations

import errno
import hashlib
import os
import sqlite3
from pathlib import Path

import pytest
from helpers import scatter_read, stream_store

from kvchunkfs.format.index import Index
from kvchunkfs.maint import gccompact, gcreport
from kvchunkfs.store.packformat import PACK_HEADER_SIZE, scan
from kvchunkfs.store.packs import ChunkCorrupt, PackStore, quick_sum
from kvchunkfs.store.packwriter import Batch, PackWriter, create_pack_file
from kvchunkfs.store.repository import Repository


def chunk(n: int, seed: int) -> tuple[bytes, bytes]:
    data = os.urandom(n) if seed < 0 else hashlib.sha256(str(seed).encode()).digest() * (n // 32)
    return hashlib.sha256(data).digest(), data


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_failed_rollback_does_not_misplace_the_next_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing map commit whose ftruncate fails too: the next batch must still be where its rows say."""
    store = PackStore(tmp_path)
    owner = object()
    first, second = chunk(100_000, -1), chunk(40_000, -1)
    real_insert = store._insert_rows

    def full_disk(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    def no_truncate(fd: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_insert_rows", full_disk)
    monkeypatch.setattr(os, "ftruncate", no_truncate)
    with pytest.raises(OSError):
        store.put_many([first], owner)
    monkeypatch.setattr(store, "_insert_rows", real_insert)
    monkeypatch.undo()  # os.ftruncate works again

    store.put_many([second], owner)
    loc = store.locate(second[0])
    assert store.read_run(loc.pack, loc.offset, loc.length) == second[1]
    with pytest.raises(LookupError):
        store.locate(first[0])
    store.close()


def test_pack_fd_cache_is_bounded(tmp_path: Path) -> None:
    """Reading from many more packs than the cache holds keeps the number of open fds bounded."""
    store = PackStore(tmp_path, pack_size=4096)
    owner = object()
    chunks = [chunk(3000, i) for i in range(150)]
    for c in chunks:
        store.put_many([c], owner)
    assert len(store.pack_ids()) >= 150
    before = open_fds()
    for _ in range(2):  # twice: evicted packs are opened again and read right
        for cid, data in chunks:
            loc = store.locate(cid)
            assert store.read_run(loc.pack, loc.offset, loc.length) == data
            assert open_fds() - before <= 64
    store.close()
    assert open_fds() < before


def test_pack_fd_in_use_is_never_evicted(tmp_path: Path) -> None:
    store = PackStore(tmp_path, pack_size=4096)
    owner = object()
    chunks = [chunk(3000, 1000 + i) for i in range(100)]
    for c in chunks:
        store.put_many([c], owner)
    held_cid, held_data = chunks[0]
    held = store.locate(held_cid)
    with store.pack_fd(held.pack) as fd:
        for cid, data in chunks[1:]:
            loc = store.locate(cid)
            assert store.read_run(loc.pack, loc.offset, loc.length) == data
        assert os.pread(fd, held.length, held.offset) == held_data
    store.close()


def test_local_reads_check_the_rows_quick_sum(tmp_path: Path) -> None:
    """A row written now carries a quick sum of its chunk's bytes and a read checks that sum, not
    the id: a wrong sum fails the read though the bytes are intact. A row without one (mapped
    before sums existed, or by recovery) is checked by its id: changed bytes fail, intact ones pass."""
    store = PackStore(tmp_path)
    cid, data = chunk(100_000, -1)
    store.put_many([(cid, data)], object())
    loc = store.locate_many([cid])[cid]
    assert loc.sum == quick_sum(data) and len(loc.sum) == 8

    index = Index(1, 1 << 20, 4 << 20)
    index.append(cid, len(data))

    def read() -> bytes:  # as a put-back reads it
        return scatter_read(store, index)

    assert read() == data
    store.db.execute("UPDATE chunks SET sum = ? WHERE id = ?", (quick_sum(data + b"x"), cid))
    with pytest.raises(ChunkCorrupt):
        read()
    store.db.execute("UPDATE chunks SET sum = NULL WHERE id = ?", (cid,))
    assert read() == data
    with open(store.pack_path(loc.pack), "r+b") as f:
        f.seek(loc.offset + 500)
        byte = f.read(1)
        f.seek(loc.offset + 500)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ChunkCorrupt):
        read()
    store.close()


def test_a_put_back_reads_the_stream_in_order_and_repeats_once(tmp_path: Path) -> None:
    """A put-back's reads (``Restore.scatter``) give every byte of the stored stream at its place,
    whatever the chunk sizes (pieces larger than a piece buffer, a one-byte chunk), and a chunk the
    file has again later (zeros, a repeat) is read from the packs once."""
    store, index, whole = stream_store(tmp_path, [300_000, 5_000, 2_500_000, 70_000, 900_000, 1])
    try:
        reads = store.counters.pack_reads
        assert scatter_read(store, index) == whole
        once = store.counters.pack_reads - reads
        again = index.copy()
        for i in (1, 3, 1):  # chunks read already, again
            again.append(index.ids[i], index.length(i))
        want = whole + whole[300_000:305_000] + whole[2_805_000:2_875_000] + whole[300_000:305_000]
        reads = store.counters.pack_reads
        assert scatter_read(store, again) == want
        assert store.counters.pack_reads - reads == once  # the repeats were not read again
    finally:
        store.close()


def test_a_put_back_fails_a_changed_chunk(tmp_path: Path) -> None:
    """A chunk whose bytes changed on disk fails the put-back with ChunkCorrupt, never wrong bytes."""
    store, index, whole = stream_store(tmp_path, [200_000, 200_000, 200_000])
    loc = store.locate_many([index.ids[1]])[index.ids[1]]
    with open(store.pack_path(loc.pack), "r+b") as f:
        f.seek(loc.offset + 7)
        f.write(bytes([whole[200_007] ^ 0xFF]))
    try:
        with pytest.raises(ChunkCorrupt):
            scatter_read(store, index)
    finally:
        store.close()


def test_the_pack_writer_cuts_off_a_batch_whose_commit_fails(tmp_path: Path) -> None:
    """Record before bytes, bytes before rows: a batch whose commit fails is cut off again, and the
    next one is written where it began; a forward scan then finds only what was committed."""
    created: list[Path] = []

    def new_pack() -> tuple[int, int]:
        created.append(tmp_path / f"{len(created) + 1}.pack")
        return len(created), create_pack_file(created[-1])

    def refuse(batch: Batch) -> None:
        raise OSError(errno.EIO, "the map refused the rows")

    committed: list[Batch] = []
    writer = PackWriter(new_pack, 1 << 20, fsync=False)
    with pytest.raises(OSError):
        writer.append([chunk(50_000, -1)], refuse)
    assert os.path.getsize(created[0]) == PACK_HEADER_SIZE
    kept = writer.append([chunk(30_000, -1), chunk(20_000, -1)], committed.append)
    writer.close()
    fd = os.open(created[0], os.O_RDONLY)
    try:
        found = scan(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    assert found.batches == 1 and committed == [kept]
    assert [(c.id, 1, c.offset) for c in found.chunks] == kept.placed()


def test_the_pack_writer_keeps_packs_within_their_size(tmp_path: Path) -> None:
    """A large call is split into batches so that each pack stays within ``pack_size`` (a chunk
    larger than a pack gets a pack of its own); every batch is committed with its pack and end."""
    sizes: dict[int, Path] = {}

    def new_pack() -> tuple[int, int]:
        pack = len(sizes) + 1
        sizes[pack] = tmp_path / f"{pack}.pack"
        return pack, create_pack_file(sizes[pack])

    committed: list[Batch] = []
    writer = PackWriter(new_pack, 100_000, fsync=True)
    writer.append_fitting([chunk(30_000, i) for i in range(10)] + [chunk(160_000, 99)], committed.append)
    writer.close()
    assert len(sizes) > 3
    for pack, path in sizes.items():
        size = path.stat().st_size
        assert size <= 100_000 or [len(d) for b in committed if b.pack == pack for _, d in b.chunks] == [160_000]
        assert max(b.end for b in committed if b.pack == pack) == size


def test_a_compaction_copy_whose_rows_are_refused_is_cut_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GC copies through the same pack writer as saves: when the map refuses to move the rows, the
    copy is cut off (its output pack, left empty, is deleted) and the chunk stays where it was."""
    repo = Repository(tmp_path)
    store = repo.store
    dead, live = chunk(100_000, -1), chunk(10_000, -1)
    store.put_many([dead, live], object())
    store.delete_chunks([dead[0]])
    before = store.pack_ids()

    def refuse(*args: object) -> int:
        raise OSError(errno.EIO, "chunk map replaced")

    monkeypatch.setattr(store, "move_chunks", refuse)
    report = gcreport.GCReport()
    gccompact.reclaim_packs(repo, 0.5, report, None)
    assert report.packs_compacted == 0 and any("not compacted" in e for e in report.errors)
    assert store.pack_ids() == before
    assert store.get_many([live[0]]) == [live[1]]
    store.close()
