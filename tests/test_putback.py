"""Putting a stored snapshot back into a whole file (file/putback.py): every stored byte written
where the file has it, from pieces cut anywhere (inside a group's headers or records) and written
in any order, by several threads; the checksum summed from the file in file order; zeros left as
holes; and memory that does not grow with the file."""

from __future__ import annotations

import os
import random
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from test_format_cutter import LAYOUTS

from e2e import ggsq
from kvchunkfs.file import putback
from kvchunkfs.format import llama_state as ls
from kvchunkfs.format import relayout
from kvchunkfs.format.cutter import GROUP_WIDTH
from kvchunkfs.format.filerecord import file_hasher

MiB = 1 << 20


def stored_form(data: bytes) -> tuple[bytes, list[ls.Segment]]:
    """The stored stream of a file (its groups permuted, as chunker relayout stores them)."""
    groups = [s for s in ls.segments(data, GROUP_WIDTH) if s.group is not None]
    out = bytearray(data)
    for g in groups:
        assert g.end is not None
        out[g.start : g.end] = relayout.to_stream(g, data[g.start : g.end])
    return bytes(out), groups


def cuts(size: int, rng: random.Random, most: int) -> list[tuple[int, int]]:
    """``[0, size)`` cut into pieces of 1 to ``most`` bytes, anywhere."""
    out, pos = [], 0
    while pos < size:
        n = min(size - pos, rng.randint(1, most))
        out.append((pos, n))
        pos += n
    return out


def put_back(tmp_path: Path, stored: bytes, groups: list[ls.Segment], pieces: list[tuple[int, int]], threads: int = 1):
    path = tmp_path / "whole"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        out = putback.PutBack(fd, len(stored), groups)
        view = memoryview(stored)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda p: out.write(p[0], view[p[0] : p[0] + p[1]]), pieces))
        written = 0
        for pos, n in sorted(pieces):  # summed as the written prefix grows, as the put-back does
            written = max(written, pos + n)
            out.sum_to(written)
        return out.finish(), path
    finally:
        os.close(fd)


def file_sum(data: bytes) -> bytes:
    h = file_hasher()
    h.update(data)
    return h.digest()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_is_put_back_from_pieces_cut_anywhere_in_any_order(tmp_path, name):
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(300, seed=5), LAYOUTS[name])
    stored, groups = stored_form(data)
    rng = random.Random(name)
    pieces = cuts(len(stored), rng, 20_000)
    rng.shuffle(pieces)
    got_sum, path = put_back(tmp_path, stored, groups, pieces, threads=3)
    got = path.read_bytes()
    assert got == data
    assert got_sum == file_sum(data)


def test_transposed_v_and_records_split_between_pieces(tmp_path):
    spec = ggsq.Spec(n_layer=3, row_bytes=96, v_trans=True)
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(200, seed=1), spec)
    stored, groups = stored_form(data)
    assert any(g.group is not None and g.group.el for g in groups)
    for most in (1, 7, 1000):  # single bytes, records cut everywhere, whole records
        pieces = cuts(len(stored), random.Random(most), most)
        got_sum, path = put_back(tmp_path, stored, groups, pieces)
        assert path.read_bytes() == data
        assert got_sum == file_sum(data)


def test_zeros_stay_holes(tmp_path):
    data = bytes(4 * MiB) + b"tail"
    got_sum, path = put_back(tmp_path, data, [], [(0, 2 * MiB), (2 * MiB, 2 * MiB), (4 * MiB, 4)])
    assert path.read_bytes() == data and got_sum == file_sum(data)
    assert os.stat(path).st_blocks * 512 < MiB  # only the piece that is not zeros was written


