"""The format-aware cutter on llama.cpp state files of every layout (written by e2e/ggsq.py, an
independent writer that follows llama.cpp's state_write code), and its fallback to plain CDC."""

from __future__ import annotations

import random
import struct

import pytest
from helpers import rand_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e import ggsq
from kvchunkfs.format import llama_state as ls
from kvchunkfs.format.chunker import chunk_id
from kvchunkfs.format.cutter import CutState, Cutter

KiB = 1 << 10
SIZES = (16 * KiB, 64 * KiB, 256 * KiB)
ROW = 1024

LAYOUTS = {
    "packed": ggsq.Spec(n_layer=4, row_bytes=ROW),
    "plain_tokens": ggsq.Spec(n_layer=4, row_bytes=ROW, packed=False),
    "v_trans": ggsq.Spec(n_layer=4, row_bytes=ROW, v_trans=True),
    "hybrid": ggsq.Spec(n_layer=2, row_bytes=ROW, recurrent_layers=6, r_row=3072, s_row=32768),
    "hybrid_compact": ggsq.Spec(n_layer=2, row_bytes=ROW, recurrent_bytes=96 * KiB, packed=False),
    "iswa": ggsq.Spec(n_layer=2, row_bytes=ROW, swa_window=300, swa_layers=3),
    "mrope_v4": ggsq.Spec(n_layer=4, row_bytes=ROW, cell_ext=12),
    "mrope_v3": ggsq.Spec(n_layer=4, row_bytes=ROW, version=3, cell_ext=8),
    "v3": ggsq.Spec(n_layer=4, row_bytes=ROW, version=3),
    "v2": ggsq.Spec(n_layer=4, row_bytes=ROW, version=2),
    "v1": ggsq.Spec(n_layer=4, row_bytes=ROW, version=1, packed=False),
    "streams": ggsq.Spec(n_layer=4, row_bytes=ROW, n_stream=4, seq_id=2),
    "big_rows": ggsq.Spec(n_layer=2, row_bytes=96 * KiB),
}


def cutter(kind: str = "format", sizes: tuple[int, int, int] = SIZES) -> Cutter:
    return Cutter(*sizes, kind)


def conversation(spec: ggsq.Spec, turns: int, first: int = 900, per_turn: int = 150, seed: int = 1) -> list[list[int]]:
    toks = ggsq.synthetic_tokens(first, seed=seed)
    out = [toks]
    for t in range(turns - 1):
        toks = toks + ggsq.synthetic_tokens(per_turn, seed=seed * 1000 + t)
        out.append(toks)
    return out


def stream(c: Cutter, data: bytes, splits: list[int], state: CutState | None = None) -> list[bytes]:
    """What the writer does: cut tail + each piece, keep the tentative rest, cut it at the end."""
    state = state or c.initial()
    out: list[bytes] = []
    tail, pos = b"", 0
    for n in [*splits, len(data)]:
        piece, pos = data[pos : pos + n], pos + n
        buf = tail + piece
        chunks, state = c.cut(state, buf, final=False)
        out += [bytes(x) for x in chunks]
        tail = buf[sum(len(x) for x in chunks) :]
    chunks, _ = c.cut(state, tail, final=True)
    return out + [bytes(x) for x in chunks]


def new_bytes(seen: set[bytes], chunks: list[memoryview]) -> int:
    n = 0
    for x in chunks:
        cid = chunk_id(x)
        if cid not in seen:
            seen.add(cid)
            n += len(x)
    return n


# -- structure -------------------------------------------------------------------------------


def kv_blocks(spec: ggsq.Spec) -> int:
    return 2 * spec.n_layer + (2 * spec.swa_layers if spec.swa_window else 0)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_is_recognised(name):
    spec = LAYOUTS[name]
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(500), spec)
    segs = ls.segments(data)
    assert segs[-1] == ls.Segment(len(data), None)  # nothing was left to the fallback
    rows = [s for s in segs if s.unit == ROW or s.unit == spec.row_bytes]
    trans = [s for s in segs if s.period]
    assert len(rows) + len(trans) == kv_blocks(spec)
    if spec.v_trans:
        assert len(trans) == spec.n_layer and all(s.period == 500 * spec.el_bytes for s in trans)
    if spec.swa_window:
        assert {s.phase for s in rows} == {0, 500 - spec.swa_window}
    recurrent = [s for s in segs if s.unit and s.unit in (spec.r_row, spec.s_row, spec.recurrent_bytes)]
    if spec.recurrent_layers:
        assert len(recurrent) == 2 * spec.recurrent_layers
    records = [s for s in segs if s.origin == s.start and s.unit == 12 + spec.cell_ext]
    assert len(records) == (2 if spec.swa_window else 1)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_chunks_cover_the_file_within_bounds(name):
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(700, seed=3), LAYOUTS[name])
    for kind in ("format", "cdc"):
        chunks = cutter(kind).cut_all(data)
        assert b"".join(chunks) == data
        assert all(0 < len(x) <= SIZES[2] for x in chunks)


