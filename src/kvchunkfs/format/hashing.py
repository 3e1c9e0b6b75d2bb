"""Chunk ids of a whole batch, hashed on two cores.

A save is bound by one chunker thread that cuts, hashes and stores each batch in turn, while the
FUSE thread leaves most of the second core idle. SHA-256 is the largest share of that work and
``hashlib`` releases the GIL for every buffer, so a batch's chunks are split by bytes between the
calling thread and a helper thread: the ids come back in order, identical to ``chunk_id`` one by one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvchunkfs.format.chunker import chunk_id

Piece = bytes | memoryview

PARALLEL_MIN = 512 << 10  # below this a handoff costs more than the second core saves


def _ids(pieces: Sequence[Piece]) -> list[bytes]:
    return [chunk_id(p) for p in pieces]


class ChunkHasher:
    """``ids(pieces)``: SHA-256 of each piece, ``helpers`` threads helping the caller."""

    def __init__(self, helpers: int = 1) -> None:
        self.helpers = helpers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:  # created on first use: importing this module starts no thread
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.helpers, thread_name_prefix="hasher")
            return self._pool

    def ids(self, pieces: Sequence[Piece]) -> list[bytes]:
        total = sum(len(p) for p in pieces)
        if self.helpers < 1 or len(pieces) < 2 or total < PARALLEL_MIN:
            return _ids(pieces)
        groups = _split(pieces, self.helpers + 1, total)
        pool = self._executor()
        futures = [pool.submit(_ids, g) for g in groups[1:]]
        out = _ids(groups[0])
        for f in futures:
            out += f.result()
        return out


def _split(pieces: Sequence[Piece], n: int, total: int) -> list[Sequence[Piece]]:
    """``n`` consecutive groups of about ``total / n`` bytes each (some may be empty)."""
    groups: list[Sequence[Piece]] = []
    start = acc = 0
    for i, p in enumerate(pieces):
        acc += len(p)
        if acc * n >= total * (len(groups) + 1) and len(groups) < n - 1:
            groups.append(pieces[start : i + 1])
            start = i + 1
    groups.append(pieces[start:])
    return groups


HASHER = ChunkHasher()  # shared by every file: one helper thread for the whole daemon
