"""Reads of relayout files: the stored groups of an open file put back in file order.

``FileGroups`` (one per open file) knows where the groups are (the file record's list, or the
save's own for a file being written; a snapshot saved before records existed is parsed as reads
reach its headers) and starts a ``GroupDecode`` thread per group; ``DecodedGroups`` (one per
store) keeps groups put back lately for the next restore of the same snapshot. A group whose
checksum is known is served only once all of it is in place and its bytes match the checksum.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from functools import partial

from kvchunkfs.file.buffers import BufferPool
from kvchunkfs.file.filesums import FileChecks
from kvchunkfs.file.reader import HandleReader, ReadChunks
from kvchunkfs.format import relayout
from kvchunkfs.format.filerecord import Listed, group_sum
from kvchunkfs.format.index import Index
from kvchunkfs.format.llama_state import Segment, State

log = logging.getLogger(__name__)


LOOKAHEAD = 1 << 20  # a read parses this far past itself to know where the next group starts
FEW_ROWS = 1 << 20  # a read whose rows' records are at most this many bytes needs no decode


def _parsed_to(st: State | None, until: int) -> bool:
    """Whether a layout parsed up to parser state ``st`` lists every group starting before ``until``."""
    return st is None or st.pos >= until


class DecodedGroups:
    """Groups put back lately, by content (their shape and the chunk ids of their range), for any
    open file: a restore soon after another of the same snapshot (the page cache dropped or
    invalidated by a touch) does not put them back again. Bounded by bytes."""

    def __init__(self, capacity: int = 64 << 20) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[bytes, GroupDecode] = OrderedDict()
        self._size = 0
        self._running: dict[bytes, GroupDecode] = {}  # being put back: another open shares it
        self._lock = threading.Lock()

    @staticmethod
    def key(index: Index, g: Segment) -> bytes:
        assert g.end is not None and g.group is not None
        first, last = index.find(g.start), index.find(g.end - 1)
        shape = repr((g.group, g.start, g.end, index.start(first))).encode()  # same place, same shape
        return hashlib.sha256(b"".join([shape, *index.ids[first : last + 1]])).digest()

    def get(self, key: bytes) -> GroupDecode | None:
        """A group put back lately or being put back now."""
        with self._lock:
            d = self._lru.get(key)
            if d is not None:
                self._lru.move_to_end(key)
                return d
            return self._running.get(key)

    def claim(self, key: bytes, d: GroupDecode) -> GroupDecode:
        """The group kept or being put back under ``key``, else ``d``, now registered as putting
        it back: opens of the same snapshot meanwhile share it (llama-server opens a snapshot twice
        in a restore) instead of fetching the group a second time."""
        with self._lock:
            known = self._lru.get(key) or self._running.get(key)
            if known is not None:
                return known
            self._running[key] = d
            return d

    def finished(self, key: bytes, d: GroupDecode) -> None:
        """``d`` is done: kept if it put the whole group back, else forgotten."""
        with self._lock:
            if self._running.get(key) is d:
                del self._running[key]
        if d.error is None and d.unpermute.done:
            self.put(key, d)

    def put(self, key: bytes, d: GroupDecode) -> None:
        n = len(d.unpermute.data)
        if n > self.capacity // 2:
            return
        with self._lock:
            if key in self._lru:
                return
            self._lru[key] = d
            self._size += n
            while self._size > self.capacity:
                _, old = self._lru.popitem(last=False)
                self._size -= len(old.unpermute.data)

    def drop_oldest(self) -> bool:
        """Forget the least recently used group (the buffer pool needs its buffer); False if none."""
        with self._lock:
            if not self._lru:
                return False
            _, old = self._lru.popitem(last=False)
            self._size -= len(old.unpermute.data)
            return True


class GroupDecode:
    """One stored group (chunker relayout) being put back in file order on a thread of its own,
    fed its chunks in order a piece at a time, so readers of its first block follow the fetch."""

    def __init__(self, seg: Segment, buffers: BufferPool | None = None) -> None:
        assert seg.end is not None
        self.seg = seg
        out = buffers.take(seg.end - seg.start) if buffers is not None else None  # a group keeps its range
        self.unpermute = relayout.Unpermute(seg, out)
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.finished = False
        self.sum: bytes | None = None  # of the group in file order, once all of it is in place
        self._reported: set[bytes] = set()  # checksums a mismatch was logged for
        # Cells each waiting reader needs in place: a piece wakes readers only when the fewest
        # needed are there (a restore's reads of a group's first block all wait for nearly every
        # record, and waking each of them at every piece cost more than the decode).
        self._needs: list[int] = []
        self._callbacks: list[tuple[int, Callable[[], None]]] = []  # (cells needed, call when in place)

    def ready(self, off: int, size: int, expect: bytes | None) -> bool:
        """Whether group-relative ``[off, off + size)`` may be served: in place, and with a known
        checksum ``expect`` the whole group in place and matching it."""
        if expect is None:
            return self.unpermute.ready(off, size)
        return self.finished and self.sum == expect

    def when_ready(self, off: int, size: int, callback: Callable[[], None], expect: bytes | None = None) -> bool:
        """Have ``callback`` called (on the decode's thread, once) when group-relative
        ``[off, off + size)`` may be in place or the decode ends; False if it is already either:
        then nothing is called. The caller checks again: a call means "look", not "ready"."""
        with self.cond:
            if self.finished or self.ready(off, size, expect):
                return False
            # A checked group is ready only at the end: never called before.
            need = self.unpermute.cells_for(off, size) if expect is None else self.unpermute.g.cells + 1
            self._callbacks.append((need, callback))
            return True

    def _due(self, everything: bool) -> list[Callable[[], None]]:
        """Call under ``cond``: take the callbacks whose cells are in (all of them at the end)."""
        cells = self.unpermute.cells
        due = [cb for need, cb in self._callbacks if everything or need <= cells]
        if due:
            self._callbacks = [(need, cb) for need, cb in self._callbacks if not (everything or need <= cells)]
        return due

    def run(self, index: Index, reader: ReadChunks) -> None:
        g, u = self.seg, self.unpermute
        assert g.end is not None
        try:
            stream = reader.stream if isinstance(reader, HandleReader) else None  # chunks straight off the packs
            fed = stream is not None
            if fed:
                for piece in stream(index, g.start, g.end):  # type: ignore[misc]
                    fed = u.feed([piece])
                    with self.cond:
                        if self._needs and u.cells >= min(self._needs):
                            self.cond.notify_all()
                        due = self._due(False) if self._callbacks else []
                    for callback in due:
                        callback()
                    if not fed:
                        break
            if not fed or not u.done:  # records wider than a chunk: all at once
                u.set_all(reader(index, g.start, g.end - g.start))
            self.sum = group_sum(u.data)  # before ``finished``: a checked reader looks at it then
        except BaseException as e:
            if not isinstance(e, Exception):
                log.exception("putting a group back failed")
            self.error = e
        finally:
            with self.cond:
                self.finished = True
                self.cond.notify_all()
                due = self._due(True)
            for callback in due:
                callback()

    def wait(
        self, off: int, size: int, expect: bytes | None = None, checks: FileChecks | None = None, name: str = ""
    ) -> memoryview:
        """Group-relative file bytes, once in place (reader threads only: this waits). With a
        known checksum ``expect``: once the whole group is in place and matches it, else EIO."""
        u = self.unpermute
        with self.cond:
            if not (self.ready(off, size, expect) or self.finished):
                need = u.cells_for(off, size) if expect is None else u.g.cells + 1
                self._needs.append(need)
                try:
                    self.cond.wait_for(lambda: self.ready(off, size, expect) or self.finished)
                finally:
                    self._needs.remove(need)
        if self.ready(off, size, expect):
            return u.data[off : off + size]
        if self.error is not None or expect is None or self.sum is None:
            raise self.error or OSError(errno.EIO, "a stored group could not be put back")
        what = f"{name or 'a file'}: the stored group at bytes {self.seg.start}-{self.seg.end}"
        with self.cond:
            first = expect not in self._reported
            self._reported.add(expect)
        if first:
            raise (checks or FileChecks()).mismatch(what)
        raise OSError(errno.EIO, f"{what}: checksum mismatch")


class FileGroups:
    """The stored groups (chunker relayout) of one open file, for its reads: where they are (parsed
    from their headers as reads reach them) and their decodes (one thread per group, the next one
    ahead). The chunks hold a group's bytes permuted; reads get them in file order."""

    def __init__(
        self,
        group_w: int,
        decoded_groups: DecodedGroups | None,
        stopped: Callable[[], bool],
        buffers: BufferPool | None = None,
        decoders: Executor | None = None,
        checks: FileChecks | None = None,
    ) -> None:
        self.group_w = group_w
        self.checks = checks  # counts checksum mismatches
        self.name = ""  # the snapshot's path when it was opened, for log lines
        # The groups of an index known without parsing (its file record, or the save writing it):
        # (index, their segments, checksum by start); replaced whole: the event loop reads it.
        self._given: tuple[Index, tuple[Segment, ...], dict[int, bytes]] | None = None
        self.decoders = decoders  # where decodes run; None: a thread each
        self.decoded_groups = decoded_groups  # shared by the open files of a store (Files)
        self.buffers = buffers  # where groups are put back (shared, reused once unreferenced)
        self._stopped = stopped  # the file's last handle is gone: decode no further ahead
        # (index, its size, its groups parsed so far, the parser's state after them: None when
        # parsed to the end); replaced whole, never changed: the event loop reads it without a lock.
        self._layout: tuple[Index, int, list[Segment], State | None] | None = None
        self._layout_lock = threading.Lock()  # one parse at a time (reader threads only)
        # Groups being put back in file order: (index, {group start: its decode}), copy on write:
        # the event loop reads it without a lock. The lock guards only this bookkeeping.
        self._decodes: tuple[Index, dict[int, GroupDecode]] | None = None
        self._decode_lock = threading.Lock()
        self._reading = -1  # start of the group a reader asked for last
        self._few: set[int] = set()  # groups a read was answered from a few records of, without a decode

    def read_file(
        self, index: Index, offset: int, size: int, read_chunks: ReadChunks, isize: int | None = None
    ) -> bytes | memoryview:
        """The file's bytes ``[offset, offset + size)`` from the chunks of ``index`` (its first
        ``isize`` bytes: the worker may be appending to it), stored groups put back in file order."""
        isize = index.size if isize is None else isize
        end = offset + size
        if self._reading == -1 and offset > 0:
            self._fetch_first_early(index, isize, read_chunks, offset)
        found = self._groups(index, isize, read_chunks, min(isize, end + LOOKAHEAD) if self.group_w else end)
        hit = [g for g in found if g.start < end and offset < (g.end or 0)]
        ahead = self._next_group(found, end)
        if not hit:
            return read_chunks(index, offset, size, ahead)
        parts: list[bytes | memoryview] = []
        pos = offset
        for g in hit:
            assert g.end is not None
            if pos < g.start:
                parts.append(read_chunks(index, pos, g.start - pos, g.start))
                pos = g.start
            stop = min(end, g.end)
            parts.append(self._group_bytes(index, g, read_chunks, pos - g.start, stop - pos))
            pos = stop
        if pos < end:
            parts.append(read_chunks(index, pos, end - pos, ahead))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _fetch_first_early(self, index: Index, isize: int, read_chunks: ReadChunks, offset: int) -> None:
        """A restore's first read past the file's first group (llama-server reads the end first):
        start putting the first group back as soon as its own header is parsed. The headers up to
        the read are parsed one after the other, each a small read of the disk; the first group's
        fetch need not wait for them."""
        if not self.group_w:
            return
        until, early = 1, self._groups(index, isize, read_chunks, 1)  # one section's headers
        while not early and (known := self._layout) is not None and known[3] is not None and known[3].pos < offset:
            until = known[3].pos + 1
            early = self._groups(index, isize, read_chunks, until)
        if early and early[0].end is not None and early[0].end <= offset:
            self._decode(index, early[0], read_chunks)

    def _next_group(self, found: list[Segment], end: int) -> int | None:
        """Where read-ahead past ``end`` must stop: the next stored group's start (its decode reads
        its chunks), where the layout's parse stopped, or None (no group follows)."""
        if not self.group_w:
            return None
        later = [g.start for g in found if g.start >= end]
        if later:
            return min(later)
        known = self._layout
        if known is None or known[3] is None:
            return None  # parsed to the end: no group follows
        return max(end, known[3].pos)  # a group may start where the parse stopped

    def read_ahead_limit(self, index: Index, end: int) -> int | None:
        """``_next_group`` as far as known without reading: the event loop's cached-read shortcut."""
        known = self._layout
        if not self.group_w or known is None or known[0] is not index:
            return None
        return self._next_group(known[2], end)

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
                    return bytes(read_chunks(index, off, n, off + n))  # headers: no read-ahead

                more, st = relayout.groups_until(read, isize, st, until)
                found = found + more
                self._layout = (index, isize, found, st)
            return found

    def _group_bytes(
        self, index: Index, g: Segment, read_chunks: ReadChunks, off: int, size: int
    ) -> bytes | memoryview:
        """Group-relative file bytes ``[off, off + size)`` of ``g``, once its decode (a thread per
        group) has put them in place. When reads reach ``g``, the next group's decode starts too:
        a group is served only once all of it is in place (its first block needs every record),
        and the FUSE thread holds the interpreter lock while it hands a reply to the kernel, so
        fetching the next group while this one is served would be slow. A read of a few rows of a
        group that nobody is putting back is answered from their records alone, unless the group's
        checksum is known: it is served only whole and checked."""
        first_read = self._reading == -1
        expect = self._expected(index, g)
        if expect is None and g.start not in self._few and self._started(index, g) is None:
            rows = self._few_rows(index, g, read_chunks, off, size)
            if rows is not None:
                self._few.add(g.start)  # once: a reader that comes back to the group reads on
                if first_read:
                    self._decode_first(index, g, read_chunks)
                return rows
        d = self._decode(index, g, read_chunks)
        if self._reading != g.start:
            self._reading = g.start
            self._decode_next(index, g, read_chunks)
            if first_read:
                self._decode_first(index, g, read_chunks)
        return d.wait(off, size, expect, self.checks, self.name)

    def _few_rows(self, index: Index, g: Segment, read_chunks: ReadChunks, off: int, size: int) -> bytes | None:
        """The bytes from the records of just the rows they lie in, if those are at most
        ``FEW_ROWS`` stored bytes; else None. llama-server's restore reads the file's last few KiB
        first: without this, it would wait for the whole last group."""
        assert g.group is not None
        where = relayout.rows_of(g.group, off, size)
        if where is None:
            return None
        at, n = where.stored(g.group)
        if n > FEW_ROWS:
            return None
        records = read_chunks(index, g.start + at, n, g.start + at + n)  # no read-ahead past them
        if len(records) != n:
            raise OSError(errno.EIO, f"a stored group is {len(records)} bytes short of its records")
        return relayout.cut_rows(g.group, where, records, size)

    def _started(self, index: Index, g: Segment) -> GroupDecode | None:
        """The decode of ``g`` if one is running or was kept (no new one)."""
        known = self._decodes
        d = known[1].get(g.start) if known is not None and known[0] is index else None
        if d is None and self.decoded_groups is not None:
            d = self.decoded_groups.get(DecodedGroups.key(index, g))
        return d

    def _decode(self, index: Index, g: Segment, read_chunks: ReadChunks) -> GroupDecode:
        """The decode of ``g``, started if needed. Groups before the one before it are dropped (a
        late read of the previous group may still come)."""
        with self._decode_lock:
            known = self._decodes
            decodes = dict(known[1]) if known is not None and known[0] is index else {}
            d = decodes.get(g.start)
            fresh = False
            if d is None:
                key = DecodedGroups.key(index, g) if self.decoded_groups is not None else b""
                d = self.decoded_groups.get(key) if self.decoded_groups is not None else None
                if d is None:  # a new decode, unless another open started one meanwhile
                    new = GroupDecode(g, self.buffers)
                    d = self.decoded_groups.claim(key, new) if self.decoded_groups is not None else new
                    fresh = d is new
                decodes[g.start] = d
                earlier = sorted(start for start in decodes if start < g.start)
                for start in earlier[:-1]:
                    del decodes[start]
                self._decodes = (index, decodes)
        if fresh:
            # A handle's reader: a cursor of its own, so the handle's read-ahead stays where it was.
            reader = read_chunks.detached() if isinstance(read_chunks, HandleReader) else read_chunks
            args = (index, d, reader, key)
            if self.decoders is not None:
                self.decoders.submit(self._run_decode, *args)
            else:
                threading.Thread(target=self._run_decode, args=args, name="group", daemon=True).start()
        return d

    def _run_decode(self, index: Index, d: GroupDecode, reader: ReadChunks, key: bytes) -> None:
        d.run(index, reader)
        if self.decoded_groups is not None:
            self.decoded_groups.finished(key, d)

    def _decode_next(self, index: Index, g: Segment, read_chunks: ReadChunks) -> None:
        """Start the decode of the group after ``g``, if reads are still at ``g``."""
        known = self._layout
        if known is None or known[0] is not index or self._reading != g.start or self._stopped():
            return
        assert g.end is not None
        later = [x for x in self._groups(index, known[1], read_chunks, g.end + 1) if x.start > g.start]
        if later:
            self._decode(index, later[0], read_chunks)

    def _decode_first(self, index: Index, g: Segment, read_chunks: ReadChunks) -> None:
        """A restore's first read reached ``g``, a later group than the file's first: start the
        first's decode. llama-server's restore first reads the file's last few KiB (stdio sizing
        its buffer at the seek to the end), then the header and the rest in order."""
        known = self._layout
        if known is None or known[0] is not index or not known[2] or known[2][0].start >= g.start:
            return
        self._decode(index, known[2][0], read_chunks)

    def close(self) -> None:
        """The file's last handle is gone: let go of its groups at once (the file and this refer
        to each other, so it is freed only by a cycle collection, and the buffers of its groups
        must be free for the next restore as soon as kept groups are let go of)."""
        with self._decode_lock:
            self._decodes = None

    def plain_range(self, index: Index, offset: int, size: int) -> bool:
        """True if the chunks hold ``[offset, offset + size)`` as the file has it (no stored group
        there), as far as known without reading: the event loop's cached-read shortcut."""
        if not self.group_w:
            return True
        known = self._layout
        end = offset + size
        if known is None or known[0] is not index or known[1] != index.size:
            return False
        if not _parsed_to(known[3], end):
            return False  # not parsed that far yet
        return not any(g.start < end and offset < (g.end or 0) for g in known[2])

    def when_ready(self, index: Index, offset: int, size: int, callback: Callable[[], None]) -> bool:
        """``GroupDecode.when_ready`` of the group being put back that holds the range, if reads
        are at that group already (a first read of a group starts the next one's decode: it goes
        the usual way); False if there is none, or it holds the bytes already, or it ended."""
        known = self._decodes
        if known is None or known[0] is not index:
            return False
        for d in known[1].values():
            start, end = d.seg.start, d.seg.end or 0
            if start <= offset and offset + size <= end and self._reading == start:
                return d.when_ready(offset - start, size, callback, self._expected(index, d.seg))
        return False

    def decoded(self, index: Index, offset: int, size: int) -> memoryview | None:
        """The bytes if a group being put back holds all of them in place already (no wait, no
        lock: the event loop calls it)."""
        known = self._decodes
        if known is None or known[0] is not index:
            return None
        for d in known[1].values():
            start, end = d.seg.start, d.seg.end or 0
            if start <= offset and offset + size <= end and d.ready(offset - start, size, self._expected(index, d.seg)):
                return d.unpermute.data[offset - start : offset - start + size]
        return None


def _shifted(read: relayout.ReadAt, base: int, off: int, n: int) -> bytes:
    """``read`` at ``base + off``: a group's stored bytes by their offset in the group."""
    return read(base + off, n)
