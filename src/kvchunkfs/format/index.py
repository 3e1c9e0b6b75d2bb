"""casync/desync ``.caibx`` chunk index: the content of every stub.

Layout (all integers little-endian u64, see casync's ``caformat.h``)::

    header  size=48, type=CA_FORMAT_INDEX, feature_flags, chunk_size_min, avg, max
    table   0xFFFFFFFFFFFFFFFF, CA_FORMAT_TABLE
            N x (end_offset u64, chunk id 32 bytes)
    tail    0, 0, 48, 16 + 40*N + 40, CA_FORMAT_TABLE_TAIL_MARKER

A clear SHA-512/256 flag means chunk ids are SHA-256 digests.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

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
_END = struct.Struct("<Q")
_ID = struct.Struct("32s")
ID_LEN = 32
FIXED_BYTES = _HEADER.size + _TABLE_HEADER.size + _TAIL.size  # an index of no chunks
ITEM_BYTES = _ITEM.size  # each chunk adds this many


class IndexFormatError(ValueError):
    """The bytes are not a valid SHA-256 caibx index."""


class Index:
    """A file as an ordered list of chunks: ``ends[i]`` is the end offset of chunk ``ids[i]``.

    Kept as the index's own table (40 bytes a chunk: the end offset, the id), not as a Python
    object per chunk: a decoded index of a million chunks is its 40 MB of table, not ~110 bytes of
    objects per entry. A decoded index shares the bytes it was decoded from, and copies share
    their table until one of them changes (copy on write). ``ends`` and ``ids`` are views of the
    table; an id read from it is a new ``bytes`` each time.

    An index may be read while one thread appends to it (an open file's writer); every other
    change needs the caller's lock.
    """

    __slots__ = ("chunk_min", "chunk_avg", "chunk_max", "_s", "_n", "_prefixes")

    def __init__(
        self,
        chunk_min: int,
        chunk_avg: int,
        chunk_max: int,
        ends: Iterable[int] | None = None,
        ids: Iterable[bytes] | None = None,
    ) -> None:
        self.chunk_min, self.chunk_avg, self.chunk_max = chunk_min, chunk_avg, chunk_max
        # (buffer, offset of the first entry): one attribute, so a reader never pairs a new buffer
        # with an old offset. A ``bytes`` buffer is shared (never changed); a bytearray is this one's.
        self._s: tuple[bytes | bytearray, int] = (bytearray(), 0)
        self._n = 0
        self._prefixes: Any = None  # sorted first 8 bytes of every id (``might_hold``), once asked
        if ends is not None or ids is not None:
            table = bytearray()
            for end, cid in zip(ends or (), ids or (), strict=True):
                table += _ITEM.pack(end, cid)
            self._s, self._n = (table, 0), len(table) // ITEM_BYTES

    @classmethod
    def _shared(cls, head: tuple[int, int, int], buf: bytes, lo: int, n: int) -> Index:
        index = cls(*head)
        index._s, index._n = (buf, lo), n
        return index

    # -- reading ------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        n = self._n
        return self._end(n - 1) if n else 0

    def __len__(self) -> int:
        return self._n

    def _end(self, i: int) -> int:
        buf, lo = self._s
        return _END.unpack_from(buf, lo + i * ITEM_BYTES)[0]

    def _id(self, i: int) -> bytes:
        buf, lo = self._s
        return _ID.unpack_from(buf, lo + i * ITEM_BYTES + 8)[0]

    def start(self, i: int) -> int:
        return self._end(i - 1) if i else 0

    def length(self, i: int) -> int:
        return self._end(i) - self.start(i)

    def find(self, offset: int) -> int:
        """Index of the chunk holding byte ``offset`` (``len(self)`` past the end)."""
        lo, hi = 0, self._n
        while lo < hi:
            mid = (lo + hi) // 2
            if offset < self._end(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    @property
    def ends(self) -> Ends:
        return Ends(self)

    @ends.setter
    def ends(self, values: Iterable[int]) -> None:
        values = list(values)
        if len(values) != self._n:
            raise ValueError(f"{len(values)} end offsets for {self._n} chunks")
        for i, end in enumerate(values):
            self._set(i, end=end)

    @property
    def ids(self) -> Ids:
        return Ids(self)

    def table(self) -> bytes | memoryview:
        """The entries as the index file holds them (40 bytes each), read-only: a view of a shared
        table, a copy of this index's own (a view would stop a writer's appends)."""
        buf, lo = self._s
        end = lo + self._n * ITEM_BYTES
        return bytes(buf[lo:end]) if isinstance(buf, bytearray) else memoryview(buf)[lo:end]

    def might_hold(self, cid: bytes) -> bool:
        """False only if ``cid`` is none of the index's ids; True may be wrong (same first 8 bytes).
        For a pin (``PackStore.is_pinned``): a wrong True only keeps a chunk one more GC. The first
        call sorts the ids' first 8 bytes (8 bytes a chunk); changes to the index forget them."""
        if not self._n:
            return False
        prefixes = self._prefixes
        if prefixes is None or len(prefixes) != self._n:
            view = np.ndarray((self._n,), ">u8", self.table(), 8, (ITEM_BYTES,))
            prefixes = self._prefixes = np.sort(view)
        key = np.uint64(int.from_bytes(cid[:8], "big"))
        at = int(np.searchsorted(prefixes, key))
        return at < len(prefixes) and prefixes[at] == key

    # -- changing -------------------------------------------------------------------------------

    def _own(self) -> bytearray:
        """The table as this index's own bytearray (a shared one copied first)."""
        buf, lo = self._s
        if not isinstance(buf, bytearray):
            buf = bytearray(memoryview(buf)[lo : lo + self._n * ITEM_BYTES])
            self._s = (buf, 0)
        self._prefixes = None
        return buf

    def append(self, chunk_id: bytes, length: int) -> None:
        if len(chunk_id) != ID_LEN:
            raise ValueError(f"a chunk id is {ID_LEN} bytes, not {len(chunk_id)}")
        buf = self._own()
        buf += _ITEM.pack(self.size + length, chunk_id)
        self._n += 1  # after the bytes: a concurrent reader never sees an entry not written yet

    def pop(self) -> None:
        """Drop the last chunk."""
        buf = self._own()
        self._n -= 1
        del buf[self._n * ITEM_BYTES :]

    def _set(self, i: int, end: int | None = None, cid: bytes | None = None) -> None:
        if not -self._n <= i < self._n:
            raise IndexError("index entry out of range")
        i %= self._n
        buf = self._own()
        if end is not None:
            _END.pack_into(buf, i * ITEM_BYTES, end)
        if cid is not None:
            if len(cid) != ID_LEN:
                raise ValueError(f"a chunk id is {ID_LEN} bytes, not {len(cid)}")
            _ID.pack_into(buf, i * ITEM_BYTES + 8, cid)

    def copy(self) -> Index:
        """An index of the same chunks, changed independently; no table copied until one changes."""
        buf, lo = self._s
        if isinstance(buf, bytearray):  # both share one immutable copy from now on
            buf, lo = bytes(memoryview(buf)[: self._n * ITEM_BYTES]), 0
            self._s = (buf, lo)
        return Index._shared((self.chunk_min, self.chunk_avg, self.chunk_max), buf, lo, self._n)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Index):
            return NotImplemented
        return (self.chunk_min, self.chunk_avg, self.chunk_max) == (
            other.chunk_min,
            other.chunk_avg,
            other.chunk_max,
        ) and self.table() == other.table()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Index({self.chunk_min}, {self.chunk_avg}, {self.chunk_max}, {self._n} chunks, size {self.size})"


