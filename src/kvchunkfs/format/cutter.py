"""Where chunks end: plain content-defined chunking, or format-aware cutting of llama.cpp state files.

A save (file/chunking.py) feeds a file's bytes in order, a window at a time, with the ``CutState``
at their first byte and gets back the chunks that are final plus the state at the first byte it
must feed again (the tentative tail: bytes whose boundary later bytes may still move). ``final``
says the data ends the file. Boundaries are a function of the file's bytes only, so any split of
the bytes and ``cut_all`` give the same chunks.

``aware=False`` is FastCDC over the whole file (the cutter of stores created before format-aware
cutting). ``aware=True`` walks the file with ``llama_state.step``:

* every segment start is a boundary (file header, token ids, counts, cell records, each K and V
  block with its small header, each recurrent block, an appended blob, the opaque rest);
* inside a segment of units (rows) the boundaries are at a fixed stride, a whole number of units
  near the average chunk size (``relayout`` from cut version 2: at most ``MAX_RECORDS`` of them),
  counted from the first unit: a block that grew at its end keeps every earlier chunk, and only its
  last, partial stride is stored again;
* transposed V (one run of elements per dimension, every run growing): boundaries at each run start
  and at strides inside long runs; short runs are grouped a whole number of runs per chunk;
* opaque segments (unknown magic or version, anything that stops parsing) get FastCDC from their
  start, so a file that is not a state file is chunked exactly as with ``aware=False``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from kvchunkfs.format import llama_state as ls
from kvchunkfs.format import relayout
from kvchunkfs.format.chunker import Chunker
from kvchunkfs.format.filerecord import Listed, group_sum
from kvchunkfs.format.llama_state import Segment

KINDS = ("format", "cdc", "relayout")
LEAD = 64  # room for a segment's header in its first chunk, so a chunk never passes chunk_max
GROUP_WIDTH = 8 << 10  # relayout: K (V) blocks grouped into records of about this many bytes a cell
SMALL_UNIT = 64  # relayout: segments of rows this small (token ids, cell records) ...
SMALL_STRIDE = 4 << 10  # ... are cut this finely: a turn stores each one's last stride again
# Cut versions of ``relayout`` (recorded per store: a store keeps the one it was created with).
# 1: a stride of whole records nearest ``chunk_avg``.
# 2: at most ``MAX_RECORDS`` records a stride (but never under ``SMALL_STRIDE`` bytes): what a turn
#    stores again is at most ``MAX_RECORDS`` tokens' rows of every group, whatever the row size.
# Both cut small rows every ``SMALL_STRIDE`` bytes: no chunk is shorter except at segment ends.
CUTS = (1, 2)
CUT = CUTS[-1]  # for new stores
MAX_RECORDS = 7


@dataclass(frozen=True)
class CutState:
    """The cutter at file offset ``pos`` (a chunk start): the segment holding ``pos`` and any known
    after it, then the parser state where the last of them ends (None: the last one is open)."""

    pos: int
    segments: tuple[Segment, ...]
    next: ls.State | None

    @property
    def waits_for(self) -> int:
        """The file offset before which nothing can be cut: the end of a group being gathered."""
        segs = self.segments
        if segs and segs[0].group is not None and segs[0].end is not None:
            return segs[0].end
        return 0

    @property
    def plain_cdc(self) -> bool:
        """From here to the end of the file the cut is FastCDC from each chunk's start (a ``cdc``
        store, or an opaque segment that runs to the end of the file)."""
        segs = self.segments
        return self.next is None and len(segs) == 1 and segs[0].end is None and segs[0].unit == 0


class Cutter:
    def __init__(self, chunk_min: int, chunk_avg: int, chunk_max: int, kind: str = "format", cut: int = CUT) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown chunker {kind!r}")
        if cut not in CUTS:
            raise ValueError(f"unknown cut version {cut!r}")
        self.kind = kind
        self.cut_version = cut
        # Where a group's stored form is built (relayout saves): a daemon sets a pool of buffers
        # faulted in once; None: a fresh array each time.
        self.alloc: Callable[[int], np.ndarray] | None = None
        self.cdc = Chunker(chunk_min, chunk_avg, chunk_max)
        self.min, self.avg, self.max = chunk_min, chunk_avg, chunk_max

    @property
    def aware(self) -> bool:
        return self.kind != "cdc"

    @property
    def group_w(self) -> int:
        """Bytes per cell a group of blocks aims at; 0: blocks are stored as the file has them."""
        return GROUP_WIDTH if self.kind == "relayout" else 0

    def _start(self) -> ls.State:
        return replace(ls.START, group_w=self.group_w)

    def initial(self) -> CutState:
        if self.aware:
            return CutState(0, (), self._start())
        return CutState(0, (Segment(0, None),), None)

    # -- cutting ----------------------------------------------------------------------------

    def cut(
        self, state: CutState, data: bytes | memoryview, final: bool, groups: list[Listed] | None = None
    ) -> tuple[list[memoryview], CutState]:
        """Chunks of ``data`` (which starts at ``state.pos``) whose end is decided, and the state at
        the first byte not in them. With ``final`` every byte is in a chunk. ``groups``: where to
        note each group stored permuted by this cut, with the checksum of its file bytes."""
        view = memoryview(data)
        base, top = state.pos, state.pos + len(view)
        out: list[memoryview] = []
        pos, segs, nxt = base, list(state.segments), state.next
        while pos < top or (not segs and nxt is not None and final):
            if not segs:
                assert nxt is not None and nxt.pos == pos
                plan = ls.step(nxt, view[pos - base :], final)
                if isinstance(plan, ls.Need):
                    if not final:
                        break
                    plan = ls.opaque(pos)  # never happens (steps do not ask at the end); never lose bytes
                segs, nxt = list(plan.segments), plan.next
                continue
            seg = segs[0]
            pos, done = self._cut_segment(seg, view, base, pos, final, out, groups)
            if done:
                segs.pop(0)
            elif pos < top or not final:
                break
        return out, CutState(pos, tuple(segs), nxt)

    def _cut_segment(
        self,
        seg: Segment,
        view: memoryview,
        base: int,
        pos: int,
        final: bool,
        out: list[memoryview],
        groups: list[Listed] | None = None,
    ) -> tuple[int, bool]:
        """Cut ``seg`` from ``pos`` as far as the data allows; (new pos, segment finished)."""
        if seg.group is not None:
            return self._cut_group(seg, view, base, pos, final, out, groups)
        top = base + len(view)
        end = top if seg.end is None else min(seg.end, top)
        complete = seg.end is not None and seg.end <= top
        if seg.unit == 0:
            pieces = self.cdc.cut(view[pos - base : end - base]) if end > pos else []
            if pieces and not (complete or final):
                pieces.pop()  # its end may still move
            for p in pieces:
                out.append(p)
                pos += len(p)
            return pos, complete
        stride, period, shift = self._grid(seg)
        while True:
            c = _next_cut(seg, pos, stride, period, shift)
            if c > end:
                break
            out.append(view[pos - base : c - base])
            pos = c
            if c == seg.end:
                return pos, True
        if final and pos < end:  # cut off by the end of the file
            out.append(view[pos - base : end - base])
            pos = end
        return pos, False

    def _cut_group(
        self,
        seg: Segment,
        view: memoryview,
        base: int,
        pos: int,
        final: bool,
        out: list[memoryview],
        groups: list[Listed] | None,
    ) -> tuple[int, bool]:
        """A group is cut once all its bytes are here: re-laid out token-major, then cut like rows.
        A group the end of the file cuts off is left as it is, cut by content (readers see a group
        that passes the end and read it as it is too)."""
        assert seg.end is not None and pos == seg.start
        top = base + len(view)
        if seg.end <= top:
            room = self.alloc(seg.end - seg.start) if self.alloc is not None else None
            file = view[seg.start - base : seg.end - base]
            if groups is not None:
                groups.append(Listed(seg, group_sum(file)))
            stream = memoryview(relayout.to_stream(seg, file, room))
            rows = replace(seg, group=None)
            return self._cut_segment(rows, stream, seg.start, seg.start, True, out)
        if final:
            out.extend(self.cdc.cut(view[pos - base :]))
            return top, False
        return pos, False

    def group_windows(
        self, seg: Segment, read: relayout.ReadInto, window: int | None = None
    ) -> tuple[relayout.GroupReader, Iterator[list[memoryview]]]:
        """A whole group (its bytes read where they lie in the file through ``read``) cut a window
        at a time: the same chunks as ``cut`` gives once the group's bytes are all there (its cuts
        are a grid of positions), without holding the group. Each list of chunks is valid until the
        next is asked for. The reader's ``file_pieces`` gives the group's file bytes once all are cut."""
        reader = relayout.GroupReader(seg, read, window, least=self.max)
        return reader, self._windows(seg, reader)

    def _windows(self, seg: Segment, reader: relayout.GroupReader) -> Iterator[list[memoryview]]:
        assert seg.end is not None
        rows = replace(seg, group=None)
        carry = np.empty(0, np.uint8)  # stored bytes after the last cut, cut with the next window
        pos = seg.start
        for w in range(reader.windows):
            a, b = reader.span(w)
            buf = np.empty(len(carry) + b - a, np.uint8)
            buf[: len(carry)] = carry
            reader.fill(w, buf[len(carry) :])
            out: list[memoryview] = []
            last = w == reader.windows - 1
            end, _ = self._cut_segment(rows, memoryview(buf.data), pos, pos, last, out)
            carry = buf[end - pos :]
            pos = end
            yield out
        assert pos == seg.end and not len(carry), "a group's grid ends at its end"

    def _grid(self, seg: Segment) -> tuple[int, int, int]:
        """(stride, period, shift): a whole number of units near the average, and where the grid
        starts past ``origin`` so that it is counted from token position 0."""
        stride = self._stride(seg.unit)
        if seg.period and seg.period < stride:
            return self._stride(seg.period), 0, 0  # short runs: a whole number of runs per chunk
        units = stride // seg.unit if stride % seg.unit == 0 else 0
        shift = (-seg.phase) % units * seg.unit if units else 0
        return stride, seg.period, shift

    def _stride(self, unit: int) -> int:
        cap = self.max - LEAD
        if self.kind == "relayout" and unit <= SMALL_UNIT:
            return max(1, SMALL_STRIDE // unit) * unit
        if unit > cap:
            return self.avg  # rows larger than a chunk: plain byte stride, still from the first row
        k = max(1, round(self.avg / unit))
        if self.kind == "relayout" and self.cut_version >= 2:
            k = max(min(k, MAX_RECORDS), -(-SMALL_STRIDE // unit))
        while k > 1 and k * unit > cap:
            k -= 1
        return k * unit

    def cut_all(self, data: bytes | memoryview) -> list[memoryview]:
        """The chunks of a whole file."""
        return self.cut(self.initial(), data, final=True)[0]


def _next_cut(seg: Segment, pos: int, stride: int, period: int, shift: int) -> int:
    """The first boundary of ``seg`` after ``pos`` (its end at the latest): ``origin + shift`` plus
    multiples of ``stride``, restarting at every run start when ``period``; never at ``origin``
    itself (a header leads the first chunk)."""
    rel = pos - seg.origin
    run, inside = divmod(rel, period) if period and rel >= 0 else (0, rel)
    first = shift or stride
    off = first if inside < first else shift + ((inside - shift) // stride + 1) * stride
    if period and off >= period:
        off = period  # the next run's start
    c = seg.origin + run * period + off
    return c if seg.end is None else min(c, seg.end)
