"""Reading chunked files: a shared chunk cache and a parallel read-ahead.

A restore is one sequential reader. On sequential access the next ``readahead`` bytes of chunks
are fetched by a pool of workers into an LRU cache; chunks that lie back to back in one pack are
read with a single pread (a "run"). Every chunk being fetched has one Future in ``_inflight``, so
a chunk is read from disk once however many requests want it at the same time.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvchunkfs.file.buffers import BufferPool
from kvchunkfs.format.index import Index
from kvchunkfs.store.chunkstore import ChunkReader
from kvchunkfs.store.direct import SLACK
from kvchunkfs.store.packs import ChunkCorrupt, ChunkMissing, Location, quick_sum

log = logging.getLogger(__name__)

Buffer = bytes | memoryview  # cached chunks are views into the run they were read with

RUN_MAX = 4 << 20  # largest run; big enough to stream, small enough to spread over workers
READ_PIECE = 512 << 10  # a run is read this much at a time, its chunks handed out as they land
STREAM_PIECE = 1 << 20  # ``stream`` reads this much at a time ...
STREAM_READERS = 2  # ... by this many workers (reads in flight) ...
STREAM_RING = STREAM_READERS + 2  # ... into this many buffers it reuses
SCATTER_READERS = 3  # workers reading and writing a put-back's pieces (the disk has 2-3 reads in flight)
SEQ_SLACK = 4 << 20  # kernel read-ahead may reorder a few concurrent requests
# Up to this many chunks (a 4 GiB file of 64 KiB chunks), a file's chunks are looked up all at once
# and the locations kept (~280 bytes a chunk); a larger file's per read-ahead window.
LOCATE_ALL = 65536


class Run:
    """One pread's buffer. Cached chunks are views into it, so it lives while any of them is cached."""

    __slots__ = ("size", "refs", "buf")

    def __init__(self, size: int, buf: memoryview | None = None) -> None:
        self.size = size
        self.refs = 0  # chunks of it in the cache
        self.buf = buf  # the whole run: a read of back-to-back chunks is answered with one slice of it


class Located(NamedTuple):
    """A cached chunk with where it lies in its run buffer (``start`` -1: not in a shared buffer)."""

    data: Buffer
    run: Run
    start: int


