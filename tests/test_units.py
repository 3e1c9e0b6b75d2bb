"""Unit tests of the pure pieces: index format, chunker, pack store, file content model."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from helpers import prepare_commit, rand_bytes, truncate_content, write_content
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchunkfs.file.files import Files
from kvchunkfs.format import index as idx
from kvchunkfs.format.chunker import Chunker, chunk_id
from kvchunkfs.format.cutter import GROUP_WIDTH, Cutter
from kvchunkfs.store.packformat import BATCH_HEADER_SIZE, ENTRY_SIZE, PACK_HEADER_SIZE
from kvchunkfs.store.repository import Repository, StoreSettings

MiB = 1 << 20


def test_index_roundtrip_and_layout():
    ix = idx.Index(16384, 65536, 262144)
    ix.append(b"\x01" * 32, 1000)
    ix.append(b"\x02" * 32, 50)
    data = idx.encode(ix)
    assert len(data) == 48 + 16 + 2 * 40 + 40
    assert data[8:16] == (0x96824D9C7B129FF9).to_bytes(8, "little")
    assert int.from_bytes(data[16:24], "little") & idx.CA_FORMAT_SHA512_256 == 0  # SHA-256 ids
    back = idx.decode(data)
    assert back.ends == [1000, 1050] and back.ids == ix.ids and back.size == 1050
    assert back.find(0) == 0 and back.find(999) == 0 and back.find(1000) == 1 and back.find(1050) == 2


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: d[:-1],
        lambda d: b"x" * len(d),
        lambda d: d[:8] + b"\0" * 8 + d[16:],
        lambda d: d[:104] + (5).to_bytes(8, "little") + d[112:],  # offsets not increasing
        lambda d: d[:16] + (idx.CA_FORMAT_SHA512_256).to_bytes(8, "little") + d[24:],
        lambda d: b"",
    ],
)
def test_index_rejects_garbage(mangle):
    ix = idx.Index(1, 2, 3)
    ix.append(b"\x01" * 32, 10)
    ix.append(b"\x02" * 32, 10)
    with pytest.raises(idx.IndexFormatError):
        idx.decode(mangle(idx.encode(ix)))


def _ids(n: int, seed: bytes = b"") -> list[bytes]:
    return [hashlib.sha256(seed + i.to_bytes(8, "little")).digest() for i in range(n)]


def test_index_reads_its_entries_and_finds_offsets():
    ix = idx.Index(1, 2, 3)
    ids = _ids(5)
    for k, cid in enumerate(ids):
        ix.append(cid, 10 * (k + 1))  # ends 10, 30, 60, 100, 150
    assert len(ix) == len(ix.ids) == len(ix.ends) == 5 and ix.size == 150
    assert ix.ends == [10, 30, 60, 100, 150] and list(ix.ids) == ids and ix.ids == ids
    assert ix.ids[-1] == ids[4] and ix.ids[1:3] == ids[1:3] and ix.ends[-2:] == [100, 150]
    assert [ix.start(i) for i in range(5)] == [0, 10, 30, 60, 100]
    assert [ix.length(i) for i in range(5)] == [10, 20, 30, 40, 50]
    assert [ix.find(o) for o in (0, 9, 10, 29, 30, 149, 150, 10**9)] == [0, 0, 1, 1, 2, 4, 5, 5]
    assert ids[3] in ix.ids and b"\0" * 32 not in ix.ids and ix.ends[0].to_bytes(8, "little") + b"\0" * 24 not in ix.ids
    with pytest.raises(IndexError):
        ix.ids[5]
    with pytest.raises(ValueError):
        ix.append(b"short", 1)
    ix.pop()
    assert ix.size == 100 and ix.ids == ids[:4]
    empty = idx.Index(1, 2, 3)
    assert empty.size == 0 and empty.find(0) == 0 and list(empty.ids) == [] and not empty.might_hold(ids[0])
    assert idx.decode(idx.encode(empty)) == empty


def test_index_copies_are_independent_and_share_until_changed():
    ix = idx.decode(idx.encode(idx.Index(1, 2, 3, [5, 9], _ids(2))))
    copy = ix.copy()
    assert copy == ix and copy is not ix
    copy.ids[0] = b"\7" * 32
    copy.ends[1] = 12
    copy.append(b"\x08" * 32, 3)
    assert ix.ends == [5, 9] and ix.ids == _ids(2), "a change to a copy reached the original"
    assert copy.ends == [5, 12, 15] and copy.ids == [b"\7" * 32, _ids(2)[1], b"\x08" * 32]
    again = copy.copy()
    copy.pop()
    assert len(again) == 3 and len(copy) == 2
    assert idx.decode(idx.encode(again)) == again


def test_index_might_hold_never_misses_an_id():
    ix = idx.Index(1, 2, 3)
    for cid in _ids(1000):
        ix.append(cid, 7)
    assert all(ix.might_hold(cid) for cid in _ids(1000))
    assert sum(ix.might_hold(cid) for cid in _ids(1000, b"other")) == 0  # 64-bit prefixes: no collision here
    ix.append(b"\1" * 32, 1)  # a change: the prefixes are sorted again
    assert ix.might_hold(b"\1" * 32)


@pytest.mark.parametrize("at", [0, 1, 999])
def test_index_rejects_offsets_not_increasing_anywhere(at: int):
    ix = idx.Index(1, 2, 3)
    for cid in _ids(1000):
        ix.append(cid, 10)
    ix.ends[at] = ix.ends[at - 1] if at else 0
    with pytest.raises(idx.IndexFormatError, match="not increasing"):
        idx.decode(idx.encode(ix))


def test_decoding_a_million_chunk_index_costs_no_object_per_chunk():
    """An index of a million chunks (a 64 GiB file) decodes into its own 40 MB of table, shared
    with the bytes read: a few MiB more at the peak, not ~110 bytes of Python objects per chunk."""
    n = 1_000_000
    table = np.zeros(n, dtype=[("end", "<u8"), ("id", "V32")])
    table["end"] = np.arange(1, n + 1, dtype=np.uint64) * 65536
    table["id"] = np.frombuffer(hashlib.shake_256(b"ids").digest(32 * n), dtype="V32")
    header = struct.pack("<6Q2Q", 48, idx.CA_FORMAT_INDEX, idx.FEATURE_FLAGS, 16384, 65536, 262144,
                         0xFFFFFFFFFFFFFFFF, idx.CA_FORMAT_TABLE)  # fmt: skip
    tail = struct.pack("<5Q", 0, 0, 48, 16 + 40 * n + 40, idx.CA_FORMAT_TABLE_TAIL_MARKER)
    data = header + table.tobytes() + tail
    del table
    tracemalloc.start()
    try:
        index = idx.decode(data)
        assert len(index) == n and index.size == n * 65536
        assert index.find(n * 65536 // 2) == n // 2 and index.length(n - 1) == 65536
        assert index.ids[n - 1] == data[-40 - 32 : -40]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MiB, f"decoding took {peak / MiB:.0f} MiB above the index bytes"
    assert idx.encode(index) == data


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 3 * MiB), min_size=1, max_size=8), st.integers(0, 2**32))
def test_stream_chunking_equals_whole_buffer(pieces, seed):
    data = rand_bytes(sum(pieces), seed)
    c = Cutter(16384, 65536, 262144, "cdc")
    whole = [bytes(p) for p in c.cut_all(data)]
    assert whole == [bytes(p) for p in Chunker(16384, 65536, 262144).cut(data)]
    state, tail, out, pos = c.initial(), b"", [], 0
    for n in pieces:
        buf = tail + data[pos : pos + n]
        done, state = c.cut(state, buf, final=False)
        out += [bytes(p) for p in done]
        tail, pos = buf[sum(len(p) for p in done) :], pos + n
    out += [bytes(p) for p in c.cut(state, tail, final=True)[0]]
    assert out == whole
    assert all(16384 <= len(p) <= 262144 for p in whole[:-1])


def test_chunking_is_content_defined():
    c = Chunker(16384, 65536, 262144)
    base = rand_bytes(8 * MiB, 40)
    edited = base[: 3 * MiB] + b"inserted" + base[3 * MiB :]
    a = {chunk_id(p) for p in c.cut(base)}
    b = {chunk_id(p) for p in c.cut(edited)}
    assert len(a & b) >= len(a) - 3  # an insertion changes only the chunks around it


def test_packstore_dedup_pins_and_reads(tmp_path: Path):
    repo = Repository(tmp_path, StoreSettings(pack_size=1 * MiB))
    store = repo.store
    chunks = [(chunk_id(d), d) for d in (rand_bytes(300_000, i) for i in range(8))]
    owner = object()
    assert store.put_many(chunks[:4], owner) == 4 * 300_000
    assert store.put_many(chunks, owner) == 4 * 300_000  # only the missing half is written
    assert store.counters.chunks_deduped == 4
    assert len(store.pack_ids()) >= 2, "packs roll over at pack_size"
    for cid, data in chunks:
        loc = store.locate(cid)
        assert store.read_run(loc.pack, loc.offset, loc.length) == data
    assert store.pinned() == {cid for cid, _ in chunks}
    store.unpin(owner)
    assert store.pinned() == set()
    repo.close()


def test_packstore_concurrent_writers(tmp_path: Path):
    repo = Repository(tmp_path)
    datas = [rand_bytes(100_000, i % 20) for i in range(200)]

    def work(part):
        for d in part:
            repo.store.put_many([(chunk_id(d), d)], threading.current_thread())

    threads = [threading.Thread(target=work, args=(datas[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n, total = repo.store.stats()
    assert n == 20 and total == 20 * 100_000
    repo.close()


# -- FileContent against a bytearray model --------------------------------------------------

ops = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 600_000)),
    st.tuples(st.just("write"), st.integers(0, 3 * MiB), st.integers(1, 200_000)),
    st.tuples(st.just("truncate"), st.integers(0, 3 * MiB)),
    st.tuples(st.just("commit")),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(ops, min_size=1, max_size=12), st.integers(0, 1000))
def test_file_content_matches_model(tmp_path_factory, script, seed):
    repo = Repository(tmp_path_factory.mktemp("store"))
    files = Files(repo)
    content = files.content(repo.empty_index())
    model = bytearray()
    rnd = 0
    try:
        for op in script:
            rnd += 1
            if op[0] in ("append", "write"):
                off = len(model) if op[0] == "append" else op[1]
                data = rand_bytes(op[-1], seed * 100 + rnd)
                write_content(content, off, data)
                if off > len(model):
                    model += bytes(off - len(model))
                model[off : off + len(data)] = data
            elif op[0] == "truncate":
                truncate_content(content, op[1])
                del model[op[1] :]
                model += bytes(op[1] - len(model))
            else:
                index, gen = prepare_commit(content)
                content.committed(gen)
                assert files.read_file(index, 0, index.size + 1) == model
            assert content.size == len(model)
            assert content.read(0, len(model) + 10, files.read_chunks) == model
    finally:
        content.close()
        files.close()
        repo.close()
    for leftover in os.listdir(repo.staging):
        raise AssertionError(f"staging file left behind: {leftover}")


def test_packstore_batch_larger_than_iov_max(tmp_path: Path):
    """A backlog of many small chunks is one batch; writev takes at most IOV_MAX buffers."""
    repo = Repository(tmp_path)
    chunks = [(chunk_id(d), d) for d in (i.to_bytes(4, "little") * 100 for i in range(3000))]
    assert repo.store.put_many(chunks, object()) == 3000 * 400
    for cid, data in chunks[::97]:
        loc = repo.store.locate(cid)
        assert repo.store.read_run(loc.pack, loc.offset, loc.length) == data
    repo.close()


def test_one_large_batch_is_split_across_packs(tmp_path: Path):
    """A backlog arrives as one batch; packs still stay within pack_size (GC deletes whole packs)."""
    repo = Repository(tmp_path, StoreSettings(pack_size=1 * MiB))
    chunks = [(chunk_id(d), d) for d in (rand_bytes(200_000, 100 + i) for i in range(16))]
    repo.store.put_many(chunks, object())
    sizes = [repo.store.pack_path(p).stat().st_size for p in repo.store.pack_ids()]
    records = len(sizes) * (PACK_HEADER_SIZE + BATCH_HEADER_SIZE) + 16 * ENTRY_SIZE  # one batch per pack
    assert len(sizes) >= 3 and max(sizes) <= 1 * MiB and sum(sizes) == 16 * 200_000 + records
    for cid, data in chunks:
        loc = repo.store.locate(cid)
        assert repo.store.read_run(loc.pack, loc.offset, loc.length) == data
    repo.close()


def test_packstore_is_a_chunk_store(tmp_path: Path):
    """The interface the file layer depends on, exercised on the pack store."""
    from kvchunkfs.store.chunkstore import ChunkStore
    from kvchunkfs.store.packs import ChunkMissing

    repo = Repository(tmp_path)
    store: ChunkStore = repo.store
    chunks = [(chunk_id(d), d) for d in (rand_bytes(70_000, i) for i in range(3))]
    owner = object()
    assert store.put_many(chunks, owner) == 3 * 70_000
    assert store.put_many(chunks, owner) == 0
    assert store.has([cid for cid, _ in chunks] + [b"\0" * 32]) == {cid for cid, _ in chunks}
    assert store.get_many([chunks[2][0], chunks[0][0]]) == [chunks[2][1], chunks[0][1]]
    with pytest.raises(ChunkMissing):
        store.get_many([b"\1" * 32])
    store.unpin(owner)
    store.sync()
    repo.close()


def test_chunk_ids_on_every_core_are_the_ids_in_order() -> None:
    """A closing batch's ids hashed in slices on several threads are each piece's SHA-256, in the
    pieces' order, whatever their count and sizes (one piece, fewer pieces than threads, uneven)."""
    import hashlib

    from kvchunkfs.file import hashing

    rng = random.Random(3)
    for sizes in ([64 << 10] * 40, [5 << 20], [1 << 20, 3], [3, 2 << 20, 7, 300 << 10, 1 << 20], []):
        pieces = [memoryview(rng.randbytes(n)) for n in sizes]
        want = [hashlib.sha256(p).digest() for p in pieces]
        assert hashing.chunk_ids(pieces, parallel=True) == want
        assert hashing.chunk_ids(pieces) == want


