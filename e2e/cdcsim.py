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
    repository's src, see e2e/__init__.py); ``rlt:MIN:AVG:MAX`` is its ``relayout`` cutter (K/V
    blocks stored token-major).
    """

    def __init__(self, spec: str):
        self.spec = spec
        kind = spec[:3] if spec[:4] in ("fmt:", "rlt:") else ""
        mn, avg, mx = (parse_size(x) for x in spec.removeprefix(kind + ":").split(":"))
        self.cdc = FastCDC(avg_size=avg, min_size=mn, max_size=mx)
        self.cutter = None
        if kind:
            from kvchunkfs.format.cutter import Cutter

            self.cutter = Cutter(mn, avg, mx, "relayout" if kind == "rlt" else "format")
        self.seen: set[bytes] = set()

    def pieces(self, data: bytes) -> list[memoryview]:
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
