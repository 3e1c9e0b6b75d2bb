"""Predicted chunks: taking bytes as the chunk that followed the previous one last time
never changes the chunk list. Whatever a snapshot looked like before and however the next one
differs (edits, inserts, deletes, appends, truncations, a damaged header) and is split into
writes and batches, the chunks with prediction equal cutting the whole file without it, for both
cutters."""

from __future__ import annotations

import os
import random
from itertools import accumulate
from pathlib import Path

import pytest
from conftest import Mount
from hypothesis import given, settings
from hypothesis import strategies as st

from e2e import ggsq
from kvchunkfs.file import chunking
from kvchunkfs.file.chunking import store_file
from kvchunkfs.file.predict import START, Guess, Pieces, Successors, cut_batch
from kvchunkfs.format.chunker import chunk_id
from kvchunkfs.format.cutter import Cutter
from kvchunkfs.store.repository import Repository, StoreSettings

KiB, MiB = 1 << 10, 1 << 20
SIZES = (1 * KiB, 4 * KiB, 16 * KiB)  # small chunks: many per example, windows of 64 KiB
SPEC = ggsq.Spec(n_layer=3, row_bytes=512)


def stream(c: Cutter, data: bytes, sizes: list[int], succ: Successors | None, window: int) -> list[bytes]:
    """What the streaming worker does: batches of queued writes, the tail re-fed, a final cut."""
    state, tail, prev, out = c.initial(), b"", START, []
    pos, i = 0, 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        i += 1
        end = min(pos + n, len(data))
        pieces = [tail] + [data[p : min(p + 997, end)] for p in range(pos, end, 997)]
        chunks, tail, state = cut_batch(c, state, Pieces(pieces), prev, succ, window)
        assert b"".join(bytes(d) for _, d in chunks) + tail == b"".join(pieces)
        assert all(cid == chunk_id(d) for cid, d in chunks)
        out += [cid for cid, _ in chunks]
        prev = out[-1] if out else prev
        pos += n
    last, _ = c.cut(state, tail, final=True)
    return out + [chunk_id(p) for p in last]


def whole(c: Cutter, data: bytes) -> list[bytes]:
    return [chunk_id(p) for p in c.cut_all(data)]


def mutate(rng: random.Random, data: bytes, edits: int) -> bytes:
    out = bytearray(data)
    for _ in range(edits):
        op, at = rng.randrange(5), rng.randrange(len(out) + 1)
        if op == 0:  # overwrite a few bytes
            out[at : at + 8] = rng.randbytes(8)[: len(out[at : at + 8])]
        elif op == 1:  # insert
            out[at:at] = rng.randbytes(rng.randrange(1, 3000))
        elif op == 2:  # delete
            del out[at : at + rng.randrange(1, 3000)]
        elif op == 3:  # append (a next turn)
            out += rng.randbytes(rng.randrange(1, 40000))
        else:  # truncate
            del out[at:]
    return bytes(out)