def test_chunk_ids_turn_to_every_core_once_a_commit_waits() -> None:
    """A batch hashed while the file is still being written asks between steps whether a commit now
    waits for it; from the first yes the rest is hashed on the helper threads too, and the ids are
    still each piece's SHA-256 in order."""
    import hashlib
    import threading

    from kvchunkfs.file import hashing

    rng = random.Random(4)
    pieces = [memoryview(rng.randbytes(64 << 10)) for _ in range(96)]  # 6 MiB: six steps
    want = [hashlib.sha256(p).digest() for p in pieces]
    asked: list[int] = []
    threads: set[str] = set()
    real = hashing.chunk_id

    def spy(p: hashing.Buffer) -> bytes:
        threads.add(threading.current_thread().name)
        return real(p)

    def hurry() -> bool:
        asked.append(len(asked))
        return len(asked) > 2  # a commit starts waiting after two steps

    hashing.chunk_id = spy  # type: ignore[assignment]
    try:
        assert hashing.chunk_ids(pieces, parallel=lambda: False) == want
        assert len(threads) == 1, "not hurried: every piece on the asking thread"
        asked.clear()
        assert hashing.chunk_ids(pieces, parallel=hurry) == want
    finally:
        hashing.chunk_id = real  # type: ignore[assignment]
    assert len(asked) == 3, "asked before each step until the answer was yes"
    assert any(t.startswith("hash") for t in threads), "the rest went to the helper threads"