def test_grid_chunks_stay_near_the_average():
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(3000, seed=4), LAYOUTS["packed"])
    sizes = [len(x) for x in cutter().cut_all(data)]
    big = [s for s in sizes if s >= SIZES[0]]
    assert sum(big) > 0.9 * len(data)
    assert all(s <= SIZES[1] + 64 for s in big)  # one stride (64 rows) and at most a block header
    assert len(sizes) < 1.5 * len(data) / SIZES[1]


# -- what a turn stores ----------------------------------------------------------------------

# (layout, bound on stored / physical minimum with 150-token turns, 1 KiB rows, 64 KiB strides)
TURN_BOUNDS = {"packed": 1.45, "mrope_v4": 1.45, "v1": 1.45, "hybrid": 1.35, "streams": 1.45}


@pytest.mark.parametrize("name", sorted(TURN_BOUNDS))
def test_a_turn_stores_its_rows_and_one_partial_stride_per_block(name):
    spec = LAYOUTS[name]
    c, seen = cutter(), set()
    for i, toks in enumerate(conversation(spec, 4)):
        data = ggsq.synthetic_bytes(toks, spec)
        new = new_bytes(seen, c.cut_all(data))
        if i == 0:
            continue
        recurrent = spec.recurrent_layers * (spec.r_row + spec.s_row + 24) + 32
        minimum = 150 * spec.bytes_per_token + (recurrent if spec.recurrent_layers else 0)
        # the floor: each K/V block's last partial stride (< 64 rows) plus the token list, the
        # counts and the cell records' last stride
        assert new <= minimum + kv_blocks(spec) * 64 * ROW + 4 * SIZES[1] // 2
        assert new / minimum <= TURN_BOUNDS[name]


def test_a_block_that_grew_keeps_every_full_stride():
    spec = LAYOUTS["packed"]
    c = cutter()
    t1, t2 = conversation(spec, 2, first=2000, per_turn=37)
    old = {chunk_id(x) for x in c.cut_all(ggsq.synthetic_bytes(t1, spec))}
    d2 = ggsq.synthetic_bytes(t2, spec)
    chunks = c.cut_all(d2)
    for seg in [s for s in ls.segments(d2) if s.unit == ROW]:
        old_end = seg.origin + 2000 * ROW  # every chunk wholly inside the old rows is still there
        off, inside = 0, 0
        for x in chunks:
            if seg.start <= off and off + len(x) <= old_end:
                inside += 1
                assert chunk_id(x) in old
            off += len(x)
        assert inside == 2000 // 64, seg


def test_cuts_follow_token_positions_when_the_window_slides():
    """A sliding-window cache drops rows at its front: cuts counted from token position 0 keep
    the rows still in the window in the same chunks."""
    spec = LAYOUTS["iswa"]
    c = cutter()
    t1, t2 = conversation(spec, 2, first=1000, per_turn=128)
    old = {chunk_id(x) for x in c.cut_all(ggsq.synthetic_bytes(t1, spec))}
    d2 = ggsq.synthetic_bytes(t2, spec)
    swa = [s for s in ls.segments(d2) if s.unit == ROW and s.phase]
    chunks, off, kept = c.cut_all(d2), 0, 0
    for x in chunks:
        if any(s.origin <= off and off + len(x) <= s.end for s in swa) and chunk_id(x) in old:
            kept += len(x)
        off += len(x)
    # window 300 rows, slid by 128: of the 172 rows still there, whole 64-row strides are kept
    assert kept >= 2 * spec.swa_layers * 128 * ROW


def test_second_conversation_shares_the_common_prefix():
    spec = LAYOUTS["packed"]
    c, seen = cutter(), set()
    system = ggsq.synthetic_tokens(1000, seed=7)
    a = system + ggsq.synthetic_tokens(300, seed=8)
    b = system + ggsq.synthetic_tokens(300, seed=9)
    new_bytes(seen, c.cut_all(ggsq.synthetic_bytes(a, spec)))
    new = new_bytes(seen, c.cut_all(ggsq.synthetic_bytes(b, spec)))
    unshared = 300 * spec.bytes_per_token
    assert new <= unshared + kv_blocks(spec) * 64 * ROW + 2 * SIZES[1]


