"""What an ideal content-defined-chunking store would add per save, for given chunk sizes.

Used by the player as a reference column: if the filesystem's measured new bytes equal the
simulation at its own chunk sizes, the overhead over the physical minimum is the chunking's, not
the filesystem's; other sizes show what changing the chunk parameters would give.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pyfastcdc.cy import FastCDC

_UNITS = {"": 1, "K": 1024, "M": 1024 * 1024}


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1] if s and s[-1] in _UNITS else ""
    return int(float(s[: len(s) - len(unit)]) * _UNITS[unit])


class CdcSim:
    """A set of chunk ids; ``add`` returns the bytes of the chunks it had not seen.

    ``MIN:AVG:MAX`` is FastCDC; ``fmt:MIN:AVG:MAX`` is kv-chunk-fs's format-aware cutter (from this
    repository's src, see e2e/__init__.py); ``rlt:MIN:AVG:MAX`` is the format-aware cutter on the
    file with transposed V blocks laid out as rows (``relayout``: a proposal, simulated only).
    """

    def __init__(self, spec: str):
        self.spec = spec
        kind = spec[:3] if spec[:4] in ("fmt:", "rlt:") else ""
        mn, avg, mx = (parse_size(x) for x in spec.removeprefix(kind + ":").split(":"))
        self.cdc = FastCDC(avg_size=avg, min_size=mn, max_size=mx)
        self.relayout = kind == "rlt"
        self.cutter = None
        if kind:
            from kvchunkfs.format.cutter import Cutter

            self.cutter = Cutter(mn, avg, mx, "format")
        self.seen: set[bytes] = set()

    def pieces(self, data: bytes) -> list[memoryview]:
        if self.relayout:
            data = relayout(data)
        if self.cutter is not None:
            return self.cutter.cut_all(data)
        view = memoryview(data)
        return [view[c.offset : c.offset + c.length] for c in self.cdc.cut_buf(data)]

    def add(self, data: bytes) -> int:
        new = 0
        for piece in self.pieces(data):
            h = hashlib.sha256(piece).digest()
            if h not in self.seen:
                self.seen.add(h)
                new += len(piece)
        return new

    def add_file(self, path: Path) -> int:
        return self.add(Path(path).read_bytes())


def sims(specs: str) -> list[CdcSim]:
    return [CdcSim(s) for s in specs.split(",") if s.strip()]


_EL_FORMAT = {1: "B", 2: "H", 4: "I"}


def relayout(data: bytes) -> bytes:
    """The proposed reversible re-layout: every transposed V block (n_embd runs of cell_count
    elements) rewritten as cell_count rows of n_embd elements, its header as a row-major one and the
    stream's v_trans flag cleared, so that new tokens append rows as with flash attention. The
    inverse needs only the element size (from the ggml type) and a flag; here it is only simulated
    to measure what it would store."""
    import struct

    from kvchunkfs.format import llama_state as ls

    out = bytearray(data)
    for seg in ls.segments(data):
        if seg.unit and seg.origin - seg.start == 28 and struct.unpack_from("<I", data, seg.start)[0] == 1:
            struct.pack_into("<I", out, seg.start, 0)  # the stream's data header: v_trans = 0
        if not seg.period or seg.end is None or seg.end > len(data):
            continue
        typ, el, n_embd = struct.unpack_from("<iII", data, seg.start)
        cells = seg.period // el
        if el not in _EL_FORMAT or cells == 0:
            continue
        struct.pack_into("<iQ", out, seg.start, typ, el * n_embd)
        flat = memoryview(data)[seg.origin : seg.end].cast(_EL_FORMAT[el])
        out[seg.origin : seg.end] = b"".join(flat[r::cells].tobytes() for r in range(cells))
    return bytes(out)
