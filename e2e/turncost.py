"""What a next turn stores, and why: new chunks per section of a llama.cpp state file.

    python -m e2e.turncost --files OLD NEW                  # two real saves a turn apart
    python -m e2e.turncost --kv q4_0 --layers 12 --heads 4 --tokens 2700 --append 200
    python -m e2e.turncost --kv f16 --tokens 9500 --append 200 --cuts 1,2 --json out.json
    python -m e2e.turncost --mount --files F.0 F.1 F.2      # saved through a real mount, in turn

Both files are cut by ``kvchunkfs.format.cutter.Cutter`` (the store's default sizes unless
``--sizes MIN:AVG:MAX``; ``--chunker`` and each cut version of ``--cuts``); a chunk of NEW whose
id OLD does not have is new. Each new chunk's bytes are charged to the sections of the file they
lie in (the stored stream occupies the file's byte ranges: a token-major group stays where its
blocks are), and per section the tool prints the new bytes against the section's growth (what the
turn added there: its new tokens' rows), so the excess is the old bytes a turn stores again and
where. The physical minimum is the growth of every section plus the whole recurrent state (it is
rewritten every turn). ``--kv``/``--layers``/``--heads`` generate state files of a model's shape
(``e2e/ggsq.py``: K and V rows of ``heads`` x 64 values, f16 or q4_0, one cell record and token id
per token) instead. ``--mount`` saves the files in turn through a kv-chunk-fs mount of this checkout
on a new store (written in 1 MiB pieces as ``conv.tmp``, renamed over ``conv``, as llama-server and
the proxy do) and reports each save's new bytes as the growth of the store's packs once it is
stored, against the same minimum (and checks that each file reads back identical).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvchunkfs.format import llama_state as ls
from kvchunkfs.format.cutter import Cutter

# bytes of one row of ``dims`` values per KV type (ggml blocks of 32 values)
ROW_BYTES = {"f16": lambda dims: 2 * dims, "q8_0": lambda dims: dims // 32 * 34, "q4_0": lambda dims: dims // 32 * 18}
GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}
GB = 1 << 30


@dataclass
class Section:
    label: str
    start: int
    end: int
    recurrent: bool = False

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass
class Report:
    """A next turn's cost: per section (label, old size, new size, new chunk bytes), totals."""

    rows: list[tuple[str, int, int, int]] = field(default_factory=list)
    new_bytes: int = 0
    minimum: int = 0
    chunks: int = 0  # distinct chunks of the new file
    size: int = 0

    @property
    def ratio(self) -> float:
        return self.new_bytes / self.minimum if self.minimum else float("inf")

    @property
    def chunks_per_gb(self) -> float:
        return self.chunks * GB / self.size if self.size else 0.0


def sections(data: bytes | memoryview, group_w: int) -> list[Section]:
    """The file's segments, named by what they hold."""
    view = memoryview(data)
    out: list[Section] = []
    st: ls.State | None = replace(ls.START, group_w=group_w)
    k = v = r = 0
    while st is not None:
        plan = ls.step(st, view[st.pos :], True)
        assert isinstance(plan, ls.Plan)
        for seg in plan.segments:
            end = len(view) if seg.end is None else seg.end
            kind = st.step
            if seg.end is None:
                label = "opaque rest"
            elif kind == "file":
                label = "token ids" if seg.unit else "file header"
            elif kind in ("stream", "section"):
                label = "cell records" if seg.unit else "counts"
                if plan.next is not None and plan.next.step == "rblock":
                    label = "recurrent head"
            elif kind in ("k", "v"):
                g = seg.group
                n = g.count if g is not None else 1
                first = st.layer
                what = "K" if kind == "k" else "V"
                label = f"{what} layers {first}-{first + n - 1}" + (" (token-major)" if g is not None else "")
                k, v = (k + 1, v) if kind == "k" else (k, v + 1)
            elif kind == "rblock":
                label = f"recurrent block {r}"
                r += 1
            else:
                label = kind
            out.append(Section(label, seg.start, end, recurrent=kind == "rblock" or label == "recurrent head"))
        st = plan.next
    return out


def chunk_ids(cutter: Cutter, data: bytes) -> list[tuple[int, int, bytes]]:
    """(offset, length, id) of every chunk of ``data``'s stored stream."""
    out, pos = [], 0
    for piece in cutter.cut_all(data):
        out.append((pos, len(piece), hashlib.sha256(piece).digest()))
        pos += len(piece)
    return out


def analyse(old: bytes, new: bytes, cutter: Cutter) -> Report:
    """The cost of storing ``new`` in a store that holds ``old``."""
    have = {cid for _, _, cid in chunk_ids(cutter, old)}
    secs_old = sections(old, cutter.group_w)
    secs = sections(new, cutter.group_w)
    olds: dict[str, list[Section]] = {}
    for s in secs_old:
        olds.setdefault(s.label, []).append(s)
    charged = [0] * len(secs)
    rep = Report(size=len(new))
    seen: set[bytes] = set()
    for off, n, cid in chunk_ids(cutter, new):
        if cid in seen:
            continue
        seen.add(cid)
        rep.chunks += 1
        if cid in have:
            continue
        rep.new_bytes += n
        for i, s in enumerate(secs):
            lo, hi = max(off, s.start), min(off + n, s.end)
            if lo < hi:
                charged[i] += hi - lo
    for i, s in enumerate(secs):
        match = olds.get(s.label)
        before = match.pop(0).size if match else 0
        rep.rows.append((s.label, before, s.size, charged[i]))
        rep.minimum += s.size if s.recurrent else max(0, s.size - before)
    return rep


