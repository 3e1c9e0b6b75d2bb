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
        self._zero: memoryview | None = None

    @property
    def zero_chunk(self) -> memoryview:
        """The chunk cut at a boundary followed by at least ``max`` zero bytes.

        A cut depends only on the ``max`` bytes after the chunk's start, so inside a long run of
        zeros every chunk is this one; computed once, not per chunk.
        """
        if self._zero is None:
            self._zero = self.cut(bytes(2 * self.max))[0]
        return self._zero

    def cut(self, data: bytes | memoryview) -> list[memoryview]:
        """Split ``data`` into chunks; the last one may be cut by the end of ``data``."""
        view = memoryview(data)  # slices of a memoryview are views, not copies
        return [c.data for c in self._cdc.cut_buf(view)]


class StreamChunker:
    """Feeds bytes in order; returns chunks as soon as their boundary is final (a save's holes are
    cut through it: ``feed_zeros``).

    ``tail`` holds the bytes of the last, tentative chunk; ``feed`` returns the finished chunks, and
    at the end of the data the caller takes ``tail`` as the last chunk.
    """

    def __init__(self, chunker: Chunker, tail: bytes = b"") -> None:
        self.chunker = chunker
        self.tail = tail

    def feed(self, data: bytes) -> list[memoryview]:
        buf = self.tail + data if self.tail else data
        if not buf:
            return []
        pieces = self.chunker.cut(buf)
        self.tail = bytes(pieces[-1])
        return pieces[:-1]

    def feed_zeros(self, n: int) -> list[tuple[memoryview, int]]:
        """``feed(bytes(n))`` without allocating or cutting a long run: (chunk, repeat count) pairs.

        After the first ``max`` zeros the chunk that straddles the run's start has ended, so the
        tentative chunk starts inside the run; from there, while ``max`` zeros lie ahead of a chunk
        start, the next chunk is ``zero_chunk`` (see there). The rest is cut as usual. Equal to
        plain CDC of the same bytes (tests/test_security.py checks it against pyfastcdc).
        """
        cmax = self.chunker.max
        head = min(n, cmax)
        runs = [(p, 1) for p in self.feed(bytes(head))]
        rest = len(self.tail) + n - head  # zeros from the tentative chunk's start to the run's end
        if n - head == 0 or rest < cmax:
            return runs + [(p, 1) for p in self.feed(bytes(n - head))]
        zero = self.chunker.zero_chunk
        repeat = (rest - cmax) // len(zero) + 1
        self.tail = b""
        runs.append((zero, repeat))
        return runs + [(p, 1) for p in self.feed(bytes(rest - repeat * len(zero)))]