def llama_pair(rng: random.Random) -> tuple[bytes, bytes]:
    """Two turns of one conversation, the second sometimes damaged or with opaque bytes appended."""
    tokens = ggsq.synthetic_tokens(rng.randrange(300, 900), seed=rng.randrange(10**6))
    first = ggsq.synthetic_bytes(tokens, SPEC)
    second = ggsq.synthetic_bytes(tokens + ggsq.synthetic_tokens(rng.randrange(1, 200), seed=7), SPEC)
    kind = rng.randrange(4)
    if kind == 1:  # a damaged header: the rest is opaque, but its bytes repeat known chunks
        second = second[:4] + bytes([second[4] ^ 0xFF]) + second[5:]
        first = first[:4] + bytes([first[4] ^ 0xFF]) + first[5:] if rng.random() < 0.5 else first
    elif kind == 2:  # opaque bytes after the state (a harness tail), edited next time
        tail = rng.randbytes(rng.randrange(50000, 200000))
        first, second = first + tail, second + mutate(rng, tail, rng.randrange(0, 4))
    elif kind == 3:
        second = mutate(rng, second, rng.randrange(1, 4))
    return first, second


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**9), st.sampled_from(["cdc", "format"]))
def test_prediction_gives_the_chunks_of_plain_cutting(seed, kind):
    rng = random.Random(seed)
    c = Cutter(*SIZES, kind)
    if kind == "cdc" or rng.random() < 0.3:  # random bytes: the format cutter falls back to CDC
        first = rng.randbytes(rng.randrange(1, 400000))
        second = mutate(rng, first, rng.randrange(0, 6))
        ends = list(accumulate(len(p) for p in c.cut_all(second)))[:-1]
        for b in rng.sample(ends, min(len(ends), rng.randrange(0, 3))):  # right after a cut
            second = second[:b] + rng.randbytes(rng.randrange(0, 3)) + second[b + rng.randrange(0, 2) :]
    else:
        first, second = llama_pair(rng)
    succ = Successors(limit=rng.choice((16, 1 << 17)))  # a small limit evicts mid-stream
    window = rng.choice((1, 64 * KiB, 1 << 20))
    sizes = [rng.choice((1, 100, 4096, 70000, rng.randrange(1, 300000))) for _ in range(8)]
    assert stream(c, first, sizes, succ, window) == whole(c, first)
    rng.shuffle(sizes)
    before = succ.predicted_bytes
    assert stream(c, second, sizes, succ, window) == whole(c, second)
    if first == second and len(first) > 2 * SIZES[2] and kind == "cdc" and succ.limit > 1000:
        assert succ.predicted_bytes > before  # the repeat was mostly taken from guesses


@pytest.mark.parametrize("kind", ["cdc", "format"])
def test_a_change_right_after_a_known_chunk(kind):
    """FastCDC decides a cut with the gear hash of the byte after it: a known chunk followed by a
    different byte may not end there, so that byte is part of the check."""
    rng = random.Random(4)
    c = Cutter(*SIZES, kind)
    first = b"CKPT" + rng.randbytes(400000)
    ends = [int(e) for e in accumulate(len(p) for p in c.cut_all(first))][:-1]
    for b in ends[1::3]:
        for second in (
            first[:b] + bytes([first[b] ^ 0x5A]) + first[b + 1 :],
            first[:b] + rng.randbytes(3) + first[b:],
            first[:b] + first[b + 1 :],
        ):
            succ = Successors()
            stream(c, first, [1 << 20], succ, 64 * KiB)
            assert stream(c, second, [1 << 20], succ, 64 * KiB) == whole(c, second)


def test_only_content_defined_cuts_are_learned():
    """A format cutter's grid chunks are not learned; an opaque stream's chunks are."""
    c = Cutter(*SIZES, "format")
    tokens = ggsq.synthetic_tokens(600, seed=3)
    data = ggsq.synthetic_bytes(tokens, SPEC)
    succ = Successors()
    stream(c, data, [1 << 20], succ, 1 << 20)
    assert len(succ) == 0
    noise = random.Random(1).randbytes(300000)
    stream(c, noise, [1 << 20], succ, 1 << 20)
    assert len(succ) == len(whole(c, noise)) - 1  # every chunk but the one the file's end cut
    # A state file with opaque bytes after it, cut in one window: only the opaque part's chunks.
    succ = Successors()
    stream(c, data + noise, [1 << 20], succ, 1 << 20)
    opaque = whole(Cutter(*SIZES, "cdc"), noise)
    assert sorted(g.cid for _, g in succ.pairs()) == sorted(opaque[:-1])


def test_wrong_guesses_are_rejected_and_cut():
    """A guess whose bytes, or the byte after them, differ falls back to the cut."""
    c = Cutter(*SIZES, "cdc")
    data = random.Random(2).randbytes(200000)
    chunks = c.cut_all(data)
    first, second = chunks[0], chunks[1]
    probe = bytes(first[-16:])
    for wrong in (
        Guess(b"\0" * 32, len(first), probe, second[0]),  # another chunk's id
        Guess(chunk_id(first), len(first), probe, second[0] ^ 1),  # another byte after it
        Guess(chunk_id(first), len(first), b"z" * 16, second[0]),  # another probe
    ):
        succ = Successors()
        succ.learn([(START, wrong)])
        assert stream(c, data, [50000, 150000], succ, 1) == whole(c, data)
        assert succ.predicted_bytes == 0
    succ = Successors()
    succ.learn([(START, Guess(chunk_id(first), len(first), probe, second[0]))])
    assert stream(c, data, [50000, 150000], succ, 1) == whole(c, data)
    assert succ.predicted_bytes == len(first)  # the right guess is taken