def spec_for(kv: str, layers: int, heads: int, v_trans: bool = False, recurrent_layers: int = 0):
    from e2e import ggsq

    row = ROW_BYTES[kv](heads * 64)
    return ggsq.Spec(
        n_layer=layers,
        row_bytes=row,
        ggml_type=GGML_TYPES[kv],
        v_trans=v_trans,
        recurrent_layers=recurrent_layers,
        r_row=3072,
        s_row=16384,
    )


def generated(spec, tokens: int, append: int, seed: int = 1) -> tuple[bytes, bytes]:
    """A conversation of ``tokens`` tokens and the same ``append`` tokens later."""
    from e2e import ggsq

    toks = ggsq.synthetic_tokens(tokens + append, seed=seed)
    return ggsq.synthetic_bytes(toks[:tokens], spec), ggsq.synthetic_bytes(toks, spec)


def through_mount(paths: Sequence[Path], work: Path, extra: Sequence[str] = ()) -> list[tuple[int, int]]:
    """(size, new bytes) of each file saved in turn over the same name through a real mount."""
    from e2e.mount import Mount

    m = Mount(work / "store", work / "mnt", work / "mount.log", extra_args=list(extra))
    m.start()
    out = []
    try:
        for p in paths:
            m.ingested()
            before = m.stored_bytes() or 0
            data = Path(p).read_bytes()
            with open(m.mnt / "conv.tmp", "wb", buffering=0) as f:
                for i in range(0, len(data), 1 << 20):
                    f.write(data[i : i + (1 << 20)])
            os.rename(m.mnt / "conv.tmp", m.mnt / "conv")
            m.ingested()
            out.append((len(data), (m.stored_bytes() or 0) - before))
            if (m.mnt / "conv").read_bytes() != data:
                raise RuntimeError(f"{p}: read back differs")
    finally:
        m.stop()
    return out


def render(rep: Report, title: str) -> str:
    lines = [title, f"{'section':34} {'old':>11} {'new':>11} {'growth':>9} {'stored':>9} {'excess':>9}"]
    for label, before, after, stored in rep.rows:
        if not stored and after == before:
            continue
        grow = max(0, after - before)
        lines.append(f"{label:34} {before:11,} {after:11,} {grow:9,} {stored:9,} {stored - grow:9,}")
    lines.append(
        f"new {rep.new_bytes:,} B, minimum {rep.minimum:,} B, ratio {rep.ratio:.3f}; "
        f"{rep.chunks} chunks, {rep.chunks_per_gb:,.0f} chunks/GB"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", nargs="+", metavar="FILE", help="OLD NEW (--mount: the files in turn)")
    ap.add_argument("--kv", choices=tuple(ROW_BYTES), default="f16")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=4, help="KV heads of 64 values")
    ap.add_argument("--tokens", type=int, default=2700)
    ap.add_argument("--append", type=int, default=200)
    ap.add_argument("--v-trans", action="store_true", help="flash attention off: V transposed")
    ap.add_argument("--recurrent-layers", type=int, default=0)
    ap.add_argument("--sizes", default="16K:64K:256K")
    ap.add_argument("--chunker", default="relayout", choices=("relayout", "format", "cdc"))
    ap.add_argument("--cuts", default="1,2", help="cut versions to compare (format/cutter.py CUTS)")
    ap.add_argument("--json", help="write the reports here")
    ap.add_argument("--mount", action="store_true", help="save --files in turn through a real mount")
    ap.add_argument("--mount-args", default="", help="extra flags for kv-chunk-fs mount")
    args = ap.parse_args(argv)
    if args.mount:
        return mount_main(args)
    from e2e.cdcsim import parse_size

    mn, avg, mx = (parse_size(x) for x in args.sizes.split(":"))
    if args.files:
        if len(args.files) != 2:
            ap.error("--files takes OLD NEW")
        old, new = (Path(f).read_bytes() for f in args.files)
        what = f"{args.files[0]} -> {args.files[1]}"
    else:
        spec = spec_for(args.kv, args.layers, args.heads, args.v_trans, args.recurrent_layers)
        old, new = generated(spec, args.tokens, args.append)
        what = f"{args.kv} {args.layers} layers x {args.heads} heads, {args.tokens} + {args.append} tokens"
    out = {}
    for cut in (int(c) for c in args.cuts.split(",")):
        rep = analyse(old, new, Cutter(mn, avg, mx, args.chunker, cut=cut))
        print(render(rep, f"== {what}: {args.chunker} cut {cut}, {args.sizes}"))
        print()
        out[f"cut{cut}"] = {"ratio": rep.ratio, "new": rep.new_bytes, "minimum": rep.minimum,
                            "chunks": rep.chunks, "chunks_per_gb": rep.chunks_per_gb, "sections": rep.rows}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def mount_main(args: argparse.Namespace) -> int:
    paths = [Path(f) for f in args.files]
    with tempfile.TemporaryDirectory(prefix="turncost-", dir="/var/tmp") as work:
        saves = through_mount(paths, Path(work), args.mount_args.split())
    cutter = Cutter(16 << 10, 64 << 10, 256 << 10, "relayout")
    rows = []
    for i, (size, new) in enumerate(saves):
        if not i:
            print(f"{paths[0].name}: {size:,} B, first save stored {new:,} B ({new / size:.3f} of its size)")
            continue
        minimum = analyse(paths[i - 1].read_bytes(), paths[i].read_bytes(), cutter).minimum
        print(
            f"{paths[i].name}: {size:,} B, next turn stored {new:,} B, minimum {minimum:,} B, ratio {new / minimum:.3f}"
        )
        rows.append({"file": str(paths[i]), "size": size, "new": new, "minimum": minimum})
    if args.json:
        Path(args.json).write_text(json.dumps({"first": saves[0], "turns": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
