"""Content-defined chunking (FastCDC 2020 via pyfastcdc) with SHA-256 chunk ids.

Boundaries depend only on content: a chunk's end is decided by the bytes from its start, so the
last, possibly end-of-data-forced chunk can be re-chunked together with bytes appended later and
the result equals chunking the whole stream at once. That is what makes streaming and append work
(cutter.py drives it, alone or for the parts of a file that are not a known format).
"""

from __future__ import annotations

import hashlib

from pyfastcdc.cy import FastCDC

# Bytes collected before a cut pass: large enough that per-call overhead and the re-cut tail
# (at most chunk_max) are small against it.
BATCH = 4 << 20


def chunk_id(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


class Chunker:
    def __init__(self, chunk_min: int, chunk_avg: int, chunk_max: int) -> None:
        self.min, self.avg, self.max = chunk_min, chunk_avg, chunk_max
        self._cdc = FastCDC(avg_size=chunk_avg, min_size=chunk_min, max_size=chunk_max)

    def cut(self, data: bytes | memoryview) -> list[memoryview]:
        """Split ``data`` into chunks; the last one may be cut by the end of ``data``."""
        view = memoryview(data)  # slices of a memoryview are views, not copies
        return [c.data for c in self._cdc.cut_buf(view)]
