"""A snapshot's file record: the checksum of its file bytes and where its stored groups are.

A stub's index names the chunks of the *stored stream*; with chunker ``relayout`` some byte ranges
of it (groups, format/relayout.py) hold the file's bytes permuted. The record says, for the bytes
the file really has:

* ``form``: ``PLAIN``, the stream is the file as it is (no group, and the stream parses to none);
  ``LISTED``, the groups are the ones listed here (their place and shape), so a reader never
  derives them from the stream; ``PARSED``, the groups are the ones the stream parses to (too many
  to list; the save checked that the stream parses to exactly the groups it stored);
  ``FILE_ORDER``, the stream is the file as it is although it parses to groups (a save whose
  permuted form would not parse back): only a reader of this record reads it right.
* ``file_sum``: xxh3-128 of the whole file, computed from the bytes written, in file order, as the
  save streamed them: checked wherever the whole file is put back (fsck --verify-data, a staged
  copy, an append that reads it back, ``file-order``).
* per listed group, ``sum``: xxh3-64 of its bytes in file order: a group put back is checked
  against it before any of its bytes is served.

Encoding (little-endian; ``v`` an unsigned LEB128 varint)::

    u8 version = 1, u8 form, 16 bytes file_sum,
    LISTED: v n, then per group: v gap (from the previous group's end, or 0), v count, v lead,
            v width, v el, v cells, 8 bytes sum

A snapshot saved before records existed has none: its groups are parsed from the stream and no
checksum is checked (docs/design.md, "The file record").
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from kvchunkfs.format.llama_state import Group, Segment
from kvchunkfs.format.relayout import HEAD

Buffer = bytes | bytearray | memoryview
VERSION = 1
SUM_BYTES = 16
GROUP_SUM_BYTES = 8
MAX_BYTES = 3 << 10  # a record larger than this lists no groups (``PARSED``): xattrs share ~4 KiB on ext4


class Form(enum.IntEnum):
    PLAIN = 0
    LISTED = 1
    PARSED = 2
    FILE_ORDER = 3

    @property
    def groups_given(self) -> bool:
        """Whether the record says where the groups are (no parse): all but ``PARSED``."""
        return self is not Form.PARSED


class RecordError(ValueError):
    """The bytes are not a file record this version reads."""


def file_hasher() -> xxhash.xxh3_128:
    """The running checksum of a file's bytes (``file_sum``)."""
    return xxhash.xxh3_128()


def group_sum(data: bytes | bytearray | memoryview) -> bytes:
    """The checksum of a group's bytes in file order."""
    return xxhash.xxh3_64_digest(data)


def group_hasher() -> xxhash.xxh3_64:
    """``group_sum`` fed a piece at a time."""
    return xxhash.xxh3_64()


def group_end(start: int, g: Group) -> int:
    return start + g.lead + g.count * (HEAD + g.cells * g.width)


def group_segment(start: int, g: Group) -> Segment:
    """The segment of a group starting at ``start`` as readers use it (its place and shape)."""
    return Segment(start, group_end(start, g), start + g.lead + HEAD * g.count, g.count * g.width, 0, 0, g)


def same_groups(a: list[Segment], b: list[Segment]) -> bool:
    """Whether two layouts put the same groups at the same places (cut details aside)."""
    return [(s.start, s.end, s.group) for s in a] == [(s.start, s.end, s.group) for s in b]


@dataclass(frozen=True)
class Listed:
    """One stored group and the checksum of its bytes in file order."""

    seg: Segment
    sum: bytes


@dataclass(frozen=True)
class FileRecord:
    form: Form
    file_sum: bytes
    groups: tuple[Listed, ...] = ()

    @property
    def segments(self) -> list[Segment]:
        return [x.seg for x in self.groups]

    def encode(self) -> bytes:
        out = bytearray([VERSION, self.form])
        out += self.file_sum
        if self.form is Form.LISTED:
            out += _varint(len(self.groups))
            prev = 0
            for x in self.groups:
                g = x.seg.group
                assert g is not None and x.seg.end is not None
                for v in (x.seg.start - prev, g.count, g.lead, g.width, g.el, g.cells):
                    out += _varint(v)
                out += x.sum
                prev = x.seg.end
        return bytes(out)


def mismatch(pieces: Iterable[tuple[Segment | None, Buffer]], record: FileRecord) -> str | None:
    """Why a file put back (``relayout.file_pieces``) is not the one ``record`` describes (None:
    it is): a listed group's checksum, then the whole file's."""
    sums = {x.seg.start: x.sum for x in record.groups}
    hasher = file_hasher()
    for g, piece in pieces:
        if g is not None and g.start in sums and group_sum(piece) != sums[g.start]:
            return f"the stored group at bytes {g.start}-{g.end} does not have its checksum"
        hasher.update(piece)
    if hasher.digest() != record.file_sum:
        return "the file's bytes do not have its checksum"
    return None


def make(file_sum: bytes, groups: list[Listed], group_w: int) -> FileRecord:
    """The record of a file saved with these groups (``group_w`` 0: a chunker that stores none);
    ``PARSED`` when listing them would pass ``MAX_BYTES``."""
    if not groups:
        return FileRecord(Form.PLAIN, file_sum)
    rec = FileRecord(Form.LISTED, file_sum, tuple(groups))
    if len(rec.encode()) > MAX_BYTES:
        return FileRecord(Form.PARSED, file_sum)
    return rec


def decode(data: bytes, size: int) -> FileRecord:
    """The record of a file of ``size`` bytes; RecordError if it is not one (or does not fit)."""
    if len(data) < 2 + SUM_BYTES or data[0] != VERSION:
        raise RecordError(f"not a file record (version {data[:1].hex() or 'missing'}, {len(data)} bytes)")
    try:
        form = Form(data[1])
    except ValueError:
        raise RecordError(f"unknown form {data[1]}") from None
    file_sum = bytes(data[2 : 2 + SUM_BYTES])
    pos = 2 + SUM_BYTES
    groups: list[Listed] = []
    if form is Form.LISTED:
        n, pos = _read_varint(data, pos)
        prev = 0
        for _ in range(n):
            vals = []
            for _ in range(6):
                v, pos = _read_varint(data, pos)
                vals.append(v)
            gap, count, lead, width, el, cells = vals
            if count < 1 or width < 1 or cells < 1 or (el and width % el) or lead > 64:
                raise RecordError(f"a group of impossible shape {vals}")
            seg = group_segment(prev + gap, Group(count, lead, width, el, cells))
            assert seg.end is not None
            if seg.end > size:
                raise RecordError(f"a group at {seg.start} passes the end of the file ({size} bytes)")
            if pos + GROUP_SUM_BYTES > len(data):
                raise RecordError("cut off")
            groups.append(Listed(seg, bytes(data[pos : pos + GROUP_SUM_BYTES])))
            pos += GROUP_SUM_BYTES
            prev = seg.end
    if pos != len(data):
        raise RecordError(f"{len(data) - pos} bytes past the record")
    return FileRecord(form, file_sum, tuple(groups))


def _varint(v: int) -> bytes:
    assert v >= 0
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise RecordError("cut off")
        b = data[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, pos