# -- streaming = whole file ------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(sorted(LAYOUTS)),
    st.lists(st.integers(1, 300 * KiB), max_size=12),
    st.integers(1, 900),
    st.booleans(),
)
def test_any_split_of_the_writes_gives_the_same_chunks(name, splits, n_tokens, small_pieces):
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(n_tokens, seed=n_tokens), LAYOUTS[name])
    if small_pieces:  # byte-sized writes through the headers
        splits = [1, 3, 7, 12, 1, 5, 40, 2, *splits]
    c = cutter()
    assert stream(c, data, splits) == [bytes(x) for x in c.cut_all(data)]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**9), st.integers(0, 3))
def test_truncated_files_round_trip_and_stream_alike(seed, layout):
    rng = random.Random(seed)
    name = sorted(LAYOUTS)[layout * 3 % len(LAYOUTS)]
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(rng.randrange(1, 400), seed=seed), LAYOUTS[name])
    data = data[: rng.randrange(0, len(data) + 1)]
    c = cutter()
    whole = [bytes(x) for x in c.cut_all(data)]
    assert b"".join(whole) == data
    assert stream(c, data, [rng.randrange(1, 70 * KiB) for _ in range(6)]) == whole


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10**9), st.integers(1, 40))
def test_damaged_headers_round_trip_and_stream_alike(seed, n_flips):
    """Bytes flipped anywhere (headers, counts, records): whatever the parser makes of it, every
    byte is in exactly one chunk and streaming agrees with the whole-file cut."""
    rng = random.Random(seed)
    spec = LAYOUTS[sorted(LAYOUTS)[seed % len(LAYOUTS)]]
    data = bytearray(ggsq.synthetic_bytes(ggsq.synthetic_tokens(rng.randrange(1, 300), seed=seed), spec))
    for _ in range(n_flips):
        i = min(len(data) - 1, int(rng.expovariate(1 / 3000)))  # mostly near the front: the headers
        data[i] = rng.randrange(256)
    data = bytes(data)
    c = cutter()
    whole = [bytes(x) for x in c.cut_all(data)]
    assert b"".join(whole) == data and all(0 < len(x) <= SIZES[2] for x in whole)
    assert stream(c, data, [rng.randrange(1, 90 * KiB) for _ in range(5)]) == whole


@pytest.mark.parametrize(
    "head",
    [
        b"",
        b"q",
        struct.pack("<III", ls.GGSQ_MAGIC, 5, 3),  # unknown version
        struct.pack("<III", ls.GGSQ_MAGIC, 0, 3),
        struct.pack("<III", 0x6767736E, 4, 3),  # a whole-context session file ("ggsn")
        b"GGUF\x03\x00\x00\x00",
    ],
)
def test_anything_else_is_plain_cdc(head):
    data = head + rand_bytes(700 * KiB, len(head))
    assert [bytes(x) for x in cutter().cut_all(data)] == [bytes(x) for x in cutter("cdc").cut_all(data)]
    assert ls.segments(data) == [ls.Segment(0, None)]


def test_opaque_tail_after_a_state_file_is_cut_from_its_start():
    """A second pass appended something unknown: the state file's chunks are unchanged and the
    rest is CDC restarted at its first byte."""
    spec = LAYOUTS["packed"]
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(800), spec)
    extra = b"CKPT" + rand_bytes(300 * KiB, 5)
    c = cutter()
    base = [bytes(x) for x in c.cut_all(data)]
    both = [bytes(x) for x in c.cut_all(data + extra)]
    assert both[: len(base)] == base
    assert both[len(base) :] == [bytes(x) for x in cutter("cdc").cut_all(extra)]


@pytest.mark.parametrize("name", ["hybrid", "iswa"])
def test_an_appended_checkpoint_blob_is_parsed(name):
    spec = LAYOUTS[name]
    toks = ggsq.synthetic_tokens(600)
    data = ggsq.synthetic_bytes(toks, spec)
    blob = ggsq.checkpoint_blob(toks, spec)
    segs = ls.segments(data + blob)
    assert ls.Segment(len(data), len(data) + 8) in segs  # the blob's magic and seq_id
    assert segs[-1] == ls.Segment(len(data) + len(blob), None)
    sidecar = ls.segments(blob)  # the same blob as a file of its own (NAME.ckpt)
    assert sidecar[0] == ls.Segment(0, 8) and sidecar[-1] == ls.Segment(len(blob), None)