def _relayout_file() -> tuple[bytes, bytes, idx.Index, list]:
    """A llama-shaped state file (two stored groups), its stored stream, index and groups."""
    from e2e import ggsq
    from kvchunkfs.format import llama_state as ls

    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(1500, 5), ggsq.Spec(n_layer=6, row_bytes=512))
    cutter = Cutter(16 << 10, 64 << 10, 256 << 10, "relayout")
    chunks, _ = cutter.cut(cutter.initial(), data, final=True)
    index = idx.Index(16 << 10, 64 << 10, 256 << 10)
    for c in chunks:
        index.append(chunk_id(c), len(c))
    groups = [g for g in ls.segments(data, GROUP_WIDTH) if g.group is not None and g.end is not None]
    return data, b"".join(bytes(c) for c in chunks), index, groups


def test_a_read_through_the_groups_puts_each_group_back_whole() -> None:
    """``FileGroups.read_file`` (appends, copies of a file being written, tools): a read of the
    file's end or of all of it returns the file's bytes, each group it touches put back whole."""
    from kvchunkfs.file.groups import FileGroups

    data, stored, index, groups = _relayout_file()
    assert len(groups) == 2 and groups[1].end == len(data)

    def read_chunks(ix: idx.Index, offset: int, size: int, ahead: int | None = None) -> bytes:
        return stored[offset : offset + size]

    fg = FileGroups(GROUP_WIDTH)
    tail = len(data) - 8192
    assert bytes(fg.read_file(index, tail, 8192, read_chunks)) == data[tail:]
    assert bytes(fg.read_file(index, 0, len(data), read_chunks)) == data
    assert bytes(fg.read_file(index, 100, 5000, read_chunks)) == data[100:5100]


