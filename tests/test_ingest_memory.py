"""Ingestion of a staged save cuts a relayout group from the staged file a window at a time
(``relayout.GroupReader``, ``Cutter.group_windows``): the same chunks as cutting the group whole,
and memory that does not grow with the group. No mount: a real store and ``store_file``."""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_format_cutter import SIZES

from e2e import ggsq
from kvchunkfs.file.chunking import store_file
from kvchunkfs.file.files import Files
from kvchunkfs.format import llama_state as ls
from kvchunkfs.format import relayout
from kvchunkfs.format.chunker import chunk_id
from kvchunkfs.format.cutter import GROUP_WIDTH, Cutter
from kvchunkfs.format.filerecord import group_sum
from kvchunkfs.store.repository import Repository, StoreSettings

KiB, MiB = 1 << 10, 1 << 20


def reader(data: bytes) -> relayout.ReadInto:
    def read(off: int, out: memoryview) -> None:
        assert off + len(out) <= len(data)
        out[:] = data[off : off + len(out)]

    return read


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 300),
    st.sampled_from([1, 2, 3, 4, 8]),
    st.integers(1, 40),
    st.integers(0, 16),
    st.booleans(),
    st.sampled_from([1, 1000, 5000, 64 * KiB]),
    st.integers(0, 2**32),
)
def test_a_group_cut_a_window_at_a_time_is_cut_as_a_whole(count, cells, el, runs, lead, trans, window, seed):
    width = el * runs
    g = ls.Group(count, lead, width, el if trans else 0, cells)
    start = 100
    end = start + lead + count * (12 + cells * width)
    seg = ls.Segment(start, end, start + lead + 12 * count, count * width, 0, seed % 7, g)
    data = np.random.default_rng(seed).integers(0, 256, end + 50, np.uint8).tobytes()
    c = Cutter(1 * KiB, 4 * KiB, 16 * KiB, "relayout")
    whole: list[memoryview] = []
    c._cut_segment(seg, memoryview(data)[start:end], start, start, True, whole)
    r, windows = c.group_windows(seg, reader(data), window)
    got = [bytes(x) for w in windows for x in w]
    assert got == [bytes(x) for x in whole]
    assert b"".join(bytes(p) for p in r.file_pieces(777)) == data[start:end]


def test_a_file_changed_between_the_windows_and_its_checksum_fails():
    g = ls.Group(2, 4, 64, 2, 500)
    end = 4 + 2 * (12 + 500 * 64)
    seg = ls.Segment(0, end, 4 + 24, 128, 0, 0, g)
    data = bytearray(os.urandom(end))
    r, windows = Cutter(*SIZES, "relayout").group_windows(seg, reader(data), 8 * KiB)
    for _ in windows:
        pass
    data[end // 2] ^= 1  # a byte the windows were built from, changed before the checksum's read
    with pytest.raises(OSError, match="changed"):
        for _ in r.file_pieces():
            pass


@pytest.fixture
def files(tmp_path: Path) -> Iterator[Files]:
    f = Files(Repository(tmp_path / "store", StoreSettings()))
    try:
        yield f
    finally:
        f.close()
        f.repo.close()


def ingest_file(files: Files, path: Path) -> tuple[list[bytes], list[ls.Segment], list[bytes], int]:
    """Ingestion's cut of the file at ``path``: (chunk ids, groups, group checksums, tracemalloc peak)."""
    fd = os.open(path, os.O_RDONLY)
    owner = object()
    try:
        tracemalloc.start()
        try:
            repo = files.repo
            stored = store_file(fd, repo.store, repo.chunker, owner, files.successors, files.checks)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        record = stored.record
        return list(stored.index.ids), [x.seg for x in record.groups], [x.sum for x in record.groups], peak
    finally:
        files.repo.store.unpin(owner)
        os.close(fd)


def state_file(path: Path, spec: ggsq.Spec, cells: int, cut: int | None = None) -> bytes:
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(cells, seed=cells), spec)
    data = data[:cut] if cut is not None else data
    path.write_bytes(data)
    return data


SHAPES = {
    "flash attention": (ggsq.Spec(n_layer=8, row_bytes=2048), 700, None),
    "transposed V": (ggsq.Spec(n_layer=6, row_bytes=1024, v_trans=True), 900, None),
    "iswa": (ggsq.Spec(n_layer=4, row_bytes=2048, swa_window=256, swa_layers=2), 600, None),
    "cut off inside a group": (ggsq.Spec(n_layer=8, row_bytes=2048), 700, 9 * MiB),
    "m-rope v4": (ggsq.Spec(n_layer=4, row_bytes=2048, cell_ext=12), 500, None),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_ingestion_stores_the_chunks_of_cutting_the_whole_file(name, files, tmp_path, monkeypatch):
    """The chunks (and so every id, and deduplication against stores saved before) and the groups
    recorded are those of the cutter over the whole file, with groups larger than the window."""
    monkeypatch.setattr(relayout, "WINDOW", 256 * KiB)  # every group here spans many windows
    spec, cells, cut = SHAPES[name]
    data = state_file(tmp_path / "state", spec, cells, cut)
    cutter = files.repo.chunker
    assert cutter.kind == "relayout"
    groups: list = []
    want = [chunk_id(x) for x in cutter.cut(cutter.initial(), data, True, groups)[0]]
    ids, segs, sums, _ = ingest_file(files, tmp_path / "state")
    assert ids == want
    assert segs == [x.seg for x in groups] and sums == [x.sum for x in groups]
    assert all(group_sum(data[s.start : s.end]) == x for s, x in zip(segs, sums, strict=True))
    if cut is None:
        big = [s for s in segs if s.end - s.start > 4 * relayout.WINDOW]
        assert big, "a group larger than the window"


def test_ingesting_a_big_group_takes_memory_bounded_by_the_window_not_the_group(files, tmp_path):
    """A state file whose K and V are one 64 MiB group each: ingestion's allocations (tracemalloc)
    stay far below the group (it was gathered whole, then permuted: twice its size and more)."""
    spec = ggsq.Spec(n_layer=4, row_bytes=2048)  # one group of 4 blocks for K, one for V
    cells = 8192  # 4 x 8192 x 2 KiB = 64 MiB a group
    path = tmp_path / "state"
    data = state_file(path, spec, cells)
    want_groups = [s for s in ls.segments(data, GROUP_WIDTH) if s.group]
    assert [s.end - s.start >= 64 * MiB for s in want_groups] == [True, True]
    del data
    _, segs, _, peak = ingest_file(files, path)
    assert segs == want_groups
    assert peak < 48 * MiB, f"ingestion allocated {peak / MiB:.0f} MiB at its peak"
