"""The content of an open file: clean, streaming, or staged.

``FileContent`` is shared by every handle of one file and knows nothing of FUSE.

* CLEAN   – the content is the stub's index; nothing to save.
* STREAM  – bytes arrive at the end of the file. They are queued in ``buf`` and the file's worker
            cuts them into chunks while the client is still writing; only chunks the store lacks
            are appended to a pack. Bytes whose boundary is not final yet stay tentative (``tail``,
            cut from ``cut_state``) until a commit, so later appends continue the chunk list
            exactly as chunking the whole file would.
* STAGING – anything else (a write behind the end, a hole, a shrinking truncate) copies the
            content into a plain file under ``staging/``; it is chunked in one pass at commit.

The worker is not a thread: each batch is one *turn* run by a shared ``ChunkPool`` (a bounded set
of threads). A file has at most one turn queued or running (``_scheduled``), so its steps stay in
order; a turn that leaves more work queues the next one behind other files' turns (file/queues.py).
Reads of the chunks of a file being streamed put stored groups back through ``FileGroups`` (file/groups.py).

Content in STREAM mode is ``index`` chunks, then ``inflight`` (bytes the worker is cutting), then
``tail``, then ``buf``, then ``ahead`` (writes that arrived a little early, keyed by offset).

The file record (format/filerecord.py) is built as the bytes become chunks (``SaveSums``): the
checksum of the file's bytes and the groups stored permuted. At commit the stored form is checked
to parse to those groups; a file whose form does not is stored again in file order
(``_store_file_order``). A snapshot's record is checked wherever this content puts the whole file
back (a staged copy, an append that reads it back).
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import xxhash

from kvchunkfs.file import sparse
from kvchunkfs.file.buffers import BufferPool
from kvchunkfs.file.filesums import FileChecks, Mark, Resumes, SaveSums
from kvchunkfs.file.groups import FileGroups
from kvchunkfs.file.hashing import chunk_ids
from kvchunkfs.file.predict import START, Pieces, Successors, cut_batch
from kvchunkfs.file.queues import ByteQueue, ChunkPool
from kvchunkfs.file.reader import ReadChunks
from kvchunkfs.format import relayout
from kvchunkfs.format.chunker import BATCH, StreamChunker, chunk_id
from kvchunkfs.format.cutter import CutState, Cutter
from kvchunkfs.format.filerecord import FileRecord, Form, Listed, file_hasher, group_sum, same_groups
from kvchunkfs.format.filerecord import make as make_record
from kvchunkfs.format.index import Index
from kvchunkfs.format.llama_state import Segment
from kvchunkfs.store.chunkstore import ChunkStore
from kvchunkfs.store.packs import Location
from kvchunkfs.store.stubs import Staged
from kvchunkfs.store.wholefiles import WholeFiles

log = logging.getLogger(__name__)

MAX_BACKLOG = 64 << 20  # queued bytes per file before a writer waits for the chunker
# ... when the bytes come from a plain file (ingestion): reading it again costs a memory copy, so
# little is queued (memory: this, a batch taken and its joined copy)
SOURCE_BACKLOG = 8 << 20
AHEAD_WINDOW = 16 << 20  # how far past the end an early write may land and still stream
PAGE = 4096


def _pread_into(fd: int, off: int, out: memoryview) -> None:
    """Fill ``out`` with ``fd``'s bytes at ``off``; EIO if the file is shorter."""
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], off + done)
        if n <= 0:
            raise OSError(errno.EIO, f"the file ended {len(out) - done} bytes early at {off + done}")
        done += n


def _extents(fd: int) -> Iterator[bytes | int]:
    """The file's bytes in order: data in pieces of at most BATCH, a hole as its length in zeros."""
    size = os.fstat(fd).st_size
    pos = 0
    while pos < size:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            data = size  # only a hole up to the end
        if data > pos:
            yield min(data, size) - pos
            pos = data
            continue
        hole = min(os.lseek(fd, pos, os.SEEK_HOLE), size)
        while pos < hole:
            piece = os.pread(fd, min(BATCH, hole - pos), pos)
            if not piece:
                return  # truncated under us: a later commit sees the change
            yield piece
            pos += len(piece)


