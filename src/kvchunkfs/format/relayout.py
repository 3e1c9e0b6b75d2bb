"""Token-major storage of K and V blocks (chunker ``relayout``): the permutation and its inverse.

A llama.cpp state file writes each layer's K rows for every cell, then each layer's V rows (or,
transposed, each dimension's run over every cell). A turn's new cells therefore land at the end of
every block, 2 x n_layer insertion points, and a content-defined cut pays about half a chunk at
each. ``relayout`` stores a ``Group`` of consecutive blocks as their headers followed by one record
per cell (that cell's row of every block in turn), so the group grows only at its end: one
insertion point per group, and transposed V grows like plain V.

The stored stream is a permutation of the file with the same length: a group occupies the same
byte range in both, and everything outside groups is stored as it is. The stream parses like the
file (``llama_state.step`` reads only the first header of a group, which sits at the group's start
in both), so ``groups`` finds the permuted ranges of a stub's stream from the stream alone.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvchunkfs.format import llama_state as ls
from kvchunkfs.format.llama_state import Group, Segment

HEAD = 12  # a K or V block header: i32 type, u64 row size (transposed V: i32 type, u32 el, u32 n)

ReadAt = Callable[[int, int], bytes]
Buffer = bytes | bytearray | memoryview


def _parts(g: Group) -> tuple[int, int]:
    """(bytes of the headers, bytes of one block's rows)."""
    return g.lead + HEAD * g.count, g.cells * g.width


def _block_rows(g: Group, data: np.ndarray) -> np.ndarray:
    """One block's bytes as (cells, width): rows, or a transposed V block's elements per cell."""
    if not g.el:
        return data.reshape(g.cells, g.width)
    return data.reshape(g.width // g.el, g.cells, g.el).transpose(1, 0, 2).reshape(g.cells, g.width)


def to_stream(seg: Segment, src: Buffer) -> bytearray:
    """The stored form of a group's file bytes ``src`` (exactly ``seg.end - seg.start`` bytes)."""
    g = seg.group
    assert g is not None
    heads, body = _parts(g)
    s = np.frombuffer(src, np.uint8)
    out = bytearray(len(s))
    o = np.frombuffer(out, np.uint8)
    records = o[heads:].reshape(g.cells, g.count * g.width)
    at, hp = 0, 0
    for i in range(g.count):
        h = HEAD + (g.lead if i == 0 else 0)
        o[hp : hp + h] = s[at : at + h]
        hp, at = hp + h, at + h
        records[:, i * g.width : (i + 1) * g.width] = _block_rows(g, s[at : at + body])
        at += body
    return out


def to_file(seg: Segment, src: Buffer) -> bytearray:
    """The file bytes of a group from its stored form (the inverse of ``to_stream``)."""
    g = seg.group
    assert g is not None
    heads, body = _parts(g)
    s = np.frombuffer(src, np.uint8)
    out = bytearray(len(s))
    o = np.frombuffer(out, np.uint8)
    records = s[heads:].reshape(g.cells, g.count * g.width)
    at, hp = 0, 0
    for i in range(g.count):
        h = HEAD + (g.lead if i == 0 else 0)
        o[at : at + h] = s[hp : hp + h]
        hp, at = hp + h, at + h
        cols = records[:, i * g.width : (i + 1) * g.width]
        if g.el:  # back to one run per dimension
            cols = cols.reshape(g.cells, g.width // g.el, g.el).transpose(1, 0, 2)
        o[at : at + body] = cols.reshape(-1)
        at += body
    return out


def groups(read: ReadAt, size: int, group_w: int) -> list[Segment]:
    """The groups of a stored stream of ``size`` bytes, read through ``read(offset, n)``: the
    permuted ranges, in order. Walks the headers only (a few bytes a segment, and the cell records),
    as appending does. A group that would pass ``size`` was stored as it is and is not listed."""
    out: list[Segment] = []
    if not group_w:
        return out
    st: ls.State | None = ls.State("file", 0, group_w=group_w)
    while st is not None and st.pos < size:
        plan = ls.plan_at(st, read, size)
        for seg in plan.segments:
            if seg.group is not None and seg.end is not None and seg.end <= size:
                out.append(seg)
        st = plan.next
    return out


def file_bytes(stream: Buffer, group_w: int) -> bytes:
    """A whole file from its whole stored stream (tests, export, offline tools)."""
    view = memoryview(stream)
    found = groups(lambda off, n: bytes(view[off : off + n]), len(view), group_w)
    if not found:
        return bytes(view)
    out = bytearray(view)
    for seg in found:
        assert seg.end is not None
        out[seg.start : seg.end] = to_file(seg, view[seg.start : seg.end])
    return bytes(out)


def containing(found: list[Segment], pos: int) -> Segment | None:
    """The group of ``found`` whose bytes hold ``pos``, if any."""
    for seg in found:
        assert seg.end is not None
        if seg.start <= pos < seg.end:
            return seg
    return None
