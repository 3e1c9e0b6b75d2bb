"""Token-major storage of K and V blocks (chunker ``relayout``): the permutation and its inverse.

A llama.cpp state file writes each layer's K rows for every cell, then each layer's V rows (or,
transposed, each dimension's run over every cell). A turn's new cells therefore land at the end of
every block, 2 x n_layer insertion points, and a content-defined cut pays about half a chunk at
each. ``relayout`` stores a ``Group`` of consecutive blocks as their headers followed by one record
per cell (that cell's row of every block in turn), so the group grows only at its end: one
insertion point per group, and transposed V grows like plain V.

The stored stream is a permutation of the file with the same length: a group occupies the same
byte range in both, and everything outside groups is stored as it is. Where the groups are is
recorded with the snapshot (its file record, format/filerecord.py): a reader never derives it from
the permuted bytes. ``groups`` parses them from a stream, for snapshots saved before records and
for the save's own check: ``llama_state.step`` reads only the first header of a group, which sits
at the group's start in both, but a decision elsewhere may look ahead into a group (the cell
records' extension is guessed by trying sizes), so a stream need not parse like its file.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import xxhash

from kvchunkfs.format import llama_state as ls
from kvchunkfs.format.llama_state import Group, Segment

HEAD = 12  # a K or V block header: i32 type, u64 row size (transposed V: i32 type, u32 el, u32 n)

ReadAt = Callable[[int, int], bytes]
Buffer = bytes | bytearray | memoryview


_TYPED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_BLOCK = 64  # dimensions transposed at a time: the source rows stay in cache
PIECE_READ = 4 << 20  # file bytes read at a time for a group's checksums (``GroupReader``)


def _parts(g: Group) -> tuple[int, int]:
    """(bytes of the headers, bytes of one block's rows)."""
    return g.lead + HEAD * g.count, g.cells * g.width


def transpose(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst`` = ``src``.T in blocks of rows (a plain transposing copy misses the cache)."""
    for r in range(0, src.shape[0], _BLOCK):
        dst[:, r : r + _BLOCK] = src[r : r + _BLOCK].T


def typed(a: np.ndarray, el: int) -> np.ndarray:
    """``a`` (last axis a whole number of elements) seen as ``el``-byte elements."""
    dt = _TYPED.get(el)
    return a.view(dt) if dt is not None else a.reshape(*a.shape[:-1], -1, el)


def _put(g: Group, records: np.ndarray, i: int, block: np.ndarray, back: bool, c0: int = 0) -> None:
    """Copy block ``i``'s rows of cells ``[c0, c0 + len(records))`` between the file form
    (``block``: the whole block) and their columns of ``records``."""
    k = records.shape[0]
    cols = records[:, i * g.width : (i + 1) * g.width]
    if not g.el:
        rows = block.reshape(g.cells, g.width)[c0 : c0 + k]
        if back:
            rows[:] = cols
        else:
            cols[:] = rows
        return
    n = g.width // g.el
    runs = typed(block.reshape(n, g.cells * g.el), g.el).reshape(n, g.cells, -1)[:, c0 : c0 + k]
    per_cell = typed(cols, g.el).reshape(k, n, -1)
    if g.el not in _TYPED:  # an element size no integer type has: a plain (slower) transpose
        if back:
            runs[:] = per_cell.transpose(1, 0, 2)
        else:
            per_cell[:] = runs.transpose(1, 0, 2)
        return
    if back:
        transpose(runs[..., 0], per_cell[..., 0])
    else:
        transpose(per_cell[..., 0], runs[..., 0])


def block_heads(g: Group) -> list[tuple[int, int, int]]:
    """Per block: (its header's offset in the stream, in the file, its length); its rows follow
    the header in the file."""
    out, hp, at = [], 0, 0
    body = g.cells * g.width
    for i in range(g.count):
        h = HEAD + (g.lead if i == 0 else 0)
        out.append((hp, at, h))
        hp, at = hp + h, at + h + body
    return out


def _room(out: np.ndarray | None, n: int) -> np.ndarray:
    """``n`` bytes of ``out`` if it is given and large enough, else a new (uninitialised) array."""
    return out[:n] if out is not None and len(out) >= n else np.empty(n, np.uint8)


def _permute(seg: Segment, src: Buffer, back: bool, out: np.ndarray | None = None) -> memoryview:
    g = seg.group
    assert g is not None
    heads, body = _parts(g)
    s = np.frombuffer(src, np.uint8)
    o = _room(out, len(s))
    stream, file = (s, o) if back else (o, s)
    records = stream[heads:].reshape(g.cells, g.count * g.width)
    for i, (hp, at, h) in enumerate(block_heads(g)):
        if back:
            file[at : at + h] = stream[hp : hp + h]
        else:
            stream[hp : hp + h] = file[at : at + h]
        _put(g, records, i, file[at + h : at + h + body], back)
    return o.data


def to_stream(seg: Segment, src: Buffer, out: np.ndarray | None = None) -> memoryview:
    """The stored form of a group's file bytes ``src`` (exactly ``seg.end - seg.start`` bytes),
    built in ``out`` if it is given and large enough."""
    return _permute(seg, src, False, out)


def to_file(seg: Segment, src: Buffer) -> memoryview:
    """The file bytes of a group from its stored form (the inverse of ``to_stream``)."""
    return _permute(seg, src, back=True)


ReadInto = Callable[[int, memoryview], None]  # fill the buffer with the file's bytes at an offset

WINDOW = 8 << 20  # bytes of a group's stored form built at a time from its file (``GroupReader``)


class GroupReader:
    """A group's stored form built a window of cells at a time from its file bytes, read where
    they lie (``read(offset, buffer)``, absolute file offsets), so a group is never held whole:
    memory is about two windows whatever the group's size. The file is read in *extents* (block
    headers, and per block and window its rows, or for transposed V each run's elements of the
    window's cells), each read once while building the windows; ``file_pieces`` then reads the
    file in order, checks every extent against what the windows were built from (xxh3-64: a file
    changed in between fails with EIO instead of storing chunks its checksum does not describe)
    and yields it, for the file's and the group's checksums."""

    def __init__(self, seg: Segment, read: ReadInto, window: int | None = None, least: int = 0) -> None:
        """``window``: bytes of stored form built at a time (default ``WINDOW``); ``least``: at
        least this many (a chunk's maximum: every window then ends past a cut)."""
        window = WINDOW if window is None else window
        g = seg.group
        assert g is not None and seg.end is not None
        self.seg, self.g, self.read = seg, g, read
        self.heads, self.body = _parts(g)
        self.rec = g.count * g.width
        self.k = max(1, window // max(1, self.rec), -(-least // max(1, self.rec)))  # cells a window
        self.windows = max(1, -(-g.cells // self.k))
        self.runs = g.width // g.el if g.el else 1  # extents per block and window
        self.blocks = block_heads(g)
        self._sums = np.zeros(g.count * (1 + self.runs * self.windows), np.uint64)

    def _at(self, i: int, run: int, w: int) -> int:
        """The index of block ``i``'s extent of run ``run`` in window ``w`` (file order)."""
        return i * (1 + self.runs * self.windows) + 1 + run * self.windows + w

    def span(self, w: int) -> tuple[int, int]:
        """Window ``w``'s stored bytes, group-relative: [start, end)."""
        c0, c1 = w * self.k, min(self.g.cells, (w + 1) * self.k)
        return (0 if w == 0 else self.heads + c0 * self.rec), self.heads + c1 * self.rec

    def fill(self, w: int, out: np.ndarray) -> None:
        """Window ``w``'s stored bytes into ``out`` (exactly ``span(w)``'s length)."""
        g, base = self.g, self.seg.start
        c0, c1 = w * self.k, min(g.cells, (w + 1) * self.k)
        k = c1 - c0
        at = 0
        if w == 0:
            for i, (hp, off, h) in enumerate(self.blocks):
                piece = out[hp : hp + h]
                self.read(base + off, piece.data)
                self._sums[self._at(i, 0, 0) - 1] = xxhash.xxh3_64_intdigest(piece.data)
            at = self.heads
        records = out[at : at + k * self.rec].reshape(k, self.rec)
        sub = replace(g, cells=k)  # the window's rows of a block, gathered, are a block of k cells
        rows = np.empty(k * g.width, np.uint8)
        part = k * g.el if g.el else k * g.width
        for i, (_hp, off, h) in enumerate(self.blocks):
            first = base + off + h + c0 * (g.el or g.width)
            for run in range(self.runs):
                piece = rows[run * part : (run + 1) * part]
                self.read(first + run * g.cells * g.el, piece.data)
                self._sums[self._at(i, run, w)] = xxhash.xxh3_64_intdigest(piece.data)
            _put(sub, records, i, rows, False)

    def extents(self) -> Iterator[tuple[int, int, int]]:
        """(index, group-relative file offset, length) of every extent, in file order (they tile
        the group)."""
        g = self.g
        for i, (_hp, off, h) in enumerate(self.blocks):
            yield self._at(i, 0, 0) - 1, off, h
            for run in range(self.runs):
                for w in range(self.windows):
                    c0, c1 = w * self.k, min(g.cells, (w + 1) * self.k)
                    el = g.el or g.width
                    yield self._at(i, run, w), off + h + run * g.cells * g.el + c0 * el, (c1 - c0) * el

    def file_pieces(self, piece: int = PIECE_READ) -> Iterator[memoryview]:
        """The group's file bytes in order, at most about ``piece`` at a time, each extent checked
        against the bytes the windows were built from (call after every window is filled)."""
        buf = np.empty(max(piece, self.k * self.g.width), np.uint8)
        batch: list[tuple[int, int, int]] = []
        size = 0
        for ext in self.extents():
            if size + ext[2] > len(buf):
                yield self._checked(buf, batch, size)
                batch, size = [], 0
            batch.append(ext)
            size += ext[2]
        if batch:
            yield self._checked(buf, batch, size)

    def _checked(self, buf: np.ndarray, batch: list[tuple[int, int, int]], size: int) -> memoryview:
        view = buf[:size].data
        self.read(self.seg.start + batch[0][1], view)
        at = 0
        for e, _off, n in batch:
            if xxhash.xxh3_64_intdigest(view[at : at + n]) != int(self._sums[e]):
                raise OSError(errno.EIO, f"the file changed while its group at {self.seg.start} was stored")
            at += n
        return view


class Rows(NamedTuple):
    """Where the stored form holds a range of one block's rows (``rows_of``)."""

    block: int  # which block of the group
    first: int  # the range's cells: [first, last)
    last: int
    skip: int  # bytes of the rows of ``first`` before the range starts

    def stored(self, g: Group) -> tuple[int, int]:
        """(offset, length) in the group's stored form of the records holding the range."""
        heads, _ = _parts(g)
        rec = g.count * g.width
        return heads + self.first * rec, (self.last - self.first) * rec


def rows_of(g: Group, off: int, size: int) -> Rows | None:
    """The records that hold group-relative file bytes ``[off, off + size)``, if the range lies in
    one block's rows and the rows are not transposed (a transposed run spans every cell); None
    otherwise. A read of a few rows needs only their records: ``cut_rows`` takes the rows out."""
    if g.el or size <= 0:
        return None
    for i, (_hp, at, h) in enumerate(block_heads(g)):
        rows = at + h
        if rows <= off and off + size <= rows + g.cells * g.width:
            first, last = (off - rows) // g.width, -(-(off + size - rows) // g.width)
            return Rows(i, first, last, off - rows - first * g.width)
    return None


def cut_rows(g: Group, where: Rows, records: Buffer, size: int) -> bytes:
    """``size`` file bytes of ``where`` from its records (``Rows.stored``'s bytes)."""
    rec = np.frombuffer(records, np.uint8).reshape(where.last - where.first, g.count * g.width)
    rows = rec[:, where.block * g.width : (where.block + 1) * g.width].tobytes()
    return rows[where.skip : where.skip + size]


def file_range(g: Group, read_stored: ReadAt, off: int, size: int) -> bytes | None:
    """Group-relative file bytes ``[off, off + size)`` from just the stored bytes they lie in
    (``read_stored(offset, n)``, group-relative offsets of the stored form): the headers, and the
    records of the rows' cells. None for a transposed group (each of its runs holds every cell)."""
    if g.el:
        return None
    heads, body = _parts(g)
    rec = g.count * g.width
    end, out = off + size, bytearray()
    for i, (hp, at, h) in enumerate(block_heads(g)):
        lo, hi = max(off, at), min(end, at + h)
        if lo < hi:
            out += read_stored(hp + lo - at, hi - lo)
        rows = at + h
        lo, hi = max(off, rows), min(end, rows + body)
        if lo < hi:
            first, last = (lo - rows) // g.width, -(-(hi - rows) // g.width)
            records = read_stored(heads + first * rec, (last - first) * rec)
            where = Rows(i, first, last, lo - rows - first * g.width)
            out += cut_rows(g, where, records, hi - lo)
    return bytes(out)


class Unpermute:
    """A group put back in file order as its stored bytes arrive, in order: a restore reads the
    group's first block while the rest of it is still being fetched. ``feed`` the stored chunks in
    order; ``ready`` says whether a range (group-relative, file order) is in place; ``data`` is the
    file form (only ranges that are ready hold their bytes)."""

    def __init__(self, seg: Segment, out: np.ndarray | None = None) -> None:
        """``out``: where to put the group back (at least its length, uninitialised), if not new."""
        g = seg.group
        assert g is not None
        self.g = g
        self.heads, self.body = _parts(g)
        self.blocks = block_heads(g)
        n = self.heads + g.count * self.body
        self.out = _room(out, n)
        self.data = self.out.data
        self._head = bytearray()
        self.cells = 0  # cells whose rows are in place in every block

    @property
    def done(self) -> bool:
        return self.cells == self.g.cells and len(self._head) == self.heads

    def feed(self, pieces: Sequence[Buffer]) -> bool:
        """Put the next stored bytes in place; False if a piece past the headers is not whole
        records (records wider than a chunk): the caller then joins the group and uses ``to_file``."""
        g, rec = self.g, self.g.count * self.g.width
        for piece in pieces:
            a = np.frombuffer(piece, np.uint8)
            if len(self._head) < self.heads:
                take = min(self.heads - len(self._head), len(a))
                self._head += a[:take].tobytes()
                a = a[take:]
                if len(self._head) == self.heads:
                    hv = np.frombuffer(self._head, np.uint8)
                    for hp, at, h in self.blocks:
                        self.out[at : at + h] = hv[hp : hp + h]
            if not len(a):
                continue
            if len(a) % rec or self.cells + len(a) // rec > g.cells:
                return False
            records = a.reshape(-1, rec)
            for i, (_hp, at, h) in enumerate(self.blocks):
                _put(g, records, i, self.out[at + h : at + h + self.body], True, self.cells)
            self.cells += records.shape[0]
        return True

    def set_all(self, src: Buffer) -> None:
        """Everything at once from the joined stored form."""
        data = to_file(Segment(0, len(src), 0, 0, 0, 0, self.g), src)
        self.out, self.data = np.frombuffer(data, np.uint8), data
        self._head = bytearray(self.heads)
        self.cells = self.g.cells

    def cells_for(self, off: int, size: int) -> int:
        """How many cells must be in place before group-relative ``[off, off + size)`` is (the
        headers come with the first piece; transposed rows only once every cell is)."""
        end, need = off + size, 0
        for _hp, at, h in self.blocks:
            rows, stop = at + h, at + h + self.body
            if end <= rows or off >= stop:
                continue
            if self.g.el:
                return self.g.cells
            need = max(need, -(-(min(end, stop) - rows) // self.g.width))
        return min(need, self.g.cells)

    def ready(self, off: int, size: int) -> bool:
        """Whether group-relative file bytes ``[off, off + size)`` are in place."""
        if self.done:
            return True
        end = off + size
        have_heads = len(self._head) == self.heads
        for _hp, at, h in self.blocks:
            rows, stop = at + h, at + h + self.body
            if end <= at or off >= stop:
                continue
            if off < rows and not have_heads:
                return False
            if end > rows:
                filled = rows + (self.cells * self.g.width if not self.g.el else 0)
                if end > filled:
                    return False
        return True


def groups(read: ReadAt, size: int, group_w: int) -> list[Segment]:
    """The groups of a stored stream of ``size`` bytes, read through ``read(offset, n)``: the
    permuted ranges, in order. Walks the headers only (a few bytes a segment, and the cell records),
    as appending does. A group that would pass ``size`` was stored as it is and is not listed."""
    if not group_w:
        return []
    return groups_until(read, size, start_state(group_w), size)[0]


def start_state(group_w: int) -> ls.State:
    """The parser's state at a stream's first byte."""
    return ls.State("file", 0, group_w=group_w)


def groups_until(read: ReadAt, size: int, st: ls.State | None, until: int) -> tuple[list[Segment], ls.State | None]:
    """``groups`` from parser state ``st`` on, parsing only until a state at or past ``until``:
    every group that starts before ``until`` is listed (a plan's segments start at its state, so
    later ones start past it). Returns them and the state to resume from (None: the end)."""
    out: list[Segment] = []
    while st is not None and st.pos < min(size, until):
        plan = ls.plan_at(st, read, size)
        for seg in plan.segments:
            if seg.group is not None and seg.end is not None and seg.end <= size:
                out.append(seg)
        st = plan.next
    if st is not None and st.pos >= size:
        st = None
    return out, st


PIECE = 4 << 20  # bytes outside groups put back at a time


def file_pieces(read: ReadAt, size: int, found: Sequence[Segment]) -> Iterator[tuple[Segment | None, Buffer]]:
    """A whole file from its stored stream of ``size`` bytes (read through ``read(offset, n)``),
    its groups ``found`` put back: (the group, its file bytes) for each group, (None, bytes) for
    the bytes between them, at most ``PIECE`` at a time, in order."""
    pos = 0
    for g in [*found, Segment(size, size)]:
        while pos < g.start:
            n = min(PIECE, g.start - pos)
            yield None, _exactly(read(pos, n), n, pos)
            pos += n
        if g.group is not None and g.end is not None:
            yield g, to_file(g, _exactly(read(g.start, g.end - g.start), g.end - g.start, g.start))
            pos = g.end


def _exactly(data: Buffer, n: int, pos: int) -> Buffer:
    if len(data) != n:
        raise OSError(errno.EIO, f"the stored stream is {n - len(data)} bytes short at {pos}")
    return data


def file_bytes(stream: Buffer, group_w: int, found: Sequence[Segment] | None = None) -> bytes:
    """A whole file from its whole stored stream (tests, offline tools): its groups ``found`` (a
    file record's), or, for a snapshot saved before records, as the stream parses."""
    view = memoryview(stream)

    def read(off: int, n: int) -> bytes:
        return bytes(view[off : off + n])

    if found is None:
        found = groups(read, len(view), group_w)
    return b"".join(bytes(piece) for _, piece in file_pieces(read, len(view), found))