def _copy_file(src: int, dst: int, keep: int | None) -> int:
    """Copy ``src``'s first ``keep`` bytes (None: all) to the empty ``dst``; the bytes copied.
    copy_file_range: no bytes through Python (a reflink where the file system has them)."""
    size = os.fstat(src).st_size if keep is None else min(keep, os.fstat(src).st_size)
    pos = 0
    while pos < size:  # data only: a hole stays a hole (a sparse file is not copied as its zeros)
        try:
            pos = os.lseek(src, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            break  # only a hole up to the end
        end = min(os.lseek(src, pos, os.SEEK_HOLE), size)
        while pos < end:
            n = os.copy_file_range(src, dst, end - pos, pos, pos)
            if n == 0:
                break  # shorter meanwhile
            pos += n
        if pos < end:
            break
    os.ftruncate(dst, size if keep is None else keep)
    return size


class Mode(enum.Enum):
    CLEAN = "clean"
    STREAM = "stream"
    STAGING = "staging"


class Action(enum.Enum):
    DIRECT = "direct"  # call write() now
    START_STREAM = "start_stream"  # call start_stream() in a thread, then write()
    TO_STAGING = "to_staging"  # call to_staging() in a thread, then write()


class FileContent:
    def __init__(
        self,
        store: ChunkStore,
        chunker: Cutter,
        index: Index,
        staging_dir: Path,
        read_chunks: ReadChunks,
        pool: ChunkPool,
        keep_partial_page: bool = False,
        max_size: int = 1 << 62,
        successors: Successors | None = None,
        buffers: BufferPool | None = None,
        checks: FileChecks | None = None,
        resumes: Resumes | None = None,
        whole: WholeFiles | None = None,
    ) -> None:
        self.store = store
        self.chunker = chunker
        self.index = index
        self.staging_dir = staging_dir
        self.read_chunks = read_chunks
        self.pool = pool
        # With the kernel's writeback cache a file's last partial page is written again, whole,
        # once the client fills it; keeping it queued avoids a staging copy. Without it, nothing
        # rewrites bytes already sent, so the worker takes everything.
        self.keep_partial_page = keep_partial_page
        self.max_size = max_size
        self.successors = successors  # None: cut every byte (``predict_chunks`` off)
        # Chunker relayout: the chunks hold some byte ranges (groups) permuted; reads put them back.
        self.checks = checks if checks is not None else FileChecks()
        self.resumes = resumes  # where a save leaves its checksum's marks for an append (Files)
        self.groups = FileGroups(chunker.group_w, self.checks)
        # The loaded snapshot's file record and the index object it describes (None: none, or
        # the content changed since).
        self.record: FileRecord | None = None
        self._record_index: Index | None = None
        self.buffers = buffers  # large joins of a save's batch go there (reused once unreferenced)
        self.hook: Callable[[str], None] | None = None  # tests: called at the worker's steps
        # Where the loaded index's chunks were when it was opened (may go stale: readers re-locate).
        self.locations: dict[bytes, Location] | None = None
        self.all_local = False  # the map had every chunk at load (else the shared tier may have them)
        # The SHA-256 of the stub's bytes and the map's drop generation it was loaded from; None once changed.
        self.loaded_from: tuple[bytes, int] | None = None
        self.mode = Mode.CLEAN
        self.cond = threading.Condition()
        self.gen = 0  # bumped by every change; a commit clears ``dirty`` only if unchanged
        self.dirty = False
        self.error: OSError | None = None  # the worker's failure, raised by the next call
        self.bytes_new = 0  # bytes this file added to the store
        self._reported_new = 0
        self.epoch = 0  # worker results from an older epoch are dropped
        # Ingestion: the plain file the streamed bytes come from (``read_from``), read where a
        # group lies instead of gathering the group from the queue; -1: none.
        self.source_fd = -1
        self.source_size = 0
        self.backlog = MAX_BACKLOG  # queued bytes before a writer waits
        self._reset_stream(index, b"")
        self.staging_fd = -1
        self.staging_path: Path | None = None
        # Whole-file mode (a mounted store): the content is a plain file under ``whole`` from its
        # first write on (a staged file the kernel may write directly: no stream); ``shared``: that
        # file is not this content's to change (a hot copy, a save handed to ingestion), so the
        # next write or truncate copies it first.
        self.whole = whole
        self.shared = False
        self.staged: Staged | None = None  # the stub's staged save when loaded (Files sets it)
        self.source: str | None = None  # where a restore found the bytes (Files: log lines)
        # A whole file on the store's disk (a snapshot too big for the memory tier): read in a
        # worker thread, never on the event loop; the callback runs at close.
        self.on_disk: Callable[[], None] | None = None
        self._retired_fds: list[int] = []
        self._active = False  # the worker is started and has not yet seen ``_stop``
        self._scheduled = False  # a turn of this file is queued or running in the pool
        self._stop = False
        self._drain = False
        store.pin_index(self, index)

    # -- state ------------------------------------------------------------------------------

    def _reset_stream(
        self, index: Index, tail: bytes, cut_state: CutState | None = None, sums: SaveSums | None = None
    ) -> None:
        self.index = index
        self.sums = sums if sums is not None else SaveSums()  # of the index's bytes, if it is new
        if self.sums.size == index.size:  # the groups are known: reads never parse them
            self.groups.set_layout(index, self.sums.groups)
        self.tail = tail
        self.cut_state = cut_state or self.chunker.initial()  # the cutter at the tail's first byte
        self.inflight: list[bytes | bytearray | memoryview] | None = None
        self.buf = ByteQueue()
        self.ahead: dict[int, bytes] = {}
        self.end = index.size + len(tail)  # end of the contiguous content
        self._skip_to = 0  # writes before this offset are dropped: a group cut from the source holds them
        self.epoch += 1

    @property
    def size(self) -> int:
        if self.mode is Mode.STAGING:
            return os.fstat(self.staging_fd).st_size
        if self.ahead:
            return max(self.end, max(off + len(d) for off, d in self.ahead.items()))
        return self.end

    def _changed(self) -> None:
        self.gen += 1
        self.dirty = True
        self.loaded_from = None  # no longer the stub's content, even once saved

    def use_record(self, record: FileRecord | None, name: str) -> None:
        """The loaded snapshot's file record (None: it has none) and path (for log lines): reads
        take its groups from it and check them, a whole-file copy checks its checksum."""
        with self.cond:
            self.record, self._record_index = record, self.index
            self.groups.name = name
            if record is not None and record.form.groups_given:
                self.groups.set_layout(self.index, record.groups)

    def _loaded_record(self) -> FileRecord | None:
        """Under ``cond``: the record if the index is still the one it describes."""
        if self.record is not None and self._record_index is self.index and self.mode is Mode.CLEAN:
            return self.record
        return None

    # -- writing ----------------------------------------------------------------------------

    def read_from(self, fd: int, size: int) -> None:
        """The bytes to be streamed are the plain file ``fd``'s first ``size`` (ingestion's staged
        file, which nothing changes meanwhile): a group is cut from it a window at a time
        (``Cutter.group_windows``), not gathered whole from the queue, and the writer may skip the
        group's bytes (``skip_to``). Before the first write."""
        with self.cond:
            self.source_fd, self.source_size = fd, size
            self.backlog = SOURCE_BACKLOG

    @property
    def skip_to(self) -> int:
        """Writes before this offset are not needed (read from the source by the chunker)."""
        return self._skip_to

    def _check_size(self, size: int) -> None:
        if size > self.max_size:
            raise OSError(errno.EFBIG, f"file would be {size} bytes, max_file_size is {self.max_size}")

    def plan_write(self, offset: int, length: int) -> Action:
        self._check_size(offset + length)
        with self.cond:
            if self.error:
                raise self.error
            if self.mode is Mode.STAGING:
                return Action.TO_STAGING if self.shared else Action.DIRECT
            if self.whole is not None:
                return Action.TO_STAGING
            if self.mode is Mode.CLEAN:
                # Appends, including the kernel rewriting the last partial page, continue the chunk list.
                last = len(self.index) - 1
                ok = self.index.start(max(last, 0)) <= offset <= self.index.size
                return Action.START_STREAM if ok else Action.TO_STAGING
            if offset < self._skip_to:
                return Action.DIRECT  # (up to ``skip_to``) already cut from the source: dropped
            if self._overlaps_ahead(offset, length):
                return Action.TO_STAGING
            if self._patchable_from() <= offset <= self.end + AHEAD_WINDOW:
                return Action.DIRECT  # append, patch bytes not yet chunked, or arrive a little early
            return Action.TO_STAGING

    def _patchable_from(self) -> int:
        """Bytes from here on are not final chunks yet and may still be overwritten in place."""
        return self.end - len(self.buf) if self.inflight is not None else self.index.size

    def _overlaps_ahead(self, offset: int, length: int) -> bool:
        return any(offset < o + len(d) and o < offset + length for o, d in self.ahead.items())

    def start_stream(self) -> None:
        """CLEAN -> STREAM: the last chunk becomes the tentative tail (read once, not re-chunked);
        the cutter resumes at its first byte (a format-aware cutter re-reads the file's headers)."""
        with self.cond:
            if self.mode is not Mode.CLEAN:
                return
            loaded = self.index  # never appended to in CLEAN mode; its groups are known by identity
            base = loaded.copy()
            record = self._loaded_record()
        last_chunk = b""
        state = None
        sums = SaveSums()
        if len(base):
            read = self.read_chunks
            parse = self.groups.header_reader(loaded, read)
            state = self.chunker.resume(parse, loaded.size, base.start(len(base) - 1))
            if record is not None and any(x.seg.start < state.pos < (x.seg.end or 0) for x in record.groups):
                raise self.checks.mismatch(f"{self.groups.name or 'a file'}: an append resuming inside a stored group")
            # The last chunk, or from the start of the stored group that holds it (cut whole).
            last_chunk = bytes(self.groups.read_file(loaded, state.pos, loaded.size - state.pos, read))
            sums = self._base_sums(loaded, state.pos, last_chunk, record)
            while base.size > state.pos:
                base.pop()
            assert base.size == state.pos
        with self.cond:
            if self.mode is Mode.CLEAN:
                self._reset_stream(base, b"", state, sums)
                self.buf.append(last_chunk)
                self.end += len(last_chunk)
                self.mode = Mode.STREAM
                self._start_worker()

    def _base_sums(self, loaded: Index, pos: int, rest: bytes, record: FileRecord | None) -> SaveSums:
        """The sums of ``loaded``'s first ``pos`` bytes, which an append keeps as chunks (``rest``:
        the bytes from there to the end, read already). A file this daemon saved lately continues
        from the checksum's mark before ``pos`` (a few bytes read); otherwise the bytes are read
        back, and then the whole file's checksum is checked."""
        sums: list[bytes] | None = None  # checksums of parsed groups, computed here
        if record is not None and record.form.groups_given:
            listed = [x for x in record.groups if (x.seg.end or 0) <= pos]
            mark = self.resumes.before(record.file_sum, pos) if self.resumes is not None else None
            if mark is not None:
                at, hasher = mark
                for piece in self._file_pieces(loaded, at, pos, []):
                    hasher.update(piece)
                return SaveSums(pos, hasher, listed)
            segs = [x.seg for x in listed]
        else:  # a snapshot from before records (or too many groups to list): parsed, summed here
            segs = self.groups.groups_before(loaded, pos, self.read_chunks)
            sums = []
        hasher = file_hasher()
        for piece in self._file_pieces(loaded, 0, pos, segs, sums):
            hasher.update(piece)
        if sums is not None:
            listed = [Listed(g, x) for g, x in zip(segs, sums, strict=True)]
        if record is not None:
            whole = hasher.copy()
            whole.update(rest)
            if whole.digest() != record.file_sum:
                raise self.checks.mismatch(f"{self.groups.name or 'a file'}: the whole file read back for an append")
        return SaveSums(pos, hasher, listed)

    def _file_pieces(
        self, index: Index, start: int, end: int, groups: list[Segment], sums: list[bytes] | None = None
    ) -> Iterator[bytes | memoryview]:
        """The file's bytes ``[start, end)`` of ``index`` in order, at most a batch or a whole group
        at a time (read through this content's groups); ``sums``: each of ``groups`` (whole, inside
        the range) has its checksum appended there."""
        pos = start
        marks = sorted({x for g in groups for x in (g.start, g.end or 0) if start < x < end})
        for stop in [*marks, end]:
            while pos < stop:
                n = min(BATCH, stop - pos)
                inside = next((g for g in groups if g.start == pos and g.end == stop), None)
                if inside is not None:
                    n = stop - pos
                piece = self.groups.read_file(index, pos, n, self.read_chunks)
                if len(piece) != n:
                    raise OSError(errno.EIO, f"a snapshot is {n - len(piece)} bytes short at {pos}")
                if inside is not None and sums is not None:
                    sums.append(group_sum(piece))
                yield piece
                pos += n

    def write(self, offset: int, data: bytes | memoryview) -> bool:
        """Apply a write planned as DIRECT; False if the worker took the bytes it patches meanwhile.
        ``data`` may be a view of the caller's buffer: a plain file is written from it, and only the
        bytes queued for the chunker are copied (they outlive the call)."""
        with self.cond:
            if self.error:
                raise self.error
            if self.mode is not Mode.STAGING:
                return self._queue(offset, data)
            self._changed()
            fd = self.staging_fd
        # Outside the lock, so a reader's pread on a worker thread never holds up the FUSE thread.
        # The fd stays open until close() (see _close_staging), and writes of one file are ordered
        # by the FUSE layer.
        os.pwrite(fd, data, offset)
        return True

    def _queue(self, offset: int, data: bytes | memoryview) -> bool:
        """STREAM or CLEAN mode, under ``cond``: queue bytes for the chunker (a copy, if a view)."""
        if self.mode is Mode.STREAM and offset < self._skip_to:  # cut from the source: not needed
            cut = min(len(data), self._skip_to - offset)
            data, offset = data[cut:], offset + cut
            if not data:
                return True
        if self.mode is not Mode.STREAM or offset < self._patchable_from():
            return False
        if offset < self.end - len(self.buf):  # rewriting the tentative tail: requeue it
            self.buf.prepend(self.tail)
            self.tail = b""
        start = self.end - len(self.buf)
        self._changed()
        data = bytes(data)  # kept until chunked (no copy of what is bytes already)
        if offset > self.end:
            self.ahead[offset] = data
            return True
        if offset == self.end:
            self.buf.append(data)
        else:
            self.buf.patch(offset - start, data)
        self.end = start + len(self.buf)
        while self.end in self.ahead:
            piece = self.ahead.pop(self.end)
            self.buf.append(piece)
            self.end += len(piece)
        if len(self.buf) >= BATCH:
            self._kick()
        return True

    def backlogged(self) -> bool:
        return self.mode is Mode.STREAM and len(self.buf) > self.backlog

    def wait_backlog(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: len(self.buf) <= self.backlog // 2 or self.error or self.mode is not Mode.STREAM)

    def truncate(self, length: int) -> Action:
        """Truncate to ``length``; returns TO_STAGING if a staged copy is needed first."""
        self._check_size(length)
        with self.cond:
            if self.error:
                raise self.error
            if self.whole is not None or self.mode is Mode.STAGING:
                if self.mode is not Mode.STAGING or self.shared:
                    return Action.TO_STAGING  # a file of its own first (``to_staging(length)``)
                if length != self.size:
                    os.ftruncate(self.staging_fd, length)
                self._changed()
                return Action.DIRECT
            if length == 0:
                self._close_staging()
                self._reset_stream(Index(self.chunker.min, self.chunker.avg, self.chunker.max), b"")
                self.mode = Mode.STREAM
                self._start_worker()
                self._changed()
                return Action.DIRECT
            if length == self.size:
                return Action.DIRECT
            if self.mode is Mode.STAGING:
                os.ftruncate(self.staging_fd, length)
                self._changed()
                return Action.DIRECT
            return Action.TO_STAGING

    # -- staging ----------------------------------------------------------------------------

    def use_whole(self, fd: int, path: Path | None, on_disk: Callable[[], None] | None = None) -> None:
        """The content is the plain file ``fd``: this content's own (``path``: deleted at close)
        or shared (None: a hot copy, a staged save, a put-back on disk; copied before any change).
        ``on_disk``: ``fd`` is an anonymous file on disk, this is called at close. Before any handle."""
        with self.cond:
            self.staging_fd, self.staging_path = fd, path
            self.shared = path is None
            self.mode = Mode.STAGING
            self.on_disk = on_disk

    def snapshot(self) -> tuple[Index, FileRecord | None, dict[bytes, Location] | None]:
        """The loaded snapshot: its index, its file record (None: none, or changed since) and
        where its chunks were at load (a put-back reads them: file/restore.py)."""
        with self.cond:
            return self.index, self._loaded_record(), self.locations

    def whole_fd(self) -> int:
        """The whole file the content is (-1: none)."""
        with self.cond:
            return self.staging_fd if self.mode is Mode.STAGING else -1

    def whole_mtime(self) -> int:
        """The whole file's modification time in ns (-1: none): it moves with writes the kernel
        makes to it directly."""
        fd = self.whole_fd()
        return os.fstat(fd).st_mtime_ns if fd >= 0 else -1

    def mark_changed(self) -> None:
        """Count the content as changed (a handle that may write it without telling us)."""
        with self.cond:
            self._changed()

    def own_file(self) -> bool:
        """Whether the content is a plain file this content may change (a handle may write it directly)."""
        with self.cond:
            return self.mode is Mode.STAGING and not self.shared

    def seal(self, copy: bool) -> tuple[Path, int, int]:
        """A save of the content as it is: its staged file (path, size, generation) handed to the
        caller (ingestion), the content keeping it open read-only; with ``copy`` (other writers
        still have the file open) a copy of it instead. Blocking: a copy runs in a worker thread."""
        assert self.whole is not None
        with self.cond:
            if self.mode is not Mode.STAGING or self.shared or self.staging_path is None:
                raise OSError(errno.EIO, "nothing staged to save")
            gen, fd, path = self.gen, self.staging_fd, self.staging_path
            if not copy:
                self.staging_path, self.shared = None, True
                return path, os.fstat(fd).st_size, gen
        new, out = self.whole.new_staged()
        try:
            size = _copy_file(fd, out, None)
        except BaseException:
            os.close(out)
            self.whole.drop_staged(new)
            raise
        os.close(out)
        return new, size, gen

    def to_staging(self, keep: int | None = None) -> None:
        """Copy the content (its first ``keep`` bytes: a truncate) into a staging file of its own
        (blocking; run in a thread)."""
        with self.cond:
            if self.mode is Mode.STAGING and not self.shared:
                return
            if self.mode is Mode.STAGING:  # a shared whole file: copied as it is
                source = self.staging_fd
            else:
                source = -1
        if source >= 0:
            self._copy_whole(source, keep)
            return
        with self.cond:
            if self.mode is Mode.STAGING:
                return
            # The index itself (its groups are known by identity); the worker only appends to it.
            index, isize, pending, ahead = self.index, self.index.size, self._pending(), dict(self.ahead)
            size = self.size
            record = self._loaded_record()
        if self.whole is not None:
            # Only its data takes room (its zeros stay holes): there before the first byte is copied.
            self.whole.reserve(sparse.data_bytes(index) + len(pending) + sum(map(len, ahead.values())))
            path, fd = self.whole.new_staged()
        else:
            path = self.staging_dir / f"{uuid.uuid4().hex}.staging"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if keep is not None:
            isize = min(isize, keep)
            size = min(size, keep)
            record = None  # part of the file: each group read is still checked whole
        try:
            pos = 0
            hasher = file_hasher() if record is not None else None  # the whole snapshot is copied
            while pos < isize:
                n = min(BATCH, isize - pos)
                piece = self.groups.read_file(index, pos, n, self.read_chunks, isize)
                if hasher is not None:
                    hasher.update(piece)
                sparse.write_nonzero(fd, piece, pos)
                pos += n
            if record is not None and hasher is not None and hasher.digest() != record.file_sum:
                raise self.checks.mismatch(f"{self.groups.name or 'a file'}: the whole file copied for a rewrite")
            if keep is None:
                os.pwrite(fd, pending, isize)
                for off, data in ahead.items():
                    os.pwrite(fd, data, off)
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self._staged(fd, path)

    def _copy_whole(self, source: int, keep: int | None) -> None:
        """A shared whole file -> a staged copy of this content's own."""
        assert self.whole is not None
        self.whole.reserve(os.fstat(source).st_blocks * 512)  # its data (a hole takes no room)
        path, fd = self.whole.new_staged()
        try:
            _copy_file(source, fd, keep)
        except BaseException:
            os.close(fd)
            self.whole.drop_staged(path)
            raise
        with self.cond:
            old = self.staging_fd
        self._retired_fds.append(old)  # a read on a worker thread may still use it: closed at close()
        self._staged(fd, path)

    def _staged(self, fd: int, path: Path) -> None:
        with self.cond:
            self.staging_fd, self.staging_path = fd, path
            self.shared = False
            self.mode = Mode.STAGING
            self.epoch += 1
            self._stop = True
            self._kick()
            self.cond.notify_all()

    def _close_staging(self, final: bool = False) -> None:
        """Drop the staged copy. Its fd is closed only at ``close()`` (``final``): a read on a worker
        thread may still be using it, and a closed fd number can be reused by any other open."""
        if self.staging_fd >= 0:
            self._retired_fds.append(self.staging_fd)
            self.staging_fd = -1
        if final:
            for fd in self._retired_fds:
                os.close(fd)
            self._retired_fds.clear()
        if self.staging_path is not None:
            try:
                os.unlink(self.staging_path)
            except FileNotFoundError:
                pass
            self.staging_path = None

    def _pending(self) -> bytes:
        return b"".join((*(self.inflight or ()), self.tail, self.buf.join()))

    # -- reading ----------------------------------------------------------------------------

    def read(self, offset: int, size: int, read_chunks: ReadChunks) -> bytes | memoryview:
        """The content's bytes: its whole file's, or (a content with none: a file being streamed
        to the chunker, an offline tool's) its chunks' then what is queued. Blocking."""
        with self.cond:
            staging_fd = self.staging_fd if self.mode is Mode.STAGING else -1
            # The worker appends to ``index`` concurrently; its first ``isize`` bytes never change.
            index, isize = self.index, self.index.size
            if self.mode is Mode.STREAM:
                pending, ahead, total = self._pending(), dict(self.ahead), self.size
            else:
                pending, ahead, total = b"", {}, isize
        if staging_fd < 0 and self.source_fd >= 0:  # ingestion: the source has every byte
            staging_fd, size = self.source_fd, max(0, min(size, self.source_size - offset))
        if staging_fd >= 0:  # outside the lock, as in write()
            return os.pread(staging_fd, size, offset)
        end = min(offset + size, total)
        if offset >= end:
            return b""
        if end <= isize:  # all in chunks
            return self.groups.read_file(index, offset, end - offset, read_chunks, isize)
        out = bytearray()
        if offset < isize:
            out += self.groups.read_file(index, offset, min(end, isize) - offset, read_chunks, isize)
        lo = max(offset, isize)
        if lo < end:  # after the chunks: pending bytes, then zeros, with early writes laid over them
            seg = bytearray(end - lo)
            part = pending[lo - isize : end - isize]
            seg[: len(part)] = part
            for off, data in ahead.items():
                a, b = max(off, lo), min(off + len(data), end)
                if a < b:
                    seg[a - lo : b - lo] = data[a - off : b - off]
            out += seg
        return bytes(out)

    @property
    def _alloc(self) -> Callable[[int], np.ndarray] | None:
        pool = self.buffers
        return (lambda n: pool.take(n, brief=True)) if pool is not None else None  # joins: given back at once

    # -- the chunking worker ----------------------------------------------------------------

    def _start_worker(self) -> None:
        """Call under ``cond``. A turn that has not yet seen ``_stop`` simply carries on; one that
        has clears ``_active`` under the same lock, so exactly one worker is active."""
        self._stop = False
        self._active = True
        self._kick()

    def _kick(self) -> None:
        """Call under ``cond``: queue this file's next turn if it has work and none is queued."""
        if self._active and not self._scheduled and self._work_ready():
            self._scheduled = True
            try:
                self.pool.submit(self._turn)
            except RuntimeError:  # the pool is shut down: the daemon is exiting
                self._scheduled = self._active = False

    def wait_worker(self) -> None:
        """Until no turn of this file is queued or running (tests, after a stop)."""
        with self.cond:
            self.cond.wait_for(lambda: not self._scheduled)

    def _store_failed(self, e: OSError) -> bool:
        """Storing a batch's chunks failed: the save ends with ``e`` (its writers are woken); False."""
        log.error("saving chunks failed: %s", e)
        with self.cond:
            self.error = e
            self.inflight = None
            self._active = False
            self.cond.notify_all()
        return False

    def _step(self, point: str) -> None:
        """Test hook: ``idle`` (no more work for now), ``ready``, ``taken``, ``stored``, ``exit``."""
        if self.hook is not None:
            self.hook(point)

    def _turn(self) -> None:
        """One batch on a pool thread; then the next turn is queued if work is waiting."""
        try:
            more = self._run_once()
        except BaseException as e:  # never die silently: a commit waiting on us must see the error
            log.exception("chunker worker failed")
            with self.cond:
                self.error = e if isinstance(e, OSError) else OSError(errno.EIO, f"chunker failed: {e!r}")
                self.inflight = None
                self._active = False
            more = False
        if more:
            with self.cond:
                idle = not self._work_ready()
            if idle:  # before ``_scheduled`` clears, so a next turn's steps come after it
                self._step("idle")
        with self.cond:
            self._scheduled = False
            self._kick()
            self.cond.notify_all()

    def _draining(self) -> bool:
        return self._drain  # read without ``cond``: a stale answer costs one more step on one core

    def _work_ready(self) -> bool:
        if self._stop or (self._drain and bool(self.buf)):
            return True
        if self._source_group() is not None:
            return True
        if len(self.buf) < BATCH:
            return False
        # A group (chunker relayout) is cut once whole: until its last byte is queued a turn would
        # only copy it again, unless the writer is held back by the backlog.
        return self.end >= self.cut_state.waits_for or len(self.buf) > self.backlog // 2

    def _source_group(self) -> Segment | None:
        """Under ``cond``: the group the cutter is at the start of, if it can be cut from the
        source (ingestion) and no turn is under way."""
        segs = self.cut_state.segments
        if self.source_fd < 0 or self.inflight is not None or not segs or segs[0].group is None:
            return None
        return segs[0] if segs[0].start == self.cut_state.pos else None

    def _run_once(self) -> bool:
        """One batch: take queued bytes, cut and store them; False when the worker should stop."""
        with self.cond:
            stop, ready = self._stop, self._work_ready()
            group = self._source_group()
            if stop:
                self._active = False
        if stop:
            self._step("exit")
            return False
        if not ready:  # a truncate emptied the queue since the turn was queued
            return True
        if group is not None:
            return self._source_turn(group)
        self._step("ready")
        with self.cond:
            stop = self._stop
            if stop:
                self._active = False
            else:
                epoch = self.epoch
                self.buf.prepend(self.tail)
                keep = self.end % PAGE if self.keep_partial_page and not self._drain else 0
                taken = self.buf.take(keep=keep)
                self.inflight, self.tail = taken, b""
                state = self.cut_state
                prev = self.index.ids[-1] if len(self.index) else START
                sums = self.sums
        if stop:
            self._step("exit")
            return False
        self._step("taken")
        # Outside the lock (joins copy megabytes), so FUSE writes can keep queueing meanwhile.
        # ``last`` is tentative: cut again with the next batch, since more bytes may follow.
        batch = Pieces(taken, self._alloc)
        # Hashed on every core once a commit waits for this batch (it may start waiting meanwhile).
        groups: list[Listed] = []
        chunks, last, state = cut_batch(
            self.chunker,
            state,
            batch,
            prev,
            self.successors,
            parallel=self._draining,
            groups=groups,
            skip_groups=self.source_size if self.source_fd >= 0 else 0,
        )
        try:
            new = self.store.put_many(chunks, self) if chunks else 0
        except OSError as e:
            return self._store_failed(e)
        self._step("stored")
        # The chunks' bytes in file order: the checksum (a replaced ``sums`` is fed harmlessly).
        sums.add(taken, [len(p) for _, p in chunks], groups)
        with self.cond:
            if epoch == self.epoch:
                for cid, p in chunks:
                    self.index.append(cid, len(p))
                if groups:
                    self.groups.set_layout(self.index, sums.groups)
                self.tail, self.cut_state = last, state
                self.inflight = None
                self.bytes_new += new
                group = self._source_group()
                if group is not None and (group.end or 0) <= self.source_size:
                    self._skip_group(group)  # the writer need not read it
            self.cond.notify_all()
        return True

    def _skip_group(self, seg: Segment) -> None:
        """Under ``cond``: the group ``seg`` will be cut from the source; its bytes queued (or
        left out of the tail by ``cut_batch``) are dropped, and writes of them are from now on."""
        assert seg.end is not None
        queued = self.end - len(self.buf) - len(self.tail)  # the first byte queued
        self.buf.prepend(self.tail)
        self.tail = b""
        self.buf.drop(seg.end - queued)
        self.end = max(self.end, seg.end)
        self._skip_to = seg.end

    def _source_turn(self, seg: Segment) -> bool:
        """Cut the group ``seg`` from the source a window at a time (its stored form is never held
        whole: memory is a few windows whatever the group's size), dropping its queued bytes."""
        assert seg.end is not None
        with self.cond:
            if self._stop:
                self._active = False
                return False
            epoch, state = self.epoch, self.cut_state
            if seg.end > self.source_size:
                # Cut off by the end of the file: the rest is cut by content from the group's
                # start, as ``Cutter.cut`` does once the end is known (the queue streams it).
                self.cut_state = CutState(seg.start, (Segment(seg.start, None),), None)
                return True
            self._skip_group(seg)
            self.inflight = []  # a turn is under way: a commit waits for it
            sums = self.sums
        self._step("taken")
        fd = self.source_fd

        def read(off: int, out: memoryview) -> None:
            _pread_into(fd, off, out)

        reader, windows = self.chunker.group_windows(seg, read)
        try:
            for pieces in windows:
                chunks = list(zip(chunk_ids(pieces, self._draining), pieces, strict=True))
                new = self.store.put_many(chunks, self)
                with self.cond:
                    if epoch == self.epoch:
                        for cid, p in chunks:
                            self.index.append(cid, len(p))
                        self.bytes_new += new
            sums.add_group(seg, reader.file_pieces())
        except OSError as e:
            return self._store_failed(e)
        self._step("stored")
        with self.cond:
            if epoch == self.epoch:
                self.cut_state = CutState(seg.end, state.segments[1:], state.next)
                self.groups.set_layout(self.index, sums.groups)
                self.inflight = None
            self.cond.notify_all()
        return True

    # -- commit -----------------------------------------------------------------------------

    def prepare_commit(self) -> tuple[Index, int]:
        """Chunk everything written so far; returns (index, generation). Blocking."""
        p = self.prepare()
        return p.index, p.gen

    def prepare(self) -> Prepared:
        """Chunk everything written so far: the index, its generation and its file record, the
        stored form checked to parse to the groups stored (else stored in file order). Blocking."""
        with self.cond:
            gen = self.gen
            if self.mode is Mode.CLEAN and not self.error:
                record = self.record if self._record_index is self.index else None
                return Prepared(self.index, gen, record, [])
        index, gen, (file_sum, groups, marks) = self._chunk_all()
        index, record = self._stored_form(index, file_sum, groups)
        return Prepared(index, gen, record, marks)

    def _chunk_all(self) -> tuple[Index, int, tuple[bytes, list[Listed], list[Mark]]]:
        """Chunk everything written so far: (index, generation, its sums as ``SaveSums.final``)."""
        with self.cond:
            if self.error:
                raise self.error
            if self.mode is Mode.STREAM and self.ahead:
                needs_staging = True
            else:
                needs_staging = False
        if needs_staging:  # a hole never filled: the staged copy has the zeros
            self.to_staging()
        with self.cond:
            gen = self.gen
            if self.mode is Mode.CLEAN:  # changed back meanwhile (never: a content leaves CLEAN for good)
                raise OSError(errno.EIO, "nothing to save")
            if self.mode is Mode.STAGING:
                fd = self.staging_fd
        if self.mode is Mode.STAGING:
            staged, summed = self._chunk_staging(fd)
            return staged, gen, summed
        with self.cond:
            self._drain = True
            self._kick()
            self.cond.wait_for(
                lambda: (
                    self.error
                    or (self.inflight is None and not self.buf and self._source_group() is None)
                    or self.mode is not Mode.STREAM
                )
            )
            self._drain = False
            if self.error:
                raise self.error
            if self.mode is not Mode.STREAM:
                gen = -1  # changed under us; the caller commits again later
            index, tail, state, sums = self.index.copy(), self.tail, self.cut_state, self.sums
        if sums.size != index.size:
            log.error("a save's checksum covers %d bytes of its %d: not saved", sums.size, index.size)
            raise OSError(errno.EIO, "the save's checksum does not cover its chunks")
        groups: list[Listed] = []
        pieces, _ = self.chunker.cut(state, tail, final=True, groups=groups)  # the stream keeps its tail
        if pieces:
            chunks = list(zip(chunk_ids(pieces, parallel=True), pieces, strict=True))
            self.bytes_new += self.store.put_many(chunks, self)
            for cid, p in chunks:
                index.append(cid, len(p))
        return index, gen, sums.final(tail, [len(p) for p in pieces], groups)

    def _stored_form(self, index: Index, file_sum: bytes, groups: list[Listed]) -> tuple[Index, FileRecord]:
        """The index to install and its record. The stored form must read back as the file without
        the record too (a stub fetched from the shared tier has none): the groups the stored stream
        parses to must be the ones stored. A file whose stream parses otherwise (a byte pattern in
        its cell records that reads differently once its blocks are permuted) is stored again in
        file order; the record says so."""
        group_w = self.chunker.group_w
        if not group_w or not index.size:
            return index, make_record(file_sum, groups, group_w)
        stored = [x.seg for x in groups]

        def read(off: int, n: int) -> bytes:
            return bytes(self.read_chunks(index, off, n, off + n))

        parsed = relayout.groups(read, index.size, group_w)
        if same_groups(parsed, stored):
            return index, make_record(file_sum, groups, group_w)
        self.checks.add(file_order_saves=1)
        log.warning(
            "%s: its stored form parses to %d groups, not the %d stored (first difference at byte %d): "
            "stored in file order",
            self.groups.name or "a file", len(parsed), len(stored), _first_difference(parsed, stored),
        )  # fmt: skip
        return self._store_file_order(index, stored, file_sum), FileRecord(Form.FILE_ORDER, file_sum)

    def _store_file_order(self, index: Index, stored: list[Segment], file_sum: bytes) -> Index:
        """The file of ``index`` (its groups ``stored`` put back) stored again as it is, cut by the
        ``format`` rules; EIO if it does not have the checksum of the bytes written."""
        plain = Cutter(self.chunker.min, self.chunker.avg, self.chunker.max, "format")
        out = Index(plain.min, plain.avg, plain.max)
        state, tail = plain.initial(), b""
        hasher = file_hasher()

        def read(off: int, n: int) -> bytes:
            return bytes(self.read_chunks(index, off, n, off + n))

        for _, piece in relayout.file_pieces(read, index.size, stored):
            hasher.update(piece)
            state, tail = self._cut_staged(out, state, tail, bytes(piece), final=False, cutter=plain)
        self._cut_staged(out, state, tail, b"", final=True, cutter=plain)
        if hasher.digest() != file_sum:
            raise self.checks.mismatch(f"{self.groups.name or 'a file'}: its stored form put back for a save")
        return out

    def _chunk_staging(self, fd: int) -> tuple[Index, tuple[bytes, list[Listed], list[Mark]]]:
        """One pass over the staged copy, cut exactly as the streaming path would; the index and
        its sums (as ``SaveSums.final``: the checksum of the copy's bytes, holes as zeros).

        Holes (SEEK_HOLE) where the cut is plain CDC are not read, cut or hashed: inside a long run
        of zeros every chunk is ``zero_chunk`` (``StreamChunker.feed_zeros``, equal to plain CDC).
        Elsewhere a hole is cut as the zeros it reads as, a batch at a time.
        """
        index = Index(self.chunker.min, self.chunker.avg, self.chunker.max)
        state, tail = self.chunker.initial(), b""
        held: list[bytes] = []  # batches held back until a group being gathered is whole
        hasher = file_hasher()
        groups: list[Listed] = []
        for part in _extents(fd):
            if isinstance(part, bytes):
                hasher.update(part)
                state, tail = self._add_staged(index, state, tail, held, part, groups)
                continue
            _hash_zeros(hasher, part)
            # A format decision may read a hole's first zeros (a file that starts with one); once
            # the cut is plain CDC (never with batches held: no group) the rest is not read.
            while part and not (state.plain_cdc and not held):
                n = min(part, BATCH)
                state, tail = self._add_staged(index, state, tail, held, bytes(n), groups)
                part -= n
            if part:
                stream = StreamChunker(self.chunker.cdc, tail)
                runs = stream.feed_zeros(part)
                self._store_runs(index, runs)
                state = replace(state, pos=state.pos + sum(len(p) * n for p, n in runs))
                tail = stream.tail
        self._cut_staged(index, state, tail, b"".join(held), final=True, groups=groups)
        return index, (hasher.digest(), groups, [])

    def _add_staged(
        self, index: Index, state: CutState, tail: bytes, held: list[bytes], data: bytes, groups: list[Listed]
    ) -> tuple[CutState, bytes]:
        """One batch of the staged copy: held until the cutter's decision has the bytes it waits for."""
        held.append(data)
        if state.pos + len(tail) + sum(map(len, held)) < state.waits_for:
            return state, tail
        state, tail = self._cut_staged(index, state, tail, b"".join(held), final=False, groups=groups)
        held.clear()
        return state, tail

    def _cut_staged(
        self,
        index: Index,
        state: CutState,
        tail: bytes,
        data: bytes,
        final: bool,
        groups: list[Listed] | None = None,
        cutter: Cutter | None = None,
    ) -> tuple[CutState, bytes]:
        buf = memoryview(tail + data if tail else data)
        pieces, state = (cutter or self.chunker).cut(state, buf, final=final, groups=groups)
        self._store_runs(index, [(p, 1) for p in pieces])
        return state, bytes(buf[sum(len(p) for p in pieces) :])

    def _store_runs(self, index: Index, runs: list[tuple[memoryview, int]]) -> None:
        """Store each distinct chunk once and append it ``repeat`` times (a hole: thousands)."""
        if not runs:
            return
        chunks = [(chunk_id(p), p) for p, _ in runs]
        self.bytes_new += self.store.put_many(chunks, self)
        for (cid, p), (_, repeat) in zip(chunks, runs, strict=True):
            for _ in range(repeat):
                index.append(cid, len(p))

    def take_new_bytes(self) -> int:
        """Bytes this file added to the store since the last call (one save's new bytes)."""
        new, self._reported_new = self.bytes_new - self._reported_new, self.bytes_new
        return new

    def committed(self, gen: int) -> None:
        with self.cond:
            if gen == self.gen:
                self.dirty = False

    def close(self) -> None:
        """Last handle gone: stop the worker, drop the staged copy and the pins."""
        with self.cond:
            self._stop = True
            self.epoch += 1
            self._kick()
            self.cond.notify_all()
            self._close_staging(final=True)
            on_disk, self.on_disk = self.on_disk, None
        if on_disk is not None:
            on_disk()
        self.store.unpin(self)


@dataclass
class Prepared:
    """A save's chunks stored: the index to install, the generation it saves, its file record
    (None: a snapshot saved before records, unchanged) and the checksum's marks (``Resumes``)."""

    index: Index
    gen: int
    record: FileRecord | None
    marks: list[Mark]


_ZEROS = bytes(BATCH)


def _hash_zeros(hasher: xxhash.xxh3_128, n: int) -> None:
    """``hasher.update(bytes(n))`` without allocating a hole's length."""
    while n > 0:
        step = min(n, len(_ZEROS))
        hasher.update(memoryview(_ZEROS)[:step])
        n -= step


def _first_difference(a: list[Segment], b: list[Segment]) -> int:
    for x, y in zip(a, b, strict=False):
        if (x.start, x.end, x.group) != (y.start, y.end, y.group):
            return min(x.start, y.start)
    longer = a if len(a) > len(b) else b
    return longer[min(len(a), len(b))].start if len(a) != len(b) else 0