def test_prestart_starts_the_threads_at_once() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from kvchunkfs.file.queues import prestart

    pool = ThreadPoolExecutor(5, thread_name_prefix="prestart-test")
    try:
        prestart(pool, 3)
        assert sum(t.name.startswith("prestart-test") for t in threading.enumerate()) == 3
    finally:
        pool.shutdown()


MAPS = """\
55d0c0000000-55d0c0021000 r--p 00000000 fd:01 12 /usr/bin/python3.11
7f00a0000000-7f00a0010000 r--p 00000000 fd:01 34 /usr/lib/x86_64-linux-gnu/libsqlite3.so.0.8.6
7f00a0010000-7f00a0100000 r-xp 00010000 fd:01 34 /usr/lib/x86_64-linux-gnu/libsqlite3.so.0.8.6
7f00a0100000-7f00a0101000 ---p 00100000 fd:01 34 /usr/lib/x86_64-linux-gnu/libsqlite3.so.0.8.6
7f00a0200000-7f00a0300000 r-xp 00000000 fd:01 56 /venv/site-packages/numpy.libs/libscipy_openblas64_.so
7f00a0400000-7f00a0500000 r--s 00000000 fd:01 78 /store/packs/0001.pack
7f00a0600000-7f00a0601000 r-xp 00000000 fd:01 90 /venv/site-packages/xxhash/_xxhash.cpython-311-x86_64-linux-gnu.so
7f00a0700000-7f00a0800000 rw-p 00000000 00:00 0 [heap]
7f00a0900000-7f00a0901000 r--p 00000000 fd:01 91 /opt/lib/libweird.so (deleted)
"""