class _View(Sequence[Any]):
    """A sequence view of one column of an index's table (slices are lists)."""

    __slots__ = ("_index",)

    def __init__(self, index: Index) -> None:
        self._index = index

    def __len__(self) -> int:
        return len(self._index)

    def _get(self, i: int) -> Any:
        raise NotImplementedError

    def _pos(self, i: int) -> int:
        n = len(self._index)
        if not -n <= i < n:
            raise IndexError("index entry out of range")
        return i % n

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self._get(k) for k in range(*i.indices(len(self._index)))]
        return self._get(self._pos(i))

    def __iter__(self) -> Iterator[Any]:
        for k in range(len(self._index)):
            yield self._get(k)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _View | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


class Ends(_View, Sequence[int]):
    """``index.ends``: the end offset of each chunk."""

    def _get(self, i: int) -> int:
        return self._index._end(i)

    def __getitem__(self, i: int | slice) -> Any:
        return super().__getitem__(i)

    def __setitem__(self, i: int, end: int) -> None:
        self._index._set(i, end=end)


class Ids(_View, Sequence[bytes]):
    """``index.ids``: the chunk ids in file order (each a new 32-byte ``bytes``)."""

    def _get(self, i: int) -> bytes:
        return self._index._id(i)

    def __iter__(self) -> Iterator[bytes]:
        index = self._index
        buf, lo = index._s
        if isinstance(buf, bytearray):  # may grow meanwhile: no buffer held across steps
            yield from super().__iter__()
            return
        for _end, cid in _ITEM.iter_unpack(memoryview(buf)[lo : lo + index._n * ITEM_BYTES]):
            yield cid

    def __setitem__(self, i: int, cid: bytes) -> None:
        self._index._set(i, cid=cid)

    def __contains__(self, cid: object) -> bool:
        """A scan of the table (no object per entry)."""
        if not isinstance(cid, bytes) or len(cid) != ID_LEN:
            return False
        index = self._index
        buf, lo = index._s
        end = lo + len(index) * ITEM_BYTES
        at = buf.find(cid, lo, end)
        while at >= 0:
            if (at - lo) % ITEM_BYTES == 8:
                return True
            at = buf.find(cid, at + 1, end)
        return False


