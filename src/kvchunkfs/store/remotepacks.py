"""The packed bucket layout's pure pieces: pack indexes (what packs hold) and range coalescing.

A **pack** object (``PREFIX/packs/<2 hex>/<64 hex>``, named by the SHA-256 of its bytes) is chunks
back to back, nothing else. A **pack index** object (``PREFIX/packidx/<64 hex>``, named by the
SHA-256 of its content) describes one or more packs, the way a local pack's records describe it::

    "KVCFRIDX"  u32 version (1)  u32 pack count                                   16 bytes
    per pack:   pack id 32 bytes  u32 chunk count                                 36 bytes
                chunk count x (chunk id 32 bytes, u32 length)                     36 bytes each
    SHA-256 of everything above                                                    32 bytes

Offsets are implied (chunks back to back from 0). An upload puts its packs first and their index
after, then the snapshot index: a pack index never names a missing pack... unless ``gc --remote``
deleted the pack since (readers then forget the pack and fall back to what else they know).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MAGIC = b"KVCFRIDX"
VERSION = 1
_HEAD = struct.Struct("<8sII")
_PACK = struct.Struct("<32sI")
_ENTRY = struct.Struct("<32sI")
MAX_PACKS = 64  # per pack index (an upload writes another past this)
MAX_ENTRIES = 1 << 16  # chunks per pack index
MAX_PIDX_BYTES = _HEAD.size + MAX_PACKS * _PACK.size + MAX_ENTRIES * _ENTRY.size + 32
GAP = 256 << 10  # ranges of one pack closer than this are fetched by one GET (the gap is read and dropped)
MAX_RANGE = 8 << 20  # one GET fetches at most about this many bytes (parallelism over huge runs)


class PackIndexError(ValueError):
    """Bytes that are not a valid pack index."""


@dataclass(frozen=True)
class Loc:
    pack: bytes
    offset: int
    length: int


@dataclass
class PackDesc:
    pack: bytes
    chunks: list[tuple[bytes, int]] = field(default_factory=list)  # (id, length) in pack order

    @property
    def size(self) -> int:
        return sum(n for _, n in self.chunks)

    def locs(self) -> Iterable[tuple[bytes, Loc]]:
        off = 0
        for cid, n in self.chunks:
            yield cid, Loc(self.pack, off, n)
            off += n


def encode(packs: Sequence[PackDesc]) -> bytes:
    if len(packs) > MAX_PACKS or sum(len(p.chunks) for p in packs) > MAX_ENTRIES:
        raise ValueError("too many packs or chunks for one pack index")
    parts = [_HEAD.pack(MAGIC, VERSION, len(packs))]
    for p in packs:
        parts.append(_PACK.pack(p.pack, len(p.chunks)))
        parts.extend(_ENTRY.pack(cid, n) for cid, n in p.chunks)
    body = b"".join(parts)
    return body + hashlib.sha256(body).digest()


def groups(packs: Sequence[PackDesc]) -> list[list[PackDesc]]:
    """``packs`` split into as few pack indexes as their limits allow, in order."""
    out: list[list[PackDesc]] = []
    entries = 0
    for d in packs:
        if not out or len(out[-1]) == MAX_PACKS or entries + len(d.chunks) > MAX_ENTRIES:
            out.append([])
            entries = 0
        out[-1].append(d)
        entries += len(d.chunks)
    return out


class Packer:
    """Chunks cut into packs of ``size`` bytes or a chunk more: ``add`` returns a pack's description
    and bytes whenever one is full, ``flush`` the last one."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._buf: list[bytes] = []
        self._desc = PackDesc(b"")
        self._bytes = 0

    def add(self, cid: bytes, data: bytes | memoryview) -> tuple[PackDesc, bytes] | None:
        """A pack is sealed once it reaches ``size`` (so every pack but the last has at least that
        many bytes: a save of N new bytes puts at most ceil(N / size) packs), or holds as many
        chunks as one pack index may list (chunks far smaller than any chunker cuts)."""
        self._buf.append(bytes(data))
        self._desc.chunks.append((cid, len(data)))
        self._bytes += len(data)
        return self.flush() if self._bytes >= self.size or len(self._desc.chunks) >= MAX_ENTRIES else None

    def flush(self) -> tuple[PackDesc, bytes] | None:
        if not self._buf:
            return None
        data = b"".join(self._buf)
        desc = self._desc
        desc.pack = hashlib.sha256(data).digest()
        self._buf, self._desc, self._bytes = [], PackDesc(b""), 0
        return desc, data


def decode(data: bytes) -> list[PackDesc]:
    """Parse and check a pack index (its own checksum, its counts against its length)."""
    if len(data) > MAX_PIDX_BYTES or len(data) < _HEAD.size + 32:
        raise PackIndexError(f"a pack index of {len(data)} bytes")
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise PackIndexError("pack index fails its checksum")
    magic, version, count = _HEAD.unpack_from(body, 0)
    if magic != MAGIC or version != VERSION or count > MAX_PACKS:
        raise PackIndexError("not a pack index")
    out, pos = [], _HEAD.size
    for _ in range(count):
        if pos + _PACK.size > len(body):
            raise PackIndexError("pack index cut short")
        pid, n = _PACK.unpack_from(body, pos)
        pos += _PACK.size
        if pos + n * _ENTRY.size > len(body):
            raise PackIndexError("pack index cut short")
        desc = PackDesc(pid, [_ENTRY.unpack_from(body, pos + i * _ENTRY.size) for i in range(n)])
        pos += n * _ENTRY.size
        out.append(desc)
    if pos != len(body):
        raise PackIndexError("trailing bytes in a pack index")
    return out


@dataclass
class Run:
    """One range GET: bytes [start, end) of a pack, holding ``parts`` (chunk id, offset in the run, length)."""

    pack: bytes
    start: int
    end: int
    parts: list[tuple[bytes, int, int]] = field(default_factory=list)


def coalesce(wanted: Iterable[tuple[bytes, Loc]], gap: int = GAP, max_range: int = MAX_RANGE) -> list[Run]:
    """Group chunk locations into range GETs: per pack in offset order, neighbours closer than
    ``gap`` share one GET, up to ``max_range`` bytes a GET."""
    by_pack: dict[bytes, list[tuple[bytes, Loc]]] = {}
    for cid, loc in wanted:
        by_pack.setdefault(loc.pack, []).append((cid, loc))
    runs: list[Run] = []
    for pack, items in by_pack.items():
        items.sort(key=lambda x: x[1].offset)
        run: Run | None = None
        for cid, loc in items:
            end = loc.offset + loc.length
            if run is None or loc.offset - run.end > gap or end - run.start > max_range:
                run = Run(pack, loc.offset, end)
                runs.append(run)
            run.end = max(run.end, end)
            run.parts.append((cid, loc.offset - run.start, loc.length))
    return runs