class ChunkCache:
    """LRU of chunk bytes. ``size`` counts whole run buffers (a buffer is freed only when its last
    chunk is evicted), so ``capacity`` bounds the memory the cache really keeps alive."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self._data: OrderedDict[bytes, Located] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, cid: bytes) -> Buffer | None:
        with self._lock:
            entry = self._data.get(cid)
            if entry is None:
                return None
            self._data.move_to_end(cid)
            return entry.data

    def get_all(self, cids: Sequence[bytes], count: bool = True) -> list[Located] | None:
        """Every chunk of a read, or None if one is missing; one lock round for all (the FUSE thread
        calls this for every read, while the prefetch workers fill the cache). Counts the hits
        unless ``count`` is False (the chunks were just counted by ``get_many``)."""
        out = []
        with self._lock:
            for cid in cids:
                entry = self._data.get(cid)
                if entry is None:
                    return None
                out.append(entry)
            for cid in cids:
                self._data.move_to_end(cid)
            if count:
                self.hits += len(out)
        return out

    def count(self, hits: int = 0, misses: int = 0) -> None:
        """Counted under the lock: the FUSE thread and the workers count at the same time."""
        with self._lock:
            self.hits += hits
            self.misses += misses

    def __contains__(self, cid: bytes) -> bool:
        return cid in self._data

    def put(self, cid: bytes, data: Buffer, run: Run | None = None, start: int = -1) -> None:
        """Cache ``data``; ``start`` is its offset in ``run.buf`` when it is a view into it."""
        run = run or Run(len(data))
        self.put_many(run, [(cid, data, start)])

    def put_many(self, run: Run, chunks: Sequence[tuple[bytes, Buffer, int]]) -> None:
        """Cache chunks of one run buffer as (id, view, offset in ``run.buf``), under one lock."""
        if run.size > self.capacity:
            return
        shared = run.buf is not None
        with self._lock:
            for cid, data, start in chunks:
                old = self._data.pop(cid, None)
                if old is not None:
                    self._unref(old.run)
                self._data[cid] = Located(data, run, start if shared else -1)
                run.refs += 1
                if run.refs == 1:
                    self.size += run.size
            while self.size > self.capacity and self._data:
                _, evicted = self._data.popitem(last=False)
                self._unref(evicted.run)

    def _unref(self, run: Run) -> None:
        run.refs -= 1
        if run.refs == 0:
            self.size -= run.size


@dataclass
class Cursor:
    """Per-handle read state: where the last read ended and how far read-ahead was issued."""

    next_offset: int = 0
    prefetched_to: int = 0  # chunk number up to which read-ahead has been scheduled
    # Locations of the file's chunks, looked up in one batch at the first read-ahead instead of
    # one query per window (empty for a file of more than ``LOCATE_ALL`` chunks: per window). A
    # stale entry (GC moved the chunk) shows up as a vanished pack or a checksum mismatch and is
    # looked up again.
    locations: dict[bytes, Location] | None = None


class Fetcher:
    def __init__(
        self, store: ChunkReader, cache: ChunkCache, workers: int = 8, readahead: int = 32 << 20, verify: bool = True
    ) -> None:
        self.store = store
        self.cache = cache
        self.readahead = readahead
        self.verify = verify
        self.pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="prefetch")
        self.buffers: BufferPool | None = None  # where ``stream`` takes its buffers (set by Files)
        self._lock = threading.Lock()
        self._inflight: dict[bytes, Future[Buffer]] = {}
        self.chunks_read = 0  # chunks that came from disk

    # -- public -----------------------------------------------------------------------------

    def read(
        self, index: Index, offset: int, size: int, cursor: Cursor | None = None, ahead: int | None = None
    ) -> bytes:
        """Bytes ``[offset, offset+size)`` of the file described by ``index`` (short at EOF);
        read-ahead stops at ``ahead`` if given."""
        end = min(offset + size, index.size)
        if offset >= end:
            return b""
        first, last = index.find(offset), index.find(end - 1)
        waits, mine = self._claim(index.ids[first : last + 1])
        if mine:  # read first what this read waits for, then queue read-ahead behind it on the disk
            self._fetch(mine, cursor.locations if cursor is not None else None)
        self._advance(index, end, last, offset, cursor, ahead)
        return _assemble(index, offset, end, first, last, _results(waits))

    def stream(
        self, index: Index, offset: int, end: int, locations: dict[bytes, Location] | None = None
    ) -> Iterator[memoryview]:
        """The bytes ``[offset, end)`` of ``index`` in order, whole chunks at a time (the first and
        last cut to the range); each view is valid only until the next one is asked for.

        For a reader that copies every byte at once (a stored group being put back): cached chunks
        are used; the others are read straight from their packs, a piece at a time in order, by
        ``STREAM_READERS`` workers into a ring of reused buffers, and never cached. Cold pieces are
        read with O_DIRECT (``PackStore.read_run_placed``), and two reads in flight keep the disk
        busy while a piece is checked and handed over; no fresh buffer per run, no hand-off per chunk.
        """
        end = min(end, index.size)
        if offset >= end:
            return
        first, last = index.find(offset), index.find(end - 1)
        ids = index.ids[first : last + 1]
        known = locations if locations is not None and all(c in locations for c in ids) else None
        found = known if known is not None else self.store.locate_many(ids)
        plan: list[tuple[int, int, int, Buffer | None]] = []  # (first chunk, count, bytes, cached data)
        i = first
        while i <= last:
            data = self.cache.get(index.ids[i])
            if data is not None:
                plan.append((i, 1, len(data), data))
                i += 1
                continue
            n, length = _stream_run(index, i, last, found, max(STREAM_PIECE, index.length(i)))
            plan.append((i, n, length, None))
            i += n
        self.cache.count(hits=sum(1 for p in plan if p[3] is not None))
        # A few workers read the pieces in order, each into a free buffer of a ring, while the
        # caller uses the one before: direct reads are synchronous, so with one reader the disk
        # would wait while it checks a piece and hands it over.
        room = max([STREAM_PIECE, *(p[2] for p in plan if p[3] is None)]) + SLACK  # SLACK: direct reads
        whole = (
            self.buffers.take(room * STREAM_RING, brief=True)
            if self.buffers is not None
            else np.empty(room * STREAM_RING, np.uint8)
        )
        free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for k in range(STREAM_RING):
            free.put(whole.data[k * room : (k + 1) * room])
        reads = _PieceReads([(j, n, length) for j, n, length, data in plan if data is None], free)
        for _ in range(min(STREAM_READERS, len(reads.pieces))):
            self.pool.submit(reads.work, lambda j, n, length, buf: self._stream_read(index, j, n, found, buf, length))
        k = 0  # uncached pieces yielded so far
        try:
            for j, n, _length, data in plan:
                buf = None
                if data is not None:
                    piece = memoryview(data)
                else:
                    buf, piece = reads.results[k].result()
                    k += 1
                lo = offset - index.start(j) if j == first else 0
                hi = len(piece) - (index.ends[last] - end if j + n - 1 == last else 0)
                yield piece[lo:hi]
                if buf is not None:
                    free.put(buf)  # the caller asked for the next piece: it is done with this one
        finally:
            reads.stop.set()
            for _ in range(STREAM_READERS):
                free.put(whole.data[:0])  # wakes readers waiting for a buffer

    def scatter(
        self,
        index: Index,
        write: Callable[[int, memoryview], None],
        locations: dict[bytes, Location] | None = None,
        readers: int = SCATTER_READERS,
        executor: ThreadPoolExecutor | None = None,
    ) -> Generator[int, None, None]:
        """Every stored byte of ``index`` read from the packs a piece at a time by ``readers``
        workers, each piece checked and handed to ``write(offset, bytes)`` on the worker that read
        it, so pieces are written in parallel while the disk reads the next ones; yields, in order,
        the offset up to which every piece is written. Returns (or raises the first error) only
        once no worker is still writing. ``executor``: the workers' (the read-ahead's if None).

        Memory: ``readers + 2`` pieces, whatever the file's size. Only chunks the file has again
        later are cached (a repeat, zeros): a piece of repeats waits for the pieces that read them
        and takes them from the cache (read again if evicted), so each chunk is read once."""
        size = index.size
        if not size:
            return
        ids = index.ids
        known = locations if locations is not None and all(c in locations for c in ids) else None
        found = known if known is not None else self.store.locate_many(ids)
        repeated = {cid for cid, n in Counter(ids).items() if n > 1}
        seen: dict[bytes, int] = {}  # chunk id -> the piece that reads it
        pieces: list[tuple[int, int, int]] = []  # (first chunk, count, bytes)
        after: list[int] = []  # per piece of repeats: the last piece it takes chunks from (-1: reads its own)
        i, last = 0, len(index) - 1
        while i <= last:
            n, length, wait_for = 0, 0, -1
            if ids[i] in seen:  # repeats, up to a piece's worth
                while i + n <= last and ids[i + n] in seen and (not n or length + index.length(i + n) <= STREAM_PIECE):
                    wait_for = max(wait_for, seen[ids[i + n]])
                    length += index.length(i + n)
                    n += 1
            else:
                run, _ = _stream_run(index, i, last, found, max(STREAM_PIECE, index.length(i)))
                while n < run and ids[i + n] not in seen:  # a chunk read before ends it
                    length += index.length(i + n)
                    n += 1
                for cid in ids[i : i + n]:
                    seen.setdefault(cid, len(pieces))
            pieces.append((i, n, length))
            after.append(wait_for)
            i += n
        room = max(STREAM_PIECE, *(p[2] for p in pieces)) + SLACK  # SLACK: direct reads
        ring = readers + 2
        pool = self.buffers
        whole = pool.take(room * ring, brief=True) if pool is not None else np.empty(room * ring, np.uint8)
        free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for k in range(ring):
            free.put(whole.data[k * room : (k + 1) * room])
        reads = _PieceReads(pieces, free)
        first = {j: k for k, (j, _, _) in enumerate(pieces)}

        def work(j: int, n: int, length: int, buf: memoryview) -> memoryview:
            k = first[j]
            if after[k] >= 0:  # taken from the cache once the pieces that read them are done
                reads.results[after[k]].result()
                view = buf[:length]
                at = 0
                datas = self.get_many(ids[j : j + n])
                _check_lengths(index, j, datas)
                for data in datas:
                    view[at : at + len(data)] = data
                    at += len(data)
            else:
                view = self._stream_read(index, j, n, found, buf, length)
                self._keep(index, j, n, view, repeated)
            write(index.start(j), view)
            return view

        workers = [(executor or self.pool).submit(reads.work, work) for _ in range(min(readers, len(pieces)))]
        try:
            for k, (j, _n, length) in enumerate(pieces):
                buf, _ = reads.results[k].result()
                free.put(buf)
                yield index.start(j) + length
        finally:
            reads.stop.set()
            for _ in workers:
                free.put(whole.data[:0])  # wakes readers waiting for a buffer
            wait(workers)  # none may write after the caller let go of the file

    def _keep(self, index: Index, j: int, n: int, view: memoryview, repeated: set[bytes]) -> None:
        """Cache the chunks of a piece just read that the file has again later (copies: the
        piece's buffer is reused)."""
        if not repeated:
            return
        at = 0
        for i in range(j, j + n):
            cid, length = index.ids[i], index.length(i)
            if cid in repeated and cid not in self.cache:
                self.cache.put(cid, bytes(view[at : at + length]))
            at += length

    def _stream_read(
        self, index: Index, i: int, n: int, found: dict[bytes, Location], room: memoryview, length: int
    ) -> memoryview:
        """Chunks ``i .. i+n-1`` (back to back in one pack, ``length`` bytes) read into ``room`` and
        checked; if GC deleted the pack meanwhile, they are looked up again and read the usual way."""
        ids = index.ids[i : i + n]
        loc = found[ids[0]]
        out = room[:length]
        try:
            for view, _ in self.store.read_run_placed(loc.pack, loc.offset, length, room, length):
                out = view  # one read: the run's bytes, wherever a direct read put them
        except FileNotFoundError:  # GC compacted the pack after the chunks were located
            out, at = room[:length], 0
            for data in self.get_many(ids):  # looked up again, read and checked the usual way
                out[at : at + len(data)] = data
                at += len(data)
            if at != len(out):
                raise ChunkCorrupt(f"chunks from {ids[0].hex()} are {at} bytes, the index says {len(out)}") from None
            return out
        self.cache.count(misses=n)
        with self._lock:
            self.chunks_read += n
        at = 0
        for k, cid in enumerate(ids):
            c = found[cid]
            if self.verify and not _intact(cid, c, out[at : at + c.length]):
                raise _corrupt(cid, c)
            if c.length != index.length(i + k):
                raise ChunkCorrupt(f"chunk {cid.hex()} is {c.length} bytes, the index says {index.length(i + k)}")
            at += c.length
        return out

    def read_cached(
        self, index: Index, offset: int, size: int, cursor: Cursor, ahead: int | None = None
    ) -> Buffer | None:
        """The read if every chunk it needs is cached already, else None; never blocks.

        A prefetched restore is served like this on the FUSE thread, without a thread handoff, and
        when its chunks lie back to back in one run buffer, as a slice of it: no copy at all.
        """
        end = min(offset + size, index.size)
        if offset >= end:
            return b""
        if cursor.locations is None:
            return None  # the first read-ahead looks up the whole file: not on the FUSE thread
        first, last = index.find(offset), index.find(end - 1)
        located = self.cache.get_all(index.ids[first : last + 1])
        if located is None:
            return None
        self._advance(index, end, last, offset, cursor, ahead)
        span = _span(located, offset - index.start(first), end - offset)
        if span is not None:
            return span
        return _assemble(index, offset, end, first, last, [e.data for e in located])

    def _advance(
        self, index: Index, end: int, last: int, offset: int, cursor: Cursor | None, ahead: int | None = None
    ) -> None:
        """Note where the handle read; on sequential access keep read-ahead ``readahead`` bytes
        ahead (never past ``ahead``)."""
        if cursor is None:
            return
        sequential = offset == 0 or abs(offset - cursor.next_offset) <= SEQ_SLACK
        cursor.next_offset = end
        if not (sequential and self.readahead):
            return
        start = max(last + 1, cursor.prefetched_to)
        # Top the window up in steps of a quarter of it: long enough that back-to-back chunks form
        # runs of RUN_MAX, short enough that the workers never run dry while the reader catches up.
        if start < len(index) and index.start(start) > end + self.readahead - self.readahead // 4:
            return
        limit = end + self.readahead if ahead is None else min(ahead, end + self.readahead)
        if start < len(index) and index.start(start) < limit:
            self._prefetch(index, start, limit, cursor)

    def get_many(self, ids: Sequence[bytes]) -> list[Buffer]:
        """Chunk bytes for ``ids``; fetches what neither the cache nor a worker has."""
        waits, mine = self._claim(ids)
        if mine:
            self._fetch(mine)
        return _results(waits)

    def _claim(self, ids: Sequence[bytes]) -> tuple[list[Future[Buffer] | Buffer], dict[bytes, Future[Buffer]]]:
        """For each id its bytes (cached) or the future that brings them; and the futures made
        here, for chunks neither the cache nor a worker has: the caller fetches those."""
        waits: list[Future[Buffer] | Buffer] = []
        mine: dict[bytes, Future[Buffer]] = {}
        hits = misses = 0
        with self._lock:
            for cid in ids:
                data = self.cache.get(cid)
                if data is not None:
                    hits += 1
                    waits.append(data)
                    continue
                fut = self._inflight.get(cid) or mine.get(cid)
                if fut is None:
                    fut = mine[cid] = self._inflight[cid] = Future()
                misses += 1  # read from disk by us or by a worker already: either way waited for
                waits.append(fut)
        self.cache.count(hits, misses)
        return waits, mine

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    # -- internals --------------------------------------------------------------------------

    def _prefetch(self, index: Index, start: int, limit: int, cursor: Cursor) -> None:
        wanted: dict[bytes, Future[Buffer]] = {}
        i = start
        with self._lock:
            while i < len(index) and index.start(i) < limit:
                cid = index.ids[i]
                if cid not in self._inflight and cid not in self.cache and cid not in wanted:
                    wanted[cid] = self._inflight[cid] = Future()
                i += 1
        cursor.prefetched_to = max(cursor.prefetched_to, i)
        if wanted:
            if cursor.locations is None:
                cursor.locations = self._locate(index.ids, wanted) if len(index) <= LOCATE_ALL else {}
            for run in self._runs(wanted, cursor.locations):
                self.pool.submit(self._read_run, run, wanted)

    def _fetch(self, futures: dict[bytes, Future[Buffer]], known: dict[bytes, Location] | None = None) -> None:
        """Fetch in the calling thread (a read that missed the cache); ``known``: locations looked
        up at open, so a cold read asks the map nothing."""
        for run in self._runs(futures, known):
            self._read_run(run, futures)

    def _locate(self, ids: Sequence[bytes], futures: dict[bytes, Future[Buffer]]) -> dict[bytes, Location]:
        try:
            return self.store.locate_many(ids)
        except Exception as e:  # a broken database fails the chunks, not the worker
            for cid in list(futures):
                self._fail(cid, futures[cid], e)
            return {}

    def _runs(
        self, futures: dict[bytes, Future[Buffer]], known: dict[bytes, Location] | None = None
    ) -> list[list[tuple[bytes, Location]]]:
        """Group chunks into runs of back-to-back bytes in one pack; fail those not in the map."""
        if known is not None and all(cid in known for cid in futures):
            found = {cid: known[cid] for cid in futures}
        else:
            found = self._locate(list(futures), futures)
        for cid in futures:
            if cid not in found:
                self._fail(cid, futures[cid], ChunkMissing(cid.hex()))
        runs: list[list[tuple[bytes, Location]]] = []
        run_bytes = 0
        for cid, loc in sorted(found.items(), key=lambda kv: (kv[1].pack, kv[1].offset)):
            prev = runs[-1][-1][1] if runs else None
            if (
                prev is not None
                and prev.pack == loc.pack
                and prev.offset + prev.length == loc.offset
                and run_bytes + loc.length <= RUN_MAX
            ):
                runs[-1].append((cid, loc))
                run_bytes += loc.length
            else:
                runs.append([(cid, loc)])
                run_bytes = loc.length
        return runs

    def _read_run(self, run: list[tuple[bytes, Location]], futures: dict[bytes, Future[Buffer]]) -> None:
        """Read a run into one buffer, a piece at a time; each piece's whole chunks are checked and
        handed to their readers at once (a restore's first read waits for its chunk, not its run)."""
        start = run[0][1]
        length = run[-1][1].offset + run[-1][1].length - start.offset
        room = np.empty(length + SLACK, np.uint8).data  # not zeroed: every byte of it is read into
        buffer = Run(length)
        i = 0  # the next chunk to check
        try:
            try:
                for view, done in self.store.read_run_placed(start.pack, start.offset, length, room, READ_PIECE):
                    buffer.buf = view
                    j = i
                    while j < len(run) and run[j][1].offset + run[j][1].length - start.offset <= done:
                        j += 1
                    if j > i:
                        self._publish(buffer, self._checked(run[i:j], view, start.offset, futures), futures)
                        i = j
            except FileNotFoundError:
                # GC compacted the pack after we located the chunks: look them up again.
                self._relocate(run[i:], futures)
                return
        except Exception as e:
            log.error("reading pack %d at %d (%d bytes) failed: %s", start.pack, start.offset, length, e)
            for cid, _ in run[i:]:
                self._fail(cid, futures[cid], e)

    def _checked(
        self, chunks: list[tuple[bytes, Location]], view: memoryview, base: int, futures: dict[bytes, Future[Buffer]]
    ) -> list[tuple[bytes, Buffer, int]]:
        """The chunks whose bytes match their id (views into the run buffer, not copies: the run
        stays alive while any chunk of it is cached); the others fail with ``ChunkCorrupt``."""
        good: list[tuple[bytes, Buffer, int]] = []
        for cid, loc in chunks:
            at = loc.offset - base
            piece = view[at : at + loc.length]
            if self.verify and not _intact(cid, loc, piece):
                self._fail(cid, futures[cid], _corrupt(cid, loc))
                continue
            good.append((cid, piece, at))
        return good

    def _publish(
        self, buffer: Run, good: list[tuple[bytes, Buffer, int]], futures: dict[bytes, Future[Buffer]]
    ) -> None:
        """A run's checked chunks: cached before they leave ``_inflight`` (a reader that finds
        neither would read them again), then handed to the readers waiting on them. One lock
        round each for the whole run: the FUSE thread takes the same locks for every read."""
        self.cache.put_many(buffer, good)
        with self._lock:
            self.chunks_read += len(good)
            for cid, _, _ in good:
                self._inflight.pop(cid, None)
        for cid, piece, _ in good:
            futures[cid].set_result(piece)

    def _relocate(self, run: list[tuple[bytes, Location]], futures: dict[bytes, Future[Buffer]]) -> None:
        sub = {cid: futures[cid] for cid, _ in run}
        for new_run in self._runs(sub):
            if any(loc.pack == run[0][1].pack for _, loc in new_run):
                for cid, _ in new_run:
                    self._fail(cid, sub[cid], ChunkMissing(f"{cid.hex()} (pack {run[0][1].pack} vanished)"))
                continue
            self._read_run(new_run, sub)

    def _fail(self, cid: bytes, fut: Future[Buffer], err: BaseException) -> None:
        with self._lock:
            self._inflight.pop(cid, None)
        if not fut.done():
            fut.set_exception(err)


class _PieceReads:
    """``stream``'s readers: workers that take the uncached pieces in order, each read into a free
    buffer of the ring, its result (buffer, bytes) or error in that piece's future.

    A worker takes a free buffer before it takes a piece, so every piece taken has a buffer; the
    caller waits only for the earliest piece not yet yielded, which is taken or next to be taken,
    and a ring of ``STREAM_READERS + 2`` always has a buffer for it: no deadlock.
    """

    def __init__(self, pieces: list[tuple[int, int, int]], free: queue.SimpleQueue[memoryview]) -> None:
        self.pieces = pieces  # (first chunk, count, bytes)
        self.results: list[Future[tuple[memoryview, memoryview]]] = [Future() for _ in pieces]
        self.free = free
        self.stop = threading.Event()
        self._next = 0
        self._lock = threading.Lock()

    def work(self, read: Callable[[int, int, int, memoryview], memoryview]) -> None:
        while True:
            buf = self.free.get()
            if self.stop.is_set():
                return
            with self._lock:
                k = self._next
                if k >= len(self.pieces):
                    self.free.put(buf)  # for another reader waiting for one, to see the end
                    return
                self._next += 1
            j, n, length = self.pieces[k]
            try:
                self.results[k].set_result((buf, read(j, n, length, buf)))
            except BaseException as e:  # handed to the caller, who raises it
                self.results[k].set_exception(e)
                return


def _intact(cid: bytes, loc: Location, data: Buffer) -> bool:
    """The chunk's bytes are the ones its map row was written with: the row's quick sum where it
    has one (rows from before sums, or mapped by recovery, have none: then SHA-256, the id)."""
    if loc.sum is not None:
        return quick_sum(data) == loc.sum
    return hashlib.sha256(data).digest() == cid


def _corrupt(cid: bytes, loc: Location) -> ChunkCorrupt:
    """The error of a chunk whose bytes fail their check, logged once here."""
    err = ChunkCorrupt(f"chunk {cid.hex()} in pack {loc.pack} at {loc.offset} fails its checksum")
    log.error("%s", err)
    return err


def _stream_run(index: Index, i: int, last: int, found: dict[bytes, Location], room: int) -> tuple[int, int]:
    """(count, bytes) of the chunks from ``i`` on that lie back to back in one pack and fit in
    ``room`` (at least chunk ``i``); ChunkMissing if the map lacks chunk ``i``."""
    loc = found.get(index.ids[i])
    if loc is None:
        raise ChunkMissing(index.ids[i].hex())
    n, length = 1, loc.length
    while i + n <= last:
        nxt = found.get(index.ids[i + n])
        if nxt is None or nxt.pack != loc.pack or nxt.offset != loc.offset + length or length + nxt.length > room:
            break
        length += nxt.length
        n += 1
    return n, length


def _results(waits: Sequence[Future[Buffer] | Buffer]) -> list[Buffer]:
    return [w.result() if isinstance(w, Future) else w for w in waits]


def _span(located: Sequence[Located], head: int, length: int) -> memoryview | None:
    """``length`` bytes from ``head`` into the first chunk as one slice of a run buffer, if the
    chunks lie back to back in the same one (a file restored in the order it was saved)."""
    run, start = located[0].run, located[0].start
    if run.buf is None or start < 0:
        return None
    pos = start
    for entry in located:
        if entry.run is not run or entry.start != pos:
            return None
        pos += len(entry.data)
    return run.buf[start + head : start + head + length]


def _check_lengths(index: Index, first: int, datas: Sequence[Buffer]) -> None:
    for i, data in enumerate(datas, first):
        if len(data) != index.length(i):  # the map's chunk is not the one the index means: never wrong bytes
            raise ChunkCorrupt(f"chunk {index.ids[i].hex()} is {len(data)} bytes, the index says {index.length(i)}")


def _assemble(index: Index, offset: int, end: int, first: int, last: int, datas: Sequence[Buffer]) -> bytes:
    _check_lengths(index, first, datas)
    head = offset - index.start(first)
    if first == last:
        return bytes(datas[0][head : head + end - offset])
    parts = [memoryview(datas[0])[head:], *datas[1:-1], memoryview(datas[-1])[: end - index.start(last)]]
    return b"".join(parts)
