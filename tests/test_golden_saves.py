"""Golden saves: what a save stores is pinned byte for byte.

A fixed corpus of files (every ggsq shape the synthetic writer makes, real-model-shaped f16 and
q4_0 state files, one with a group larger than the cutter's group window, the file a stored form
once parsed differently for (stored in file order), random bytes, sparse files, a file appended
to, and next turns over the same name) is saved through a real mount with ordinary file calls.
Once each save is stored as chunks, its stub's bytes (the whole caibx index) and its file record
(the ``user.kvcfs.file`` attribute) are hashed (SHA-256) and compared with
``tests/golden/saves.json``, together with the file's size (the ``user.kvcfs.size`` attribute).

Both are a pure function of the file's bytes and the chunker settings, so nothing in them is left
out. Left out are the stub's other attributes, which are not content: ``created`` (the time of the
first save), ``use_count`` and ``last_use`` (restores).

The corpus is fully deterministic (fixed seeds, no drawing at run time); the same fixture holds in
passthrough and in served mode. ``KVCFS_GOLDEN_WRITE=1`` rewrites the fixture from this run, and
the test then fails saying so: a regenerated fixture is never a pass.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from conftest import Mount
from ggsq_shapes import ISSUE_FILE
from helpers import wait_closed

from e2e import ggsq
from e2e.turncost import spec_for
from kvchunkfs.format import filerecord, relayout
from kvchunkfs.format.cutter import GROUP_WIDTH
from kvchunkfs.store import stubs

FIXTURE = Path(__file__).resolve().parent / "golden" / "saves.json"
WRITE = os.environ.get("KVCFS_GOLDEN_WRITE") == "1"
MiB = 1 << 20
PIECE = 1 << 20  # bytes a write() call: the size llama.cpp's buffered writes and cp reach

# -- the corpus ------------------------------------------------------------------------------------

SMALL = ggsq.Spec(n_layer=4, row_bytes=256)  # 2 KiB of KV a token
SHAPES: dict[str, ggsq.Spec] = {
    "v1-plain-tokens": ggsq.Spec(n_layer=4, row_bytes=256, version=1, packed=False),
    "v2": ggsq.Spec(n_layer=4, row_bytes=256, version=2),
    "v3-ext8": ggsq.Spec(n_layer=4, row_bytes=256, version=3, cell_ext=8),
    "v4-ext12": ggsq.Spec(n_layer=4, row_bytes=256, cell_ext=12),
    "v4": SMALL,
    "vtrans-el1": ggsq.Spec(n_layer=3, row_bytes=256, v_trans=True, el_bytes=1),
    "vtrans-el2": ggsq.Spec(n_layer=3, row_bytes=256, v_trans=True, el_bytes=2),
    "vtrans-el4": ggsq.Spec(n_layer=3, row_bytes=256, v_trans=True, el_bytes=4),
    "q4_0-rows": ggsq.Spec(n_layer=6, row_bytes=288, ggml_type=2),
    "two-streams": ggsq.Spec(n_layer=4, row_bytes=256, n_stream=2),
    "one-layer-wide": ggsq.Spec(n_layer=1, row_bytes=12288),
    "many-layers-narrow": ggsq.Spec(n_layer=40, row_bytes=32),
    "iswa": ggsq.Spec(n_layer=4, row_bytes=256, swa_window=64, swa_layers=2),
    "recurrent-compact": ggsq.Spec(n_layer=4, row_bytes=256, recurrent_bytes=40000),
    "hybrid": ggsq.Spec(n_layer=2, row_bytes=256, recurrent_layers=2, r_row=3072, s_row=16384),
}
TOKENS = ggsq.synthetic_tokens(300, seed=7)


def corpus() -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every file saved in one go (fopen "wb", writes, fclose)."""
    for name, spec in SHAPES.items():
        yield f"ggsq-{name}", ggsq.synthetic_bytes(TOKENS, spec)
    base = ggsq.synthetic_bytes(TOKENS, SMALL)
    yield "ggsq-no-cells", ggsq.synthetic_bytes([], SMALL)
    yield "ggsq-checkpoint-iswa", base + ggsq.checkpoint_blob(TOKENS, SHAPES["iswa"])
    yield "ggsq-checkpoint-recurrent", base + ggsq.checkpoint_blob(TOKENS, SHAPES["hybrid"])
    yield "ggsq-trailing-bytes", base + random.Random(11).randbytes(5000)
    yield "ggsq-cut-off", base[: len(base) * 2 // 3 + 5]
    yield "ggsq-file-order", ISSUE_FILE
    for kv, layers, heads, v_trans, recurrent, n in (
        ("f16", 12, 4, False, 0, 700),  # ~8 MiB
        ("f16", 12, 4, True, 0, 400),
        ("q4_0", 32, 8, False, 0, 300),  # ~5 MiB
        ("q4_0", 12, 4, False, 2, 500),  # a hybrid model's recurrent state at the end
    ):
        spec = spec_for(kv, layers, heads, v_trans, recurrent)
        tag = f"{kv}-{layers}x{heads}{'-vtrans' if v_trans else ''}{'-hybrid' if recurrent else ''}"
        yield f"real-{tag}", ggsq.synthetic_bytes(ggsq.synthetic_tokens(n, seed=layers * 100 + heads), spec)
    # 16 layers of 512-byte rows: a group of 8 KiB a cell, 1,100 cells: more than relayout.WINDOW
    yield "big-group", ggsq.synthetic_bytes(ggsq.synthetic_tokens(1100, seed=3), ggsq.Spec(n_layer=16, row_bytes=512))
    yield "random-3MiB", random.Random(5).randbytes(3 * MiB)
    yield "random-small", random.Random(6).randbytes(1000)
    yield "one-byte", b"\x07"
    yield "empty", b""


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        for i in range(0, len(data), PIECE):
            f.write(data[i : i + PIECE])


def write_holes(path: Path) -> bytes:
    """Written with holes: each range after a seek past the end. The bytes the file then has."""
    ranges = [(1 * MiB + 123, random.Random(21).randbytes(100_000)), (5 * MiB, random.Random(22).randbytes(65536))]
    return _ranges(path, ranges, truncate=None)


def write_truncated(path: Path) -> bytes:
    """Truncated to 4 MiB first, then a few ranges written into the hole."""
    rnd = random.Random(23)
    ranges = [(0, rnd.randbytes(4096)), (2 * MiB + 7, rnd.randbytes(300_000)), (4 * MiB - 1000, rnd.randbytes(1000))]
    return _ranges(path, ranges, truncate=4 * MiB)


def _ranges(path: Path, ranges: list[tuple[int, bytes]], truncate: int | None) -> bytes:
    end = max([truncate or 0] + [off + len(d) for off, d in ranges])
    expect = bytearray(end)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if truncate is not None:
            os.ftruncate(fd, truncate)
        for off, d in ranges:
            os.lseek(fd, off, os.SEEK_SET)
            os.write(fd, d)
            expect[off : off + len(d)] = d
    finally:
        os.close(fd)
    return bytes(expect)


def append_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


# -- what a save stored ----------------------------------------------------------------------------


def stored(kvfs: Mount, name: str, size: int, timeout: float = 120) -> dict[str, object]:
    """The golden entry of the snapshot ``name`` once its save of ``size`` bytes is stored."""
    wait_closed(kvfs)
    kvfs.ingested(timeout)
    stub = kvfs.store / "snapshots" / name
    deadline = time.monotonic() + timeout
    while stubs.read_staged(stub) is not None or stubs.stub_size(stub) != size:
        assert time.monotonic() < deadline, f"{name}: not stored: {kvfs.log()[-3000:]}"
        time.sleep(0.02)
        kvfs.ingested(timeout)
    data, xsize = stubs.read_stub(stub)
    index = stubs.decode_stub(data, xsize, stub)
    record = stubs.read_record(stub)
    form = None if record is None else filerecord.decode(record, size).form.name
    return {
        "size": size,
        "chunks": len(index),
        "form": form,
        "stub": hashlib.sha256(data).hexdigest(),
        "record": None if record is None else hashlib.sha256(record).hexdigest(),
    }


def save(kvfs: Mount, name: str, write: Callable[[Path], bytes | None], data: bytes | None = None) -> dict[str, object]:
    """Save through the mount with ``write``; check the file reads back; its golden entry."""
    path = kvfs.mnt / name
    written = write(path)
    data = written if written is not None else data
    assert data is not None
    got = stored(kvfs, name, len(data))
    assert path.read_bytes() == data, f"{name}: read back differs"
    return got


def big_group(data: bytes) -> int:
    """The stored size of the largest group the file parses to."""
    segs = relayout.groups(lambda o, n: data[o : o + n], len(data), GROUP_WIDTH)
    return max((s.end - s.start for s in segs if s.end is not None), default=0)


def test_saves_store_the_golden_stubs_and_records(kvfs: Mount) -> None:
    got: dict[str, dict[str, object]] = {}
    for name, data in corpus():
        got[name] = save(kvfs, name, lambda p, d=data: write_file(p, d), data)
    got["sparse-holes"] = save(kvfs, "sparse-holes", write_holes)
    got["sparse-truncated"] = save(kvfs, "sparse-truncated", write_truncated)

    # saved, then reopened O_APPEND and appended to (a second pass's checkpoint), saved again
    first = ggsq.synthetic_bytes(TOKENS, SMALL)
    extra = ggsq.checkpoint_blob(TOKENS, SHAPES["iswa"])
    got["appended-0"] = save(kvfs, "appended", lambda p: write_file(p, first), first)
    got["appended-1"] = save(kvfs, "appended", lambda p: append_file(p, extra), first + extra)

    # next turns over the same name: A, then A' (A's prefix and more) written with O_TRUNC
    spec = spec_for("q4_0", 12, 4)
    toks = ggsq.synthetic_tokens(900, seed=31)
    for turn, n in enumerate((600, 750, 900)):
        data = ggsq.synthetic_bytes(toks[:n], spec)
        got[f"next-turn-{turn}"] = save(kvfs, "next-turn", lambda p, d=data: write_file(p, d), data)
    # ... and as llama-server behind the proxy: NAME.tmp written, renamed over NAME
    for turn, n in enumerate((500, 650)):
        data = ggsq.synthetic_bytes(toks[:n], SHAPES["vtrans-el2"])

        def proxy(p: Path, d: bytes = data) -> None:
            write_file(p.with_name(p.name + ".tmp"), d)
            os.rename(p.with_name(p.name + ".tmp"), p)

        got[f"renamed-turn-{turn}"] = save(kvfs, "renamed-turn", proxy, data)

    # the corpus covers what it says it does
    forms = {str(v["form"]) for v in got.values()}
    assert {"PLAIN", "LISTED", "FILE_ORDER"} <= forms, forms
    assert big_group(dict(corpus())["big-group"]) > relayout.WINDOW

    if WRITE:
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        raise AssertionError(f"wrote {FIXTURE} ({len(got)} saves): not a pass; run again without KVCFS_GOLDEN_WRITE")
    want = json.loads(FIXTURE.read_text())
    diff = [
        f"{k}: stored {got.get(k)}, golden {want.get(k)}"
        for k in sorted(set(got) | set(want))
        if got.get(k) != want.get(k)
    ]
    assert not diff, f"{len(diff)} of {len(want)} saves differ from {FIXTURE.name}:\n" + "\n".join(diff)
