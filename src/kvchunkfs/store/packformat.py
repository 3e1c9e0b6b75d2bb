"""The byte format of a pack: self-describing, so the chunk map can always be rebuilt from the packs.

A pack is a 16-byte header followed by batches. Every batch (one append by a save, or one copy by
GC's compaction) is a record that lists its chunks, followed by the chunk bytes in that order::

    pack header   "KVCFPACK"  u32 version (1)  u32 0                          16 bytes
    batch record  "KVCFBATC"  u32 count  u32 crc32  u64 data length          24 bytes
                  count x (chunk id 32 bytes, u32 length)                    36 bytes each
    chunk data    the chunks back to back (data length bytes)

Integers are little-endian. The crc32 covers the record (its own field counted as zero). Record and
chunks are written by one pwritev at the pack's known end, before the batch's map rows are
committed: a map row never names a chunk its pack does not describe. Unlike restic's trailer,
the record comes first, because an open pack grows batch by batch and a crash can cut it anywhere:
a forward scan reads record after record and keeps every chunk that lies wholly inside the file
(a kill -9 cannot leave a gap: pwritev fills the file in order).

Packs written before this format (no header) are "legacy": only the map knows what they hold.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

PACK_MAGIC = b"KVCFPACK"
BATCH_MAGIC = b"KVCFBATC"
VERSION = 1
_PACK = struct.Struct("<8sII")
_BATCH = struct.Struct("<8sIIQ")
_ENTRY = struct.Struct("<32sI")
PACK_HEADER_SIZE = _PACK.size
BATCH_HEADER_SIZE = _BATCH.size
ENTRY_SIZE = _ENTRY.size
MAX_BATCH_CHUNKS = 1 << 20  # a record claiming more is not a record
_READ = 64 << 10  # one pread usually covers a whole record (up to ~1800 chunks)


def pack_header() -> bytes:
    return _PACK.pack(PACK_MAGIC, VERSION, 0)


def batch_record(chunks: Sequence[tuple[bytes, int]]) -> bytes:
    """The record for a batch of (id, length), written right before the chunks' bytes."""
    entries = b"".join(_ENTRY.pack(cid, n) for cid, n in chunks)
    total = sum(n for _, n in chunks)
    crc = zlib.crc32(entries, zlib.crc32(_BATCH.pack(BATCH_MAGIC, len(chunks), 0, total)))
    return _BATCH.pack(BATCH_MAGIC, len(chunks), crc, total) + entries


def record_size(count: int) -> int:
    return BATCH_HEADER_SIZE + count * ENTRY_SIZE


def is_torn_header(head: bytes) -> bool:
    """A file shorter than a pack header that is a prefix of one: created, then cut by a crash."""
    return len(head) < PACK_HEADER_SIZE and pack_header().startswith(head)


def has_header(fd: int) -> bool:
    head = os.pread(fd, PACK_HEADER_SIZE, 0)
    return len(head) == PACK_HEADER_SIZE and head[:8] == PACK_MAGIC


@dataclass(frozen=True)
class Described:
    id: bytes
    offset: int
    length: int


@dataclass
class Scan:
    """What the records from ``start`` on describe: complete chunks, and where the valid part ends."""

    start: int
    end: int  # after the last complete chunk (or record); bytes past it hold nothing
    chunks: list[Described] = field(default_factory=list)
    record_bytes: int = 0  # bytes of records in [start, end)
    batches: int = 0


def scan(fd: int, size: int, start: int = PACK_HEADER_SIZE) -> Scan:
    """Read the records of a pack from ``start`` (a batch boundary) up to ``size``.

    Stops at the first thing that is not a valid record (a torn record, junk); a batch cut short
    keeps the chunks that lie wholly inside ``size``.
    """
    out = Scan(start, start)
    pos = start
    while pos + BATCH_HEADER_SIZE <= size:
        parsed = _read_record(fd, pos, size)
        if parsed is None:
            break
        entries, data_len = parsed
        rec = record_size(len(entries))
        off = pos + rec
        complete = 0
        for cid, n in entries:
            if off + n > size:
                break
            out.chunks.append(Described(cid, off, n))
            off += n
            complete += 1
        if complete == 0:
            break
        out.batches += 1
        out.record_bytes += rec
        out.end = off
        if complete < len(entries):
            break
        pos = pos + rec + data_len
    return out


def _read_record(fd: int, pos: int, size: int) -> tuple[list[tuple[bytes, int]], int] | None:
    buf = os.pread(fd, min(_READ, size - pos), pos)
    if len(buf) < BATCH_HEADER_SIZE:
        return None
    magic, count, crc, data_len = _BATCH.unpack_from(buf)
    if magic != BATCH_MAGIC or not 0 < count <= MAX_BATCH_CHUNKS or pos + record_size(count) > size:
        return None
    if len(buf) < record_size(count):
        buf = os.pread(fd, record_size(count), pos)
        if len(buf) < record_size(count):
            return None
    body = memoryview(buf)[BATCH_HEADER_SIZE : record_size(count)]
    if zlib.crc32(body, zlib.crc32(_BATCH.pack(BATCH_MAGIC, count, 0, data_len))) != crc:
        return None
    entries = [(bytes(cid), n) for cid, n in _ENTRY.iter_unpack(body)]
    if sum(n for _, n in entries) != data_len or any(n == 0 for _, n in entries):
        return None
    return entries, data_len
