"""Where the stored groups of a file's chunks are, and its bytes read back through them.

With chunker relayout the chunks hold some byte ranges of a file (groups) permuted. ``FileGroups``
(one per open file) knows where they are: the file record's list, the save's own for a file being
written, or for a snapshot saved before records parsed from their headers as far as asked. A
restore puts the groups back while it writes the whole file (file/putback.py) and asks only for
the list (``groups_before``); ``read_file`` reads a range back from the chunks, each group it
touches put back whole and checked against its checksum where known (an append, a copy of a file
being written, tools).
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Sequence
from functools import partial

from kvchunkfs.file.filesums import FileChecks
from kvchunkfs.file.reader import ReadChunks
from kvchunkfs.format import relayout
from kvchunkfs.format.filerecord import Listed, group_sum
from kvchunkfs.format.index import Index
from kvchunkfs.format.llama_state import Segment, State


def _parsed_to(st: State | None, until: int) -> bool:
    """Whether a layout parsed up to parser state ``st`` lists every group starting before ``until``."""
    return st is None or st.pos >= until


class FileGroups:
    """The stored groups (chunker relayout) of one open file: where they are, and reads of the
    file's bytes through them."""

    def __init__(self, group_w: int, checks: FileChecks | None = None) -> None:
        self.group_w = group_w
        self.checks = checks  # counts checksum mismatches
        self.name = ""  # the snapshot's path when it was opened, for log lines
        # The groups of an index known without parsing (its file record, or the save writing it):
        # (index, their segments, checksum by start); replaced whole.
        self._given: tuple[Index, tuple[Segment, ...], dict[int, bytes]] | None = None
        # (index, its size, its groups parsed so far, the parser's state after them: None when
        # parsed to the end); replaced whole, never changed.
        self._layout: tuple[Index, int, list[Segment], State | None] | None = None
        self._layout_lock = threading.Lock()  # one parse at a time

    def read_file(
        self, index: Index, offset: int, size: int, read_chunks: ReadChunks, isize: int | None = None
    ) -> bytes | memoryview:
        """The file's bytes ``[offset, offset + size)`` from the chunks of ``index`` (its first
        ``isize`` bytes: the worker may be appending to it), stored groups put back in file order,
        each whole (EIO if its checksum is known and differs)."""
        isize = index.size if isize is None else isize
        end = min(offset + size, isize)
        found = self._groups(index, isize, read_chunks, end)
        hit = [g for g in found if g.start < end and offset < (g.end or 0)]
        if not hit:
            return read_chunks(index, offset, size)
        parts: list[bytes | memoryview] = []
        pos = offset
        for g in hit:
            assert g.end is not None
            if pos < g.start:
                parts.append(read_chunks(index, pos, g.start - pos))
                pos = g.start
            stop = min(end, g.end)
            whole = self._group(index, g, read_chunks)
            parts.append(whole[pos - g.start : stop - g.start])
            pos = stop
        if pos < end:
            parts.append(read_chunks(index, pos, end - pos))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _group(self, index: Index, g: Segment, read_chunks: ReadChunks) -> memoryview:
        """The group's bytes in file order, checked against its checksum where known."""
        assert g.end is not None
        stored = read_chunks(index, g.start, g.end - g.start)
        if len(stored) != g.end - g.start:
            raise OSError(errno.EIO, f"a stored group at {g.start} is {g.end - g.start - len(stored)} bytes short")
        whole = relayout.to_file(g, stored)
        expect = self._expected(index, g)
        if expect is not None and group_sum(whole) != expect:
            what = f"{self.name or 'a file'}: the stored group at bytes {g.start}-{g.end}"
            raise (self.checks or FileChecks()).mismatch(what)
        return whole

    def set_layout(self, index: Index, groups: Sequence[Listed]) -> None:
        """``index``'s stored groups are ``groups`` (all of them, with their checksums): reads of
        it never parse (the file record's list, or a save's own groups as it writes)."""
        segs = tuple(x.seg for x in groups)
        self._given = (index, segs, {x.seg.start: x.sum for x in groups})
        self._layout = (index, index.size, [g for g in segs if (g.end or 0) <= index.size], None)

    def groups_before(self, index: Index, pos: int, read_chunks: ReadChunks) -> list[Segment]:
        """The stored groups of ``index`` that end by ``pos`` (given, or parsed that far)."""
        return [g for g in self._groups(index, index.size, read_chunks, pos) if (g.end or 0) <= pos]

    def header_reader(self, index: Index, read_chunks: ReadChunks) -> relayout.ReadAt:
        """Reads for the parser (an append's ``Cutter.resume``): the file's bytes. With the groups
        given, bytes inside a group come from just the stored bytes they lie in (its headers, the
        records of the first rows a look-ahead reaches: ``relayout.file_range``), not from the whole
        group put back. A snapshot from before records is parsed from its stored bytes, as its
        reads are."""
        given = self._given
        if given is None or given[0] is not index:
            return lambda off, n: bytes(read_chunks(index, off, n, off + n))
        found = given[1]

        def stored(off: int, n: int) -> bytes:
            return bytes(read_chunks(index, off, n, off + n))

        def read(off: int, n: int) -> bytes:
            end, out, pos = min(off + n, index.size), bytearray(), off
            for g in found:
                if g.end is None or g.end <= pos or g.group is None:
                    continue
                if g.start >= end:
                    break
                if pos < g.start:
                    out += stored(pos, g.start - pos)
                    pos = g.start
                stop = min(end, g.end)
                part = relayout.file_range(g.group, partial(_shifted, stored, g.start), pos - g.start, stop - pos)
                out += part if part is not None else self.read_file(index, pos, stop - pos, read_chunks)
                pos = stop
            if pos < end:
                out += stored(pos, end - pos)
            return bytes(out)

        return read

    def _expected(self, index: Index, g: Segment) -> bytes | None:
        """The checksum ``g``'s bytes must have (None: not known, a snapshot from before records)."""
        given = self._given
        return given[2].get(g.start) if given is not None and given[0] is index else None

    def _groups(self, index: Index, isize: int, read_chunks: ReadChunks, until: int) -> list[Segment]:
        """The stored groups in ``index``'s first ``isize`` bytes, at least those that start
        before ``until``: given (``set_layout``), or parsed from their headers once per index and
        size, only as far as reads have reached (a restore's first read waits for the file's first
        chunk, not for the headers of every group)."""
        if not self.group_w or not isize:
            return []
        given = self._given
        if given is not None and given[0] is index:
            known = self._layout
            if known is not None and known[0] is index and known[1] == isize and known[3] is None:
                return known[2]
            found = [g for g in given[1] if (g.end or 0) <= isize]
            self._layout = (index, isize, found, None)
            return found
        known = self._layout
        if known is not None and known[0] is index and known[1] == isize and _parsed_to(known[3], until):
            return known[2]
        with self._layout_lock:
            known = self._layout
            if known is not None and known[0] is index and known[1] == isize:
                found, st = known[2], known[3]
            else:
                found, st = [], relayout.start_state(self.group_w)
            if not _parsed_to(st, until):

                def read(off: int, n: int) -> bytes:
                    return bytes(read_chunks(index, off, n, off + n))  # headers: a few bytes

                more, st = relayout.groups_until(read, isize, st, until)
                found = found + more
                self._layout = (index, isize, found, st)
            return found


def _shifted(read: relayout.ReadAt, base: int, off: int, n: int) -> bytes:
    """``read`` at ``base + off``: a group's stored bytes by their offset in the group."""
    return read(base + off, n)