def encode(index: Index) -> bytes:
    n = len(index)
    return b"".join(
        [
            _HEADER.pack(48, CA_FORMAT_INDEX, FEATURE_FLAGS, index.chunk_min, index.chunk_avg, index.chunk_max),
            _TABLE_HEADER.pack(0xFFFFFFFFFFFFFFFF, CA_FORMAT_TABLE),
            index.table(),
            _TAIL.pack(0, 0, 48, 16 + 40 * n + 40, CA_FORMAT_TABLE_TAIL_MARKER),
        ]
    )


def _check_frame(head: bytes, tail: bytes, length: int) -> tuple[tuple[int, int, int], int]:
    """((chunk_min, avg, max), entries) of an index ``length`` bytes long, from its first 64 bytes
    (``head``) and last 40 (``tail``); IndexFormatError if they are not a SHA-256 caibx index's."""
    fixed = _HEADER.size + _TABLE_HEADER.size + _TAIL.size
    if length < fixed or (length - fixed) % _ITEM.size:
        raise IndexFormatError(f"bad index length {length}")
    size, typ, flags, cmin, cavg, cmax = _HEADER.unpack_from(head, 0)
    if size != 48 or typ != CA_FORMAT_INDEX:
        raise IndexFormatError("not a caibx index (bad header)")
    if flags & CA_FORMAT_SHA512_256:
        raise IndexFormatError("index uses SHA-512/256 chunk ids, expected SHA-256")
    if _TABLE_HEADER.unpack_from(head, _HEADER.size) != (0xFFFFFFFFFFFFFFFF, CA_FORMAT_TABLE):
        raise IndexFormatError("bad table header")
    n = (length - fixed) // _ITEM.size
    if _TAIL.unpack_from(tail, 0) != (0, 0, 48, 16 + 40 * n + 40, CA_FORMAT_TABLE_TAIL_MARKER):
        raise IndexFormatError("bad table tail")
    return (cmin, cavg, cmax), n


