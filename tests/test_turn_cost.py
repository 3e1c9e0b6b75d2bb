"""What a next turn stores: at most 1.10x its new KV bytes, q4_0 and f16, short and long contexts.

Generated llama.cpp state files of real shapes (e2e/ggsq.py: K and V rows of ``heads`` x 64
values, f16 or q4_0's 18 bytes per 32 values, a cell record and a token id per token) a turn apart;
the store's cutter cuts both and the new file's chunks the old one lacks are what the turn stores
(e2e/turncost.py, the tool that says which section they come from). The physical minimum is the
new tokens' rows, cell records and token ids, plus a hybrid model's recurrent state (rewritten
whole every turn). The stored form must read back as the file.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from e2e import ggsq
from e2e.mount import dir_bytes
from e2e.turncost import analyse, render, spec_for
from kvchunkfs.format import relayout
from kvchunkfs.format.cutter import Cutter
from kvchunkfs.store.packs import PackStore
from kvchunkfs.store.repository import Repository
from kvchunkfs.units import KiB

SIZES = (16 * KiB, 64 * KiB, 256 * KiB)  # the store's defaults
LIMIT = 1.10
# (old tokens past the base, tokens appended): turns of 100-300 tokens ending anywhere in a chunk
TURNS = ((0, 100), (57, 300), (211, 150), (389, 100), (503, 230))
# f16 12x4 and 4x8 from 2,000 tokens: old ends 10 of 11 and 15 of 16 records into a 64 KiB stride
F16_TURNS = ((1, 100), (15, 100), (57, 300), (211, 150))


@functools.lru_cache(maxsize=4)
def state(kv: str, layers: int, heads: int, v_trans: bool, recurrent: int, n: int) -> bytes:
    spec = spec_for(kv, layers, heads, v_trans, recurrent)
    return ggsq.synthetic_bytes(ggsq.synthetic_tokens(n, seed=layers * 100 + heads), spec)


def turns(kv: str, layers: int, heads: int, base: int, v_trans: bool = False, recurrent: int = 0, which=TURNS) -> None:
    cutter = Cutter(*SIZES, "relayout")
    worst = 0.0
    for i, (past, grow) in enumerate(which):
        old = state(kv, layers, heads, v_trans, recurrent, base + past)
        new = state(kv, layers, heads, v_trans, recurrent, base + past + grow)
        rep = analyse(old, new, cutter)
        assert rep.ratio <= LIMIT, render(rep, f"{kv} {layers}x{heads} {base + past}+{grow} tokens")
        worst = max(worst, rep.ratio)
        if i == 0:  # the stored form reads back as the file
            stream = b"".join(bytes(p) for p in cutter.cut_all(new))
            assert len(stream) == len(new)
            assert relayout.file_bytes(stream, cutter.group_w) == new
    assert worst >= 1.0


@pytest.mark.parametrize(
    "kv,layers,heads",
    [("q4_0", 12, 4), ("q4_0", 32, 8), ("q4_0", 24, 2), ("q4_0", 16, 8)],
)
def test_q4_0_next_turn_2k(kv, layers, heads):
    turns(kv, layers, heads, 2000)


def test_q4_0_next_turn_10k():
    turns("q4_0", 12, 4, 10000)


@pytest.mark.parametrize("layers,heads", [(12, 4), (4, 8), (32, 8)])
def test_f16_next_turn_2k(layers, heads):
    turns("f16", layers, heads, 2000, which=F16_TURNS)


def test_f16_next_turn_10k():
    # 9,503 cells: the old end 10 records into a stride of 11 (a 64 KiB grid of 6 KiB records)
    turns("f16", 12, 4, 9500, which=((3, 100), (0, 200), (389, 300)))


def test_f16_v_transposed_next_turn():
    turns("f16", 12, 4, 2000, v_trans=True, which=F16_TURNS)


def test_hybrid_next_turn():
    turns("q4_0", 4, 4, 2000, recurrent=12)


def test_chunks_stay_reasonable():
    """A turn's cost is bounded by capping records a chunk, not by tiny chunks: a 12-layer q4_0
    file's K/V chunks hold 7 records of 1,728 bytes, f16's 7 of 6,144; none is under 4 KiB but
    at a segment's end."""
    for kv, floor in (("q4_0", 11 * KiB), ("f16", 40 * KiB)):
        data = state(kv, 12, 4, False, 0, 2000)
        pieces = Cutter(*SIZES, "relayout").cut_all(data)
        assert len(data) / len(pieces) >= floor
        assert max(len(p) for p in pieces) <= SIZES[2]
        assert sum(len(p) < 4 * KiB - 64 for p in pieces) <= 8  # segment ends (header, counts, tails)


def test_store_keeps_its_cut_version(tmp_path):
    """A new store records the newest cut; one created before keeps the first (its next saves
    still share its chunks)."""
    repo = Repository(tmp_path / "new")
    assert repo.chunker.cut_version == 2 and repo.store.get_meta("cut") == "2"
    repo.close()
    old = PackStore(tmp_path / "old", 64 << 20)  # what a store created before left: no cut recorded
    old.set_meta("chunk_params", f"{16 * KiB},{64 * KiB},{256 * KiB}")
    old.set_meta("chunker", "relayout")
    old.close()
    for _ in range(2):
        repo = Repository(tmp_path / "old")
        assert repo.chunker.kind == "relayout" and repo.chunker.cut_version == 1
        repo.close()


def test_mount_q4_0_next_turns(kvfs):
    """Through the mount: a q4_0 conversation saved turn after turn stores at most 1.10x the new
    tokens' bytes (growth of the packs, batch records included) and reads back identical."""
    mnt = Path(kvfs.mnt)
    spec = spec_for("q4_0", 12, 4)
    toks = ggsq.synthetic_tokens(2600, seed=7)
    expected = b""
    sizes = (2000, 2100, 2357, 2511)
    for i, n in enumerate(sizes):
        kvfs.ingested()
        before = dir_bytes(Path(kvfs.store) / "packs")
        ggsq.write_synthetic(mnt / "conv.tmp", toks[:n], spec)
        os.rename(mnt / "conv.tmp", mnt / "conv")
        kvfs.ingested()
        new = dir_bytes(Path(kvfs.store) / "packs") - before
        expected = ggsq.synthetic_bytes(toks[:n], spec)
        assert ggsq.read_like_restore(mnt / "conv") == expected
        if i:
            minimum = (n - sizes[i - 1]) * spec.bytes_per_token
            assert new <= LIMIT * minimum, f"turn {i}: {new} new bytes, minimum {minimum}"
    kvfs.remount(["--hot-tier-size", "0"])
    assert ggsq.read_like_restore(Path(kvfs.mnt) / "conv") == expected
