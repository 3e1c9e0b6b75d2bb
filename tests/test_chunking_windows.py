"""Every way of reading a file stores the same chunks (file/chunking.py): whatever the window the
file is read in, down to a few bytes, and wherever its holes lie, a save's chunks, checksum and
groups are those of cutting the whole file at once, for every shape of state file the parser
accepts and every cutter. Exhaustive (tiny windows: every decision of the cutter meets a window's
end somewhere), so in the ``slow`` tier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash
from ggsq_shapes import ggsq_files, tiny_ggsq_files
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchunkfs.file import chunking
from kvchunkfs.file.chunking import store_file
from kvchunkfs.file.predict import Successors
from kvchunkfs.format.chunker import chunk_id
from kvchunkfs.format.cutter import Cutter
from kvchunkfs.format.filerecord import Form, Listed
from kvchunkfs.store.repository import Repository, StoreSettings

SIZES = {"chunk_min": 2048, "chunk_avg": 8192, "chunk_max": 32768}  # small chunks: many per file
KINDS = ("relayout", "format", "cdc")
_ok = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]


def check(tmp: Path, kind: str, data: bytes, window: int, holes: list[tuple[int, int]], repeat: bool) -> None:
    """``data`` written with ``holes`` (offset, length: zeros left unwritten) and stored a window
    at a time: the chunks of cutting it whole. ``repeat``: stored twice with predictions."""
    path = tmp / "f"
    with open(path, "wb") as f:
        pos = 0
        for off, n in sorted(holes):
            off = max(off, pos)
            f.seek(pos)
            f.write(data[pos:off])
            pos = min(len(data), off + n)
        f.seek(pos)
        f.write(data[pos:])
        f.truncate(len(data))
    data = path.read_bytes()
    repo = Repository(tmp / kind, StoreSettings(chunker=kind, **SIZES))
    succ = Successors()
    try:
        groups: list[Listed] = []
        want = [chunk_id(x) for x in repo.chunker.cut(repo.chunker.initial(), data, True, groups)[0]]
        for _ in range(2 if repeat else 1):
            fd = os.open(path, os.O_RDONLY)
            owner = object()
            try:
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(chunking, "WINDOW", window)
                    stored = store_file(fd, repo.store, repo.chunker, owner, succ)
            finally:
                os.close(fd)
                repo.store.unpin(owner)
            if stored.record.form is Form.FILE_ORDER:  # its stored form parses otherwise: cut as ``format``
                c = repo.chunker
                assert stored.index.ids == [chunk_id(x) for x in Cutter(c.min, c.avg, c.max, "format").cut_all(data)]
            else:
                assert stored.index.ids == want
            assert stored.record.file_sum == xxhash.xxh3_128_digest(data)
            if stored.record.form is Form.LISTED:
                assert list(stored.record.groups) == groups
    finally:
        repo.close()


holes = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 1 << 15)), max_size=3)


@settings(max_examples=1500, deadline=None, suppress_health_check=_ok)
@given(tiny_ggsq_files(), st.sampled_from(KINDS), st.integers(1, 300), holes, st.booleans())
def test_tiny_files_any_window(tmp_path_factory, data, kind, window, gaps, repeat):
    check(tmp_path_factory.mktemp("w"), kind, data, window, gaps, repeat)


@settings(max_examples=600, deadline=None, suppress_health_check=_ok)
@given(ggsq_files(max_cells=60, max_row=400), st.sampled_from(KINDS), st.integers(7, 20000), holes, st.booleans())
def test_state_files_any_window(tmp_path_factory, data, kind, window, gaps, repeat):
    check(tmp_path_factory.mktemp("w"), kind, data, window, gaps, repeat)
