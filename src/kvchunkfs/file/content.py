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
Reads of relayout files put stored groups back in file order through ``FileGroups`` (file/groups.py).

Content in STREAM mode is ``index`` chunks, then ``inflight`` (bytes the worker is cutting), then
``tail``, then ``buf``, then ``ahead`` (writes that arrived a little early, keyed by offset).
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvchunkfs.file.buffers import BufferPool
from kvchunkfs.file.groups import DecodedGroups, FileGroups
from kvchunkfs.file.hashing import chunk_ids
from kvchunkfs.file.predict import START, Pieces, Successors, cut_batch
from kvchunkfs.file.queues import ByteQueue, ChunkPool
from kvchunkfs.file.reader import ReadChunks
from kvchunkfs.format.chunker import BATCH, StreamChunker, chunk_id
from kvchunkfs.format.cutter import CutState, Cutter
from kvchunkfs.format.index import Index
from kvchunkfs.store.chunkstore import ChunkStore
from kvchunkfs.store.packs import Location

log = logging.getLogger(__name__)

MAX_BACKLOG = 64 << 20  # queued bytes per file before a writer waits for the chunker
AHEAD_WINDOW = 16 << 20  # how far past the end an early write may land and still stream
PAGE = 4096


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
        decoded_groups: DecodedGroups | None = None,
        buffers: BufferPool | None = None,
        decoders: Executor | None = None,
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
        self.groups = FileGroups(chunker.group_w, decoded_groups, lambda: self._stop, buffers, decoders)
        self.buffers = buffers  # large joins of a save's batch go there (reused once unreferenced)
        self.hook: Callable[[str], None] | None = None  # tests: called at the worker's steps
        # Where the loaded index's chunks were when it was opened (may go stale: readers re-locate).
        self.locations: dict[bytes, Location] | None = None
        # The stub's bytes and the map's drop generation it was loaded from; None once changed.
        self.loaded_from: tuple[bytes, int] | None = None
        self.mode = Mode.CLEAN
        self.cond = threading.Condition()
        self.gen = 0  # bumped by every change; a commit clears ``dirty`` only if unchanged
        self.dirty = False
        self.error: OSError | None = None  # the worker's failure, raised by the next call
        self.bytes_new = 0  # bytes this file added to the store
        self._reported_new = 0
        self.epoch = 0  # worker results from an older epoch are dropped
        self._reset_stream(index, b"")
        self.staging_fd = -1
        self.staging_path: Path | None = None
        self._retired_fds: list[int] = []
        self._active = False  # the worker is started and has not yet seen ``_stop``
        self._scheduled = False  # a turn of this file is queued or running in the pool
        self._stop = False
        self._drain = False
        store.pin(self, index.ids)

    # -- state ------------------------------------------------------------------------------

    def _reset_stream(self, index: Index, tail: bytes, cut_state: CutState | None = None) -> None:
        self.index = index
        self.tail = tail
        self.cut_state = cut_state or self.chunker.initial()  # the cutter at the tail's first byte
        self.inflight: list[bytes | bytearray | memoryview] | None = None
        self.buf = ByteQueue()
        self.ahead: dict[int, bytes] = {}
        self.end = index.size + len(tail)  # end of the contiguous content
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

    # -- writing ----------------------------------------------------------------------------

    def _check_size(self, size: int) -> None:
        if size > self.max_size:
            raise OSError(errno.EFBIG, f"file would be {size} bytes, max_file_size is {self.max_size}")

    def plan_write(self, offset: int, length: int) -> Action:
        self._check_size(offset + length)
        with self.cond:
            if self.error:
                raise self.error
            if self.mode is Mode.STAGING:
                return Action.DIRECT
            if self.mode is Mode.CLEAN:
                # Appends, including the kernel rewriting the last partial page, continue the chunk list.
                last = len(self.index) - 1
                ok = self.index.start(max(last, 0)) <= offset <= self.index.size
                return Action.START_STREAM if ok else Action.TO_STAGING
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
            base = self.index.copy()
        last_chunk = b""
        state = None
        if len(base):
            whole = base.copy()
            read = self.read_chunks
            state = self.chunker.resume(lambda off, n: read(whole, off, n), whole.size, base.start(len(base) - 1))
            # The last chunk, or from the start of the stored group that holds it (cut whole).
            last_chunk = bytes(self.groups.read_file(whole, state.pos, whole.size - state.pos, read))
            while base.size > state.pos:
                base.ends.pop()
                base.ids.pop()
            assert base.size == state.pos
        with self.cond:
            if self.mode is Mode.CLEAN:
                self._reset_stream(base, b"", state)
                self.buf.append(last_chunk)
                self.end += len(last_chunk)
                self.mode = Mode.STREAM
                self._start_worker()

    def write(self, offset: int, data: bytes) -> bool:
        """Apply a write planned as DIRECT; False if the worker took the bytes it patches meanwhile."""
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

    def _queue(self, offset: int, data: bytes) -> bool:
        """STREAM or CLEAN mode, under ``cond``: queue bytes for the chunker."""
        if self.mode is not Mode.STREAM or offset < self._patchable_from():
            return False
        if offset < self.end - len(self.buf):  # rewriting the tentative tail: requeue it
            self.buf.prepend(self.tail)
            self.tail = b""
        start = self.end - len(self.buf)
        self._changed()
        if offset > self.end:
            self.ahead[offset] = bytes(data)
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
        return self.mode is Mode.STREAM and len(self.buf) > MAX_BACKLOG

    def wait_backlog(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: len(self.buf) <= MAX_BACKLOG // 2 or self.error or self.mode is not Mode.STREAM)

    def truncate(self, length: int) -> Action:
        """Truncate to ``length``; returns TO_STAGING if a staged copy is needed first."""
        self._check_size(length)
        with self.cond:
            if self.error:
                raise self.error
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

    def to_staging(self) -> None:
        """Copy the whole content into a staging file (blocking; run in a thread)."""
        with self.cond:
            if self.mode is Mode.STAGING:
                return
            index, pending, ahead, size = self.index.copy(), self._pending(), dict(self.ahead), self.size
        path = self.staging_dir / f"{uuid.uuid4().hex}.staging"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            pos = 0
            while pos < index.size:
                n = min(BATCH, index.size - pos)
                os.pwrite(fd, self.groups.read_file(index, pos, n, self.read_chunks), pos)
                pos += n
            os.pwrite(fd, pending, index.size)
            for off, data in ahead.items():
                os.pwrite(fd, data, off)
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        with self.cond:
            self.staging_fd, self.staging_path = fd, path
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
        with self.cond:
            staging_fd = self.staging_fd if self.mode is Mode.STAGING else -1
            # The worker appends to ``index`` concurrently; its first ``isize`` bytes never change.
            index, isize = self.index, self.index.size
            if self.mode is Mode.STREAM:
                pending, ahead, total = self._pending(), dict(self.ahead), self.size
            else:
                pending, ahead, total = b"", {}, isize
        if staging_fd >= 0:  # outside the lock, as in write()
            return os.pread(staging_fd, size, offset)
        end = min(offset + size, total)
        if offset >= end:
            return b""
        if end <= isize:  # all in chunks: the common restore case, no extra copy
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

    def plain_range(self, offset: int, size: int) -> bool:
        """True if the chunks hold ``[offset, offset + size)`` as the file has it (no stored group
        there), as far as known without reading: the event loop's cached-read shortcut."""
        return self.groups.plain_range(self.index, offset, size)

    @property
    def _alloc(self) -> Callable[[int], np.ndarray] | None:
        pool = self.buffers
        return (lambda n: pool.take(n, brief=True)) if pool is not None else None  # joins: given back at once

    def read_ahead_limit(self, end: int) -> int | None:
        """Where read-ahead past ``end`` must stop (see ``FileGroups.read_ahead_limit``)."""
        return self.groups.read_ahead_limit(self.index, end)

    def when_ready(self, offset: int, size: int, callback: Callable[[], None]) -> bool:
        """``FileGroups.when_ready`` for this file's chunks (the event loop calls it)."""
        return self.groups.when_ready(self.index, offset, size, callback)

    def decoded(self, offset: int, size: int) -> memoryview | None:
        """The bytes if a group being put back holds all of them in place already (no wait, no
        lock: the event loop calls it)."""
        return self.groups.decoded(self.index, offset, size)

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
        if len(self.buf) < BATCH:
            return False
        # A group (chunker relayout) is cut once whole: until its last byte is queued a turn would
        # only copy it again, unless the writer is held back by the backlog.
        return self.end >= self.cut_state.waits_for or len(self.buf) > MAX_BACKLOG // 2

    def _run_once(self) -> bool:
        """One batch: take queued bytes, cut and store them; False when the worker should stop."""
        with self.cond:
            stop, ready = self._stop, self._work_ready()
            if stop:
                self._active = False
        if stop:
            self._step("exit")
            return False
        if not ready:  # a truncate emptied the queue since the turn was queued
            return True
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
        if stop:
            self._step("exit")
            return False
        self._step("taken")
        # Outside the lock (joins copy megabytes), so FUSE writes can keep queueing meanwhile.
        # ``last`` is tentative: cut again with the next batch, since more bytes may follow.
        batch = Pieces(taken, self._alloc)
        # Hashed on every core once a commit waits for this batch (it may start waiting meanwhile).
        chunks, last, state = cut_batch(self.chunker, state, batch, prev, self.successors, parallel=self._draining)
        try:
            new = self.store.put_many(chunks, self) if chunks else 0
        except OSError as e:
            log.error("saving chunks failed: %s", e)
            with self.cond:
                self.error = e
                self.inflight = None
                self._active = False
                self.cond.notify_all()
            return False
        self._step("stored")
        with self.cond:
            if epoch == self.epoch:
                for cid, p in chunks:
                    self.index.append(cid, len(p))
                self.tail, self.cut_state = last, state
                self.inflight = None
                self.bytes_new += new
            self.cond.notify_all()
        return True

    # -- commit -----------------------------------------------------------------------------

    def prepare_commit(self) -> tuple[Index, int]:
        """Chunk everything written so far; returns (index, generation). Blocking."""
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
            if self.mode is Mode.CLEAN:
                return self.index, gen
            if self.mode is Mode.STAGING:
                fd = self.staging_fd
        if self.mode is Mode.STAGING:
            return self._chunk_staging(fd), gen
        with self.cond:
            self._drain = True
            self._kick()
            self.cond.wait_for(
                lambda: self.error or (self.inflight is None and not self.buf) or self.mode is not Mode.STREAM
            )
            self._drain = False
            if self.error:
                raise self.error
            if self.mode is not Mode.STREAM:
                gen = -1  # changed under us; the caller commits again later
            index, tail, state = self.index.copy(), self.tail, self.cut_state
        pieces, _ = self.chunker.cut(state, tail, final=True)  # the stream keeps its tentative tail
        if pieces:
            chunks = list(zip(chunk_ids(pieces, parallel=True), pieces, strict=True))
            self.bytes_new += self.store.put_many(chunks, self)
            for cid, p in chunks:
                index.append(cid, len(p))
        return index, gen

    def _chunk_staging(self, fd: int) -> Index:
        """One pass over the staged copy, cut exactly as the streaming path would.

        Holes (SEEK_HOLE) where the cut is plain CDC are not read, cut or hashed: inside a long run
        of zeros every chunk is ``zero_chunk`` (``StreamChunker.feed_zeros``, equal to plain CDC).
        Elsewhere a hole is cut as the zeros it reads as, a batch at a time.
        """
        index = Index(self.chunker.min, self.chunker.avg, self.chunker.max)
        state, tail = self.chunker.initial(), b""
        held: list[bytes] = []  # batches held back until a group being gathered is whole
        for part in _extents(fd):
            if isinstance(part, bytes):
                state, tail = self._add_staged(index, state, tail, held, part)
                continue
            # A format decision may read a hole's first zeros (a file that starts with one); once
            # the cut is plain CDC (never with batches held: no group) the rest is not read.
            while part and not (state.plain_cdc and not held):
                n = min(part, BATCH)
                state, tail = self._add_staged(index, state, tail, held, bytes(n))
                part -= n
            if part:
                stream = StreamChunker(self.chunker.cdc, tail)
                runs = stream.feed_zeros(part)
                self._store_runs(index, runs)
                state = replace(state, pos=state.pos + sum(len(p) * n for p, n in runs))
                tail = stream.tail
        self._cut_staged(index, state, tail, b"".join(held), final=True)
        return index

    def _add_staged(
        self, index: Index, state: CutState, tail: bytes, held: list[bytes], data: bytes
    ) -> tuple[CutState, bytes]:
        """One batch of the staged copy: held until the cutter's decision has the bytes it waits for."""
        held.append(data)
        if state.pos + len(tail) + sum(map(len, held)) < state.waits_for:
            return state, tail
        state, tail = self._cut_staged(index, state, tail, b"".join(held), final=False)
        held.clear()
        return state, tail

    def _cut_staged(
        self, index: Index, state: CutState, tail: bytes, data: bytes, final: bool
    ) -> tuple[CutState, bytes]:
        buf = memoryview(tail + data if tail else data)
        pieces, state = self.chunker.cut(state, buf, final=final)
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
        self.groups.close()
        self.store.unpin(self)
