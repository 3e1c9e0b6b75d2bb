"""A save with the format-aware cutter (file/chunking.py): whatever the window the file is read in,
a saved state file has exactly the chunks of cutting it whole and its record; a second pass that
appends continues that chunk list; a sparse file is cut as the zeros it reads as. Also: which
cutter a store uses."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import xxhash
from helpers import rand_bytes, write_content
from helpers import save as save_content
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e import ggsq
from kvchunkfs.file import chunking
from kvchunkfs.file.chunking import Stored, store_file
from kvchunkfs.file.files import Files
from kvchunkfs.format.chunker import chunk_id
from kvchunkfs.format.cutter import Cutter
from kvchunkfs.format.filerecord import Listed
from kvchunkfs.store.packs import PackStore
from kvchunkfs.store.repository import Repository, StoreSettings

KiB, MiB = 1 << 10, 1 << 20
SPECS = {
    "llama": ggsq.Spec(n_layer=4, row_bytes=1024),
    "hybrid": ggsq.Spec(n_layer=2, row_bytes=1024, recurrent_layers=4, r_row=3072, s_row=65536),
    "v_trans": ggsq.Spec(n_layer=3, row_bytes=1024, v_trans=True),
}


def ids(c: Cutter, data: bytes) -> list[bytes]:
    return [chunk_id(x) for x in c.cut_all(data)]


def store_path(repo: Repository, path: Path) -> Stored:
    fd = os.open(path, os.O_RDONLY)
    owner = object()
    try:
        return store_file(fd, repo.store, repo.chunker, owner)
    finally:
        repo.store.unpin(owner)
        os.close(fd)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(SPECS)), st.integers(0, 10**6), st.sampled_from(["relayout", "format", "cdc"]))
def test_a_stored_file_has_the_whole_file_chunks(tmp_path_factory, name, seed, kind):
    """Read a window at a time, whatever the window: the chunks, checksum and groups of cutting the
    file whole."""
    rng = random.Random(seed)
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(rng.randrange(200, 1200), seed=seed), SPECS[name])
    tmp = tmp_path_factory.mktemp("s")
    (tmp / "f").write_bytes(data)
    repo = Repository(tmp / "store", StoreSettings(chunker=kind))
    window = rng.choice((4096, 65536, MiB, rng.randrange(1, 5 * MiB)))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(chunking, "WINDOW", window)
            stored = store_path(repo, tmp / "f")
        groups: list[Listed] = []
        want = [chunk_id(x) for x in repo.chunker.cut(repo.chunker.initial(), data, True, groups)[0]]
        assert stored.index.ids == want
        assert stored.record.file_sum == xxhash.xxh3_128_digest(data)
        assert list(stored.record.groups) == groups
    finally:
        repo.close()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_append_second_pass_continues_the_chunk_list(tmp_path, name):
    """Save, close, reopen, append a checkpoint: the stub names the chunks of the whole file, and
    the first save's chunks stay as they were."""
    spec = SPECS[name]
    toks = ggsq.synthetic_tokens(1400, seed=3)
    first = ggsq.synthetic_bytes(toks, spec)
    second = ggsq.checkpoint_blob(toks, spec) + b"CKPT" + rand_bytes(200 * KiB, 4)
    repo = Repository(tmp_path)
    files = Files(repo)
    try:
        content = files.content(repo.empty_index())
        for i in range(0, len(first), 1 << 20):
            write_content(content, i, first[i : i + (1 << 20)])
        assert save_content(files, content, "conv")
        content.close()
        saved = repo.read_index("conv")
        assert saved.ids == ids(repo.chunker, first)

        again = files.load("conv")
        for i in range(0, len(second), 16 * KiB):  # fwrite-sized pieces
            write_content(again, len(first) + i, second[i : i + 16 * KiB])
        assert save_content(files, again, "conv")
        again.close()
        index = repo.read_index("conv")
        assert index.ids == ids(repo.chunker, first + second)
        assert index.ids[: len(saved) - 1] == saved.ids[:-1]
        assert files.read_file(index, 0, index.size) == first + second
    finally:
        files.close()
        repo.close()


@pytest.mark.parametrize("kind", ["relayout", "cdc"])
def test_a_sparse_file_is_cut_as_its_zeros(tmp_path, kind):
    """Holes (at the start, inside, at the end, and one inside a state file's groups) give the
    chunks and checksum of the zeros they read as."""
    state = ggsq.synthetic_bytes(ggsq.synthetic_tokens(900, seed=5), SPECS["llama"])
    path = tmp_path / "f"
    gap = (len(state) // 3) & ~4095
    with open(path, "wb") as f:
        f.seek(64 * KiB)  # a hole at the start (inside the file's header: read as zeros)
        f.write(state[64 * KiB : gap])
        f.seek(gap + 2 * MiB)  # a hole over part of the groups
        f.write(state[gap + 2 * MiB :])
        f.truncate(len(state) + 30 * MiB)  # a long hole at the end
        f.seek(len(state) + 9 * MiB)
        f.write(rand_bytes(300 * KiB, 1))
    with open(path, "rb") as f:
        assert os.lseek(f.fileno(), 0, os.SEEK_DATA) > 0, "no hole"
    data = path.read_bytes()
    repo = Repository(tmp_path / "store", StoreSettings(chunker=kind))
    try:
        stored = store_path(repo, path)
        assert stored.index.ids == ids(repo.chunker, data)
        assert stored.record.file_sum == xxhash.xxh3_128_digest(data)
    finally:
        repo.close()


# -- the cutter is a property of the store ---------------------------------------------------


def test_new_store_records_the_configured_cutter(tmp_path):
    for kind in ("format", "cdc"):
        repo = Repository(tmp_path / kind, StoreSettings(chunker=kind))
        repo.close()
        reopened = Repository(tmp_path / kind, StoreSettings(chunker="cdc" if kind == "format" else "format"))
        assert reopened.chunker.kind == kind  # recorded at creation; a later setting does not change it
        reopened.close()


def test_store_from_before_format_cutting_keeps_plain_cdc(tmp_path):
    old = PackStore(tmp_path, 64 * MiB)  # what the previous version left: chunk sizes, no cutter
    old.set_meta("chunk_params", f"{16 * KiB},{64 * KiB},{256 * KiB}")
    old.close()
    repo = Repository(tmp_path)
    try:
        assert repo.chunker.kind == "cdc"
        assert repo.store.get_meta("chunker") == "cdc"
    finally:
        repo.close()


def test_default_store_cuts_state_files_by_format_and_relayout(tmp_path):
    repo = Repository(tmp_path)
    try:
        assert repo.chunker.kind == "relayout"
        data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(500), SPECS["llama"])
        assert ids(repo.chunker, data) != ids(Cutter(16 * KiB, 64 * KiB, 256 * KiB, "cdc"), data)
        other = rand_bytes(MiB, 8)
        assert ids(repo.chunker, other) == ids(Cutter(16 * KiB, 64 * KiB, 256 * KiB, "cdc"), other)
    finally:
        repo.close()
