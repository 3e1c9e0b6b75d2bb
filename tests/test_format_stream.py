"""The streaming writer with the format-aware cutter: whatever the write sizes and wherever the
worker runs, a saved state file has exactly the chunks of cutting it whole, and an append-mode
second pass continues that chunk list. Also: which cutter a store uses."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers import rand_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_stream_interleave import Scheduler, client_write, commit

from e2e import ggsq
from kvchunkfs.file.content import FileContent
from kvchunkfs.file.files import Files
from kvchunkfs.format.chunker import chunk_id
from kvchunkfs.format.cutter import Cutter
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


def open_stream(tmp: Path, keep_partial_page: bool) -> tuple[Files, FileContent, Scheduler]:
    repo = Repository(tmp, StoreSettings(writeback_cache=keep_partial_page))
    files = Files(repo)
    content = files.content(repo.empty_index())
    sched = Scheduler()
    content.hook = sched
    return files, content, sched


def write_all(content: FileContent, sched: Scheduler, data: bytes, start: int, sizes: list[int], rng) -> None:
    pos, end = start, start + len(data)
    for n in sizes:
        n = min(n, end - pos)
        if n <= 0:
            break
        client_write(content, pos, data[pos - start : pos - start + n], sched)
        pos += n
        for _ in range(rng.randrange(0, 3)):
            if sched.parked():
                sched.step()
    if pos < end:
        client_write(content, pos, data[pos - start :], sched)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(SPECS)), st.integers(0, 10**6), st.booleans())
def test_streamed_save_has_the_whole_file_chunks(tmp_path_factory, name, seed, keep_partial_page):
    rng = random.Random(seed)
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(rng.randrange(200, 1200), seed=seed), SPECS[name])
    sizes = [rng.choice((1, 12, 4096, 65536, 1 << 20, rng.randrange(1, 5 * MiB))) for _ in range(12)]
    files, content, sched = open_stream(tmp_path_factory.mktemp("s"), keep_partial_page)
    try:
        write_all(content, sched, data, 0, sizes, rng)
        assert commit(files, content, sched) == data
        sched.run_free()
        index, _ = content.prepare_commit()
        assert index.ids == ids(files.repo.chunker, data)
    finally:
        sched.run_free()
        content.close()
        files.close()
        files.repo.close()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_append_second_pass_continues_the_chunk_list(tmp_path, name):
    """Save, close, reopen in append mode (resume from the headers), append a checkpoint: the
    stub names the chunks of the whole file, and the first save's chunks stay as they were."""
    spec = SPECS[name]
    toks = ggsq.synthetic_tokens(1400, seed=3)
    first = ggsq.synthetic_bytes(toks, spec)
    second = ggsq.checkpoint_blob(toks, spec) + b"CKPT" + rand_bytes(200 * KiB, 4)
    repo = Repository(tmp_path)
    files = Files(repo)
    try:
        content = files.content(repo.empty_index())
        content.start_stream()
        for i in range(0, len(first), 1 << 20):
            assert content.write(i, first[i : i + (1 << 20)])
        assert files.save(content, "conv")
        content.close()
        saved = repo.read_index("conv")
        assert saved.ids == ids(repo.chunker, first)

        again = files.load("conv")
        again.start_stream()
        for i in range(0, len(second), 16 * KiB):  # fwrite-sized pieces
            assert again.write(len(first) + i, second[i : i + 16 * KiB])
        assert files.save(again, "conv")
        again.close()
        index = repo.read_index("conv")
        assert index.ids == ids(repo.chunker, first + second)
        assert index.ids[: len(saved) - 1] == saved.ids[:-1]
        assert files.read_file(index, 0, index.size) == first + second
    finally:
        files.close()
        repo.close()


def test_staged_copy_is_cut_like_the_stream(tmp_path):
    """Out-of-order writes stage the file; its one-pass cut equals the streaming one."""
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(900, seed=5), SPECS["llama"])
    repo = Repository(tmp_path)
    files = Files(repo)
    try:
        content = files.content(repo.empty_index())
        content.start_stream()
        assert content.write(0, data[: 3 * MiB])
        content.to_staging()  # as a write far behind the end would
        content.write(3 * MiB, data[3 * MiB :])
        assert files.save(content, "staged")
        content.close()
        assert repo.read_index("staged").ids == ids(repo.chunker, data)
    finally:
        files.close()
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
