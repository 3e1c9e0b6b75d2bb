"""casync/desync ``.caibx`` chunk index: the content of every stub.

Layout (all integers little-endian u64, see casync's ``caformat.h``)::

    header  size=48, type=CA_FORMAT_INDEX, feature_flags, chunk_size_min, avg, max
    table   0xFFFFFFFFFFFFFFFF, CA_FORMAT_TABLE
            N x (end_offset u64, chunk id 32 bytes)
    tail    0, 0, 48, 16 + 40*N + 40, CA_FORMAT_TABLE_TAIL_MARKER

A clear SHA-512/256 flag means chunk ids are SHA-256 digests.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass, field

CA_FORMAT_INDEX = 0x96824D9C7B129FF9
CA_FORMAT_TABLE = 0xE75B9E112F17417D
CA_FORMAT_TABLE_TAIL_MARKER = 0x4B4F050E5549ECD1
CA_FORMAT_EXCLUDE_NODUMP = 0x8000000000000000
CA_FORMAT_SHA512_256 = 0x2000000000000000
# Flags we write: casync's default for files, with SHA-256 digests.
FEATURE_FLAGS = CA_FORMAT_EXCLUDE_NODUMP

_HEADER = struct.Struct("<6Q")
_TABLE_HEADER = struct.Struct("<2Q")
_ITEM = struct.Struct("<Q32s")
_TAIL = struct.Struct("<5Q")
ID_LEN = 32
FIXED_BYTES = _HEADER.size + _TABLE_HEADER.size + _TAIL.size  # an index of no chunks
ITEM_BYTES = _ITEM.size  # each chunk adds this many


class IndexFormatError(ValueError):
    """The bytes are not a valid SHA-256 caibx index."""


@dataclass
class Index:
    """A file as an ordered list of chunks: ``ends[i]`` is the end offset of chunk ``ids[i]``."""

    chunk_min: int
    chunk_avg: int
    chunk_max: int
    ends: list[int] = field(default_factory=list)
    ids: list[bytes] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __len__(self) -> int:
        return len(self.ids)

    def start(self, i: int) -> int:
        return self.ends[i - 1] if i else 0

    def length(self, i: int) -> int:
        return self.ends[i] - self.start(i)

    def append(self, chunk_id: bytes, length: int) -> None:
        self.ends.append(self.size + length)
        self.ids.append(chunk_id)

    def find(self, offset: int) -> int:
        """Index of the chunk holding byte ``offset`` (``len(self)`` past the end)."""
        return bisect.bisect_right(self.ends, offset)

    def copy(self) -> Index:
        return Index(self.chunk_min, self.chunk_avg, self.chunk_max, list(self.ends), list(self.ids))


def encode(index: Index) -> bytes:
    parts = [
        _HEADER.pack(48, CA_FORMAT_INDEX, FEATURE_FLAGS, index.chunk_min, index.chunk_avg, index.chunk_max),
        _TABLE_HEADER.pack(0xFFFFFFFFFFFFFFFF, CA_FORMAT_TABLE),
    ]
    parts.extend(_ITEM.pack(end, cid) for end, cid in zip(index.ends, index.ids, strict=True))
    n = len(index.ids)
    parts.append(_TAIL.pack(0, 0, 48, 16 + 40 * n + 40, CA_FORMAT_TABLE_TAIL_MARKER))
    return b"".join(parts)


def decode(data: bytes) -> Index:
    """Parse and validate an index; raises IndexFormatError on anything unexpected."""
    fixed = _HEADER.size + _TABLE_HEADER.size + _TAIL.size
    if len(data) < fixed or (len(data) - fixed) % _ITEM.size:
        raise IndexFormatError(f"bad index length {len(data)}")
    size, typ, flags, cmin, cavg, cmax = _HEADER.unpack_from(data, 0)
    if size != 48 or typ != CA_FORMAT_INDEX:
        raise IndexFormatError("not a caibx index (bad header)")
    if flags & CA_FORMAT_SHA512_256:
        raise IndexFormatError("index uses SHA-512/256 chunk ids, expected SHA-256")
    if _TABLE_HEADER.unpack_from(data, _HEADER.size) != (0xFFFFFFFFFFFFFFFF, CA_FORMAT_TABLE):
        raise IndexFormatError("bad table header")
    n = (len(data) - fixed) // _ITEM.size
    tail = _TAIL.unpack_from(data, len(data) - _TAIL.size)
    if tail != (0, 0, 48, 16 + 40 * n + 40, CA_FORMAT_TABLE_TAIL_MARKER):
        raise IndexFormatError("bad table tail")
    index = Index(cmin, cavg, cmax)
    prev = 0
    for end, cid in _ITEM.iter_unpack(memoryview(data)[_HEADER.size + _TABLE_HEADER.size : len(data) - _TAIL.size]):
        if end <= prev:
            raise IndexFormatError(f"chunk end offsets not increasing at {end}")
        index.ends.append(end)
        index.ids.append(cid)
        prev = end
    return index