def test_a_short_stream_is_an_error(tmp_path):
    data = b"x" * 10_000
    fd = os.open(tmp_path / "w", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        out = putback.PutBack(fd, len(data), [])
        out.write(0, data[:9_000])
        out.sum_to(9_000)
        with pytest.raises(OSError, match="short"):
            out.finish()
        with pytest.raises(OSError, match="past"):
            out.write(9_000, data[:2_000])
    finally:
        os.close(fd)


def test_memory_does_not_grow_with_the_group(tmp_path):
    """A group of 48 MiB put back from 1 MiB pieces: Python allocates a few pieces' worth, not the
    group (the put-back before held each whole group and the whole file's chunks)."""
    spec = ggsq.Spec(n_layer=12, row_bytes=512)
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(4200, seed=2), spec)
    stored, groups = stored_form(data)
    assert max(g.end - g.start for g in groups) > 20 * MiB
    pieces = [(p, min(MiB, len(stored) - p)) for p in range(0, len(stored), MiB)]
    tracemalloc.start()
    try:
        got_sum, path = put_back(tmp_path, stored, groups, pieces, threads=3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got_sum == file_sum(data)
    assert path.read_bytes() == data
    assert peak < 8 * MiB, f"peak {peak / MiB:.1f} MiB of Python allocations"


def test_scratch_is_per_thread():
    s = putback._Scratch()
    a = s.take(10)
    got = []
    with ThreadPoolExecutor(1) as pool:
        got.append(pool.submit(lambda: s.take(10)).result())
    assert not np.shares_memory(a, got[0])


def test_a_put_back_without_a_checksum_to_compare_reads_nothing_back(tmp_path):
    """A snapshot without a record (fetched from the bucket): nothing to compare a sum with, so its
    file is not read back (the fd here cannot be read: a read would fail)."""
    data = os.urandom(3 * MiB)
    path = tmp_path / "w"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        out = putback.PutBack(fd, len(data), [], summed=False)
        out.write(MiB, memoryview(data)[MiB:])
        out.write(0, memoryview(data)[:MiB])
        out.sum_to(len(data))
        assert out.finish() == b""
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    fd = os.open(path, os.O_WRONLY)
    try:
        out = putback.PutBack(fd, len(data), [], summed=False)
        out.write(0, memoryview(data)[:MiB])
        out.sum_to(MiB)
        with pytest.raises(OSError, match="short"):  # still an error if not every byte was written
            out.finish()
    finally:
        os.close(fd)


def test_fetched_chunks_go_where_the_index_has_them():
    """``restore._pieces``: a fetched buffer's chunks (pack order) written at their places in the
    stored stream; neighbours in both the buffer and the index as one piece, a chunk the file has
    twice at both places, chunks the file did not lack skipped; a length the index disagrees with
    is never written."""
    from kvchunkfs.file.restore import _pieces
    from kvchunkfs.format.index import Index
    from kvchunkfs.store.packs import ChunkCorrupt

    chunks = {bytes([k]) * 32: os.urandom(100 + k) for k in range(6)}
    ids = list(chunks)
    order = [0, 1, 2, 3, 1, 4, 5]  # the file: c1 twice; c5 was local already (not in places)
    index = Index(1, 1, 1)
    for k in order:
        index.append(ids[k], len(chunks[ids[k]]))
    places: dict[bytes, list[int]] = {}
    for i, k in enumerate(order):
        if k != 5:
            places.setdefault(ids[k], []).append(i)
    pack = [0, 1, 2, 3, 5, 4]  # a range GET's chunks, back to back
    buf = memoryview(b"".join(chunks[ids[k]] for k in pack))
    parts, off = [], 0
    for k in pack:
        parts.append((ids[k], off, len(chunks[ids[k]])))
        off += len(chunks[ids[k]])
    pieces = list(_pieces(index, places, buf, parts))
    # c0; c1 at both places; c2 c3 as one piece; c4 alone (c5 lies between them in the buffer)
    assert [(pos, len(p)) for pos, p in pieces] == [
        (0, 100), (index.start(1), 101), (index.start(4), 101), (index.start(2), 102 + 103), (index.start(5), 104),
    ]  # fmt: skip
    file = bytearray(index.size)
    for pos, piece in pieces:
        file[pos : pos + len(piece)] = piece
    want = b"".join(chunks[ids[k]] for k in order)
    assert file[: index.start(6)] == want[: index.start(6)]  # every place but the local c5's
    bad = Index(1, 1, 1)
    for k in order:
        bad.append(ids[k], len(chunks[ids[k]]) + (k == 3))
    with pytest.raises(ChunkCorrupt):
        list(_pieces(bad, places, buf, parts))
