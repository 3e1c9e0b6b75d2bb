"""Copies of a snapshot that keep its holes: only the bytes that are not zero take room.

A snapshot may be sparse (a file truncated up, written past its end): its stored form then holds
chunks of zeros. A copy of it into a whole file (a rewrite of a stored snapshot) writes only the
blocks that are not all zeros into a file truncated to its size, so the zeros stay holes, and the
room the copy takes is known before it starts (``data_bytes``: the chunks that are not zeros).
"""

from __future__ import annotations

import functools
import os
import struct

from kvchunkfs.format.chunker import chunk_id
from kvchunkfs.format.index import Index

BLOCK = 64 << 10  # the unit in which zeros are skipped (a multiple of any page size)
_ENTRY = struct.Struct("<Q32s")  # an index table entry: end offset, chunk id
_ZEROS = bytes(BLOCK)


@functools.lru_cache(maxsize=64)
def _zero_id(length: int) -> bytes:
    return chunk_id(bytes(length))


def data_bytes(index: Index) -> int:
    """The bytes of ``index``'s chunks that are not all zeros: the most a copy that skips zeros
    writes (the same in any order of the stream, e.g. a re-laid-out one)."""
    total = start = 0
    for end, cid in _ENTRY.iter_unpack(index.table()):
        length = end - start
        if cid != _zero_id(length):
            total += length
        start = end
    return total


def write_nonzero(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write ``data`` at ``offset`` into ``fd`` (a new file, holes where nothing was written),
    skipping the aligned blocks that are all zeros."""
    view = memoryview(data)
    pos = 0
    while pos < len(view):
        n = min(BLOCK - (offset + pos) % BLOCK, len(view) - pos)
        piece = view[pos : pos + n]
        if bytes(piece) != _ZEROS[:n]:  # bytes: a memcmp (a view compares item by item)
            os.pwrite(fd, piece, offset + pos)
        pos += n