def test_prefault_covers_the_shared_libraries_only() -> None:
    """Code pages of shared libraries, never a data file the daemon maps, nor numpy's BLAS."""
    from kvchunkfs.fuse.prefault import library_ranges

    assert library_ranges(MAPS.splitlines(keepends=True)) == [
        (0x7F00A0000000, 0x7F00A0010000),
        (0x7F00A0010000, 0x7F00A0100000),
        (0x7F00A0600000, 0x7F00A0601000),
    ]


PREFAULT_CHECK = """
import sqlite3, sys
from kvchunkfs.fuse.prefault import prefault_libraries

def resident():
    rss = size = 0
    lib = False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            lib = fields[-1].startswith("/") and "libsqlite3" in fields[-1] and fields[1].startswith("r")
        elif lib and fields[0] == "Size:":
            size += int(fields[1])
        elif lib and fields[0] == "Rss:":
            rss += int(fields[1])
    return rss, size

before, size = resident()
done = prefault_libraries()
after, _ = resident()
print(before, after, size, done)
"""


def test_prefault_maps_every_page_of_a_library() -> None:
    """A library the process has barely run (SQLite, just imported) is resident whole afterwards:
    the cache dropping that stands for a cold boot leaves mapped pages in place."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PREFAULT_CHECK], capture_output=True, text=True, check=True)
    before, after, size, done = (int(x) for x in out.stdout.split())
    assert size > 0 and done > size * 1024
    assert before < size and after == size, (before, after, size)


def test_a_large_index_is_checked_in_batches_and_read_without_kept_locations(tmp_path: Path, monkeypatch):
    """Past LOCATE_ALL chunks an open keeps no location per chunk (reads look up their window),
    still checks every chunk's length against the map, and reads the right bytes; its pin is the
    index. Shrunk limits stand in for an index of a million chunks."""
    from kvchunkfs.file import files as files_mod
    from kvchunkfs.store.stubs import StubError

    monkeypatch.setattr(files_mod, "LOCATE_ALL", 8)
    monkeypatch.setattr(files_mod, "CHECK_BATCH", 5)
    repo = Repository(tmp_path, StoreSettings(chunker="cdc"))
    files = Files(repo)
    try:
        chunks = [rand_bytes(300 + 7 * i, i) for i in range(40)]
        index = repo.empty_index()
        for c in chunks:
            index.append(chunk_id(c), len(c))
        owner = object()
        repo.store.put_many([(chunk_id(c), c) for c in chunks], owner)
        repo.install(repo.prepare_stub(index, None, False), "big")
        repo.store.unpin(owner)
        whole = b"".join(chunks)
        content = files.load("big")
        try:
            assert content.locations == {} and content.all_local
            assert content.read(0, len(whole) + 1, files.read_chunks) == whole
            assert content.read(5000, 3000, files.read_chunks) == whole[5000:8000]
            assert repo.store.is_pinned(chunk_id(chunks[33])) and not repo.store.is_pinned(b"\1" * 32)
        finally:
            content.close()
        assert not repo.store.is_pinned(chunk_id(chunks[33]))
        liar = index.copy()
        liar.ends[37] += 1  # chunk 37 one byte longer in the index than in the map (a later batch)
        for i in range(38, 40):
            liar.ends[i] += 1
        repo.install(repo.prepare_stub(liar, None, False), "liar")
        with pytest.raises(StubError, match="chunk 37"):
            files.load("liar")
    finally:
        files.close()
        repo.close()