def _check_ends(ends: np.ndarray, before: int) -> None:
    """End offsets must rise from ``before`` (the previous piece's last, 0 at the start)."""
    if not len(ends):
        return
    bad = np.flatnonzero(ends[1:] <= ends[:-1])
    if ends[0] <= before or len(bad):
        at = 0 if ends[0] <= before else int(bad[0]) + 1
        raise IndexFormatError(f"chunk end offsets not increasing at {int(ends[at])}")


TABLE_AT = _HEADER.size + _TABLE_HEADER.size  # where the entries begin
PIECE_ENTRIES = 1 << 14  # ``read_table``: entries per piece (640 KiB)


def read_table(read: Callable[[int, int], bytes], length: int, entries: int | None = None
               ) -> Iterator[tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    """The entries of an index ``length`` bytes long, ``read(offset, size)`` a piece at a time:
    (end offsets as uint64, ids as ``V32`` rows) per piece of at most ``entries``, checked as
    ``decode`` checks them. For what needs every id once but not the index: an index of a million
    chunks is then 2.5 MiB at a time, not its 40 MB. IndexFormatError may come after some pieces
    (a bad end offset is found in its piece); OSError if the bytes end early."""
    if length < FIXED_BYTES:
        raise IndexFormatError(f"bad index length {length}")
    _, n = _check_frame(_exact(read, 0, TABLE_AT), _exact(read, length - _TAIL.size, _TAIL.size), length)
    entries = entries or PIECE_ENTRIES
    before = 0
    for first in range(0, n, entries):
        k = min(entries, n - first)
        buf = _exact(read, TABLE_AT + first * ITEM_BYTES, k * ITEM_BYTES)
        ends = np.ndarray((k,), "<u8", buf, 0, (ITEM_BYTES,))
        _check_ends(ends, before)
        before = int(ends[-1])
        yield ends.astype(np.uint64), np.ndarray((k,), f"V{ID_LEN}", buf, 8, (ITEM_BYTES,))


def read_head(read: Callable[[int, int], bytes], length: int, entries: int) -> tuple[Index, int]:
    """(an Index of the first ``entries`` entries of an index ``length`` bytes long, the number of
    entries of the whole), checked as ``decode`` checks them: the start of a file, e.g. to read its
    header, without the whole table."""
    if length < FIXED_BYTES:
        raise IndexFormatError(f"bad index length {length}")
    head = _exact(read, 0, TABLE_AT)
    limits, n = _check_frame(head, _exact(read, length - _TAIL.size, _TAIL.size), length)
    k = min(entries, n)
    buf = _exact(read, TABLE_AT, k * ITEM_BYTES)
    _check_ends(np.ndarray((k,), "<u8", buf, 0, (ITEM_BYTES,)), 0)
    return Index._shared(limits, buf, 0, k), n


def _exact(read: Callable[[int, int], bytes], offset: int, size: int) -> bytes:
    data = read(offset, size)
    if len(data) != size:
        raise OSError(f"index ends early: {len(data)} bytes at {offset}, expected {size}")
    return data


def decode(data: bytes) -> Index:
    """Parse and validate an index; raises IndexFormatError on anything unexpected.

    The index shares ``data`` (no copy; a ``bytes`` it keeps alive): checked with numpy over the
    table, not an object per entry."""
    if not isinstance(data, bytes):
        data = bytes(data)
    if len(data) < FIXED_BYTES:
        raise IndexFormatError(f"bad index length {len(data)}")
    head, n = _check_frame(data, data[len(data) - _TAIL.size :], len(data))
    lo = TABLE_AT
    if n:
        _check_ends(np.ndarray((n,), "<u8", data, lo, (ITEM_BYTES,)), 0)  # a view: no copy
    return Index._shared(head, data, lo, n)