def test_successors_stay_bounded():
    succ = Successors(limit=100)
    for i in range(1000):
        succ.learn([(i.to_bytes(4, "little"), Guess(b"n", 1, b"", 0))])
        assert len(succ) <= 100
    assert succ.get((999).to_bytes(4, "little")) is not None  # the newest are kept


def test_pieces_spans_cross_buffers():
    pieces = Pieces([b"abc", b"", bytearray(b"de"), memoryview(b"fghij")])
    flat = b"abcdefghij"
    for off in range(len(flat)):
        for n in range(len(flat) - off + 1):
            assert bytes(pieces.span(off, n)) == flat[off : off + n]


@pytest.mark.parametrize("kind", ["cdc", "format"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_next_turn_stored_equals_plain_cutting(tmp_path: Path, kind: str, seed: int) -> None:
    """Through ``store_file`` (windows read from the file) and a real store, whatever the window:
    a next turn's chunks are those of plain cutting, most of its repeated bytes taken from guesses."""
    rng = random.Random(seed)
    if kind == "cdc":
        first = rng.randbytes(9 * MiB)
        second = first + rng.randbytes(3 * MiB)
    else:  # a non-state file in a format store: its opaque bytes are predicted
        first = b"CKPT" + rng.randbytes(9 * MiB)
        at = rng.randrange(len(first))
        second = first[:at] + rng.randbytes(100) + first[at + 50 :] + rng.randbytes(MiB)
    repo = Repository(tmp_path / "s", StoreSettings(chunker=kind))
    succ = Successors()
    predicted: list[int] = []
    try:
        for data in (first, second, second):
            path = tmp_path / "f"
            path.write_bytes(data)
            fd = os.open(path, os.O_RDONLY)
            owner = object()
            try:
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(chunking, "WINDOW", rng.choice((65536, MiB, rng.randrange(1, 5 * MiB))))
                    stored = store_file(fd, repo.store, repo.chunker, owner, succ)
            finally:
                os.close(fd)
                repo.store.unpin(owner)
            assert stored.index.ids == whole(repo.chunker, data)
            predicted.append(succ.predicted_bytes)
    finally:
        repo.close()
    assert predicted[0] == 0 and predicted[2] - predicted[1] > len(second) // 2


@pytest.mark.parametrize("kind", ["cdc", "format"])
def test_next_turn_through_the_mount_equals_the_stub_without_prediction(tmp_path: Path, kind: str) -> None:
    """A real daemon: a next turn's stub is byte for byte the one a daemon without prediction writes,
    and its repeated bytes were taken from guesses; also after a remount and a restore."""
    rng = random.Random(5)
    first = rng.randbytes(12 * MiB)
    turn = first + rng.randbytes(2 * MiB)
    edited = first[: 5 * MiB] + b"edit" + first[5 * MiB + 4 :] + rng.randbytes(MiB)
    stubs = {}
    for flag in ("--predict-chunks", "--no-predict-chunks"):
        d = tmp_path / flag
        m = Mount(d / "store", d / "mnt", d / "log", [flag, "--chunker", kind])
        m.start()
        try:
            for name, data in (("a", first), ("b", turn), ("c", edited)):
                save(m.path(name), data)
            m.ingested()  # saves are cut behind their close: prediction counts once they are stored
            predicted = m.stats()["bytes_predicted"]
            m.remount([*m.extra, "--hot-tier-size", "0"])  # the restore puts the file back from its chunks
            assert m.path("a").read_bytes() == first  # a restore
            save(m.path("d"), turn)
            save(m.path("e"), edited)
        finally:
            m.stop()
        stubs[flag] = [(m.store / "snapshots" / n).read_bytes() for n in "abcde"]
        assert (predicted > len(first) + len(first) // 2) == (flag == "--predict-chunks")
    assert stubs["--predict-chunks"] == stubs["--no-predict-chunks"]


def save(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        for off in range(0, len(data), 1 << 20):
            f.write(data[off : off + (1 << 20)])
    assert path.read_bytes() == data
