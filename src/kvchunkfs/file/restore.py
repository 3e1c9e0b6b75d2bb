"""Putting a stored snapshot back into a whole file: every open of a snapshot reads a whole file.

A snapshot whose bytes no whole file holds yet (not staged, no hot copy) is put back into a new
one before its open returns, and the open is then served from that file, passed through to the
kernel or read by the daemon: one read path. Where it goes:

* in the memory tier, as a hot copy for later restores, when it fits in half the room the tier
  has free (hot copies give way to it; the tier's budget is never exceeded: the host's memory
  comes first);
* else (larger than the whole tier, or memory short) on the store's disk, as an anonymous file
  under ``staging/`` (``O_TMPFILE``): it has no name, so nothing is left behind once its last
  descriptor closes, at the last close, at a stop or when the daemon is killed. Where the file
  system has no ``O_TMPFILE`` a named file is made and unlinked at once; a crash between the two
  leaves a file under ``staging/`` that recovery deletes at the next mount.

``Restore.scatter`` reads the stored stream a piece at a time on a few workers, checks each chunk
against its map row (a quick sum, else its id) and its length against the index, and has the
worker write it where the file has it (``putback.PutBack``: stored groups back in file order); the
caller sums the file in order as the written part grows and compares it with the file record's
checksum. Any mismatch is EIO and a log line, never a guessed byte. A snapshot whose chunks only
the bucket has is put back as they arrive (``fetch_into_whole``): one pass over the bytes.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import threading
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Protocol

import numpy as np

from kvchunkfs.file import putback
from kvchunkfs.file.buffers import BufferPool
from kvchunkfs.file.content import FileContent
from kvchunkfs.file.reader import ReadChunks
from kvchunkfs.format.index import Index
from kvchunkfs.store.direct import SLACK
from kvchunkfs.store.packs import ChunkCorrupt, ChunkMissing, Location, quick_sum
from kvchunkfs.store.repository import Repository

log = logging.getLogger(__name__)

# (index, write(offset, bytes), known locations) -> offsets every piece is written up to, in order.
Scatter = Callable[
    [Index, Callable[[int, memoryview], None], "dict[bytes, Location] | None"], Generator[int, None, None]
]

PIECE = 1 << 20  # a put-back reads this much of the stored stream at a time ...
SCATTER_READERS = 3  # ... on this many workers (the disk has 2-3 reads in flight)
REPEATS_KEPT = 64 << 20  # chunks a file has again later (zeros, repeats) kept for their next places
HEADER_FETCH = 256 << 10  # bytes fetched from the bucket at least, from where a group header is read
DISK_PREFIX = "restore-"  # a named disk copy (no O_TMPFILE), unlinked at once; recovery sweeps leftovers


class Loads(Protocol):
    """What a put-back from the bucket asks of ``Files``: load a stub again, read stored bytes."""

    def load_stub(self, rel: str) -> FileContent: ...

    def read_chunks(self, index: Index, offset: int, size: int, ahead: int | None = None) -> bytes: ...


class RestoreStats:
    """Counters of put-backs (stats, metrics)."""

    def __init__(self) -> None:
        self.chunks_read = 0  # chunks read from the packs
        self.to_memory = 0  # snapshots put back into the memory tier
        self.to_disk = 0  # snapshots put back onto the store's disk (too big for the tier)
        self.disk_copies_open = 0  # disk copies some open still holds
        self._lock = threading.Lock()

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


class Restore:
    """The put-backs of one store's snapshots (thread-safe; every call blocks: run it in a thread)."""

    def __init__(self, repo: Repository, buffers: BufferPool, workers: int, verify: bool = True) -> None:
        self.repo = repo
        self.buffers = buffers  # the pieces' ring is taken there (reused, faulted in once)
        self.verify = verify
        self.pool = ThreadPoolExecutor(max(SCATTER_READERS, workers), thread_name_prefix="restore")
        self.stats = RestoreStats()

    # -- where the whole file goes ----------------------------------------------------------

    def put_back(self, content: FileContent, rel: str, key: str | None) -> None:
        """Write the snapshot's bytes into a new whole file, checked against its file record, and
        back ``content`` by it: kept as its hot copy ``key`` in the memory tier if it fits there,
        else an anonymous file on the store's disk, this content's until its last close."""
        whole = self.repo.whole
        if whole is None:
            return
        size = content.index.size
        if key is None:  # an empty stub (a new file): this open's own
            path, fd = whole.new_staged()
            try:
                self.write_whole(content, fd, self.scatter)
            except BaseException:
                os.close(fd)
                whole.drop_staged(path)
                raise
            content.use_whole(fd, path)
            return
        if not self._fits_memory(size):
            self._to_disk(content)
            return
        path, fd = whole.new_part()
        try:
            self.write_whole(content, fd, self.scatter)
            whole.hot_commit(path, key, size, rel=rel)
        except BaseException:
            os.close(fd)
            whole.drop_staged(path)
            raise
        self.stats.add(to_memory=1)
        content.use_whole(fd, None)

    def warm(self, content: FileContent, rel: str, key: str, scatter: Scatter) -> None:
        """The warm-up's put-back (file/warmup.py): into the memory tier only, as a warm copy (first
        to go, never counted as a client's put-back), its bytes read through ``scatter``."""
        whole = self.repo.whole
        assert whole is not None
        path, fd = whole.new_part()
        try:
            self.write_whole(content, fd, scatter)
            whole.hot_commit(path, key, content.index.size, rel=rel, warm=True)
        except BaseException:
            whole.drop_staged(path)
            raise
        finally:
            os.close(fd)

    def _fits_memory(self, size: int) -> bool:
        """Whether a put-back of ``size`` bytes goes to the memory tier: half the room it has free
        covers it (the other half stays for saves; hot copies count as room: they give way to it
        when it is kept, least recently used first). Never while memory is short."""
        whole = self.repo.whole
        assert whole is not None
        return not whole.short and size <= whole.free_bytes() // 2

    def _to_disk(self, content: FileContent) -> None:
        """Put the snapshot back into an anonymous file on the store's disk (``staging/``)."""
        fd = _disk_file(self.repo.staging)
        try:
            self.write_whole(content, fd, self.scatter)
        except BaseException:
            os.close(fd)
            raise
        self.stats.add(to_disk=1, disk_copies_open=1)
        log.info("%s: %d bytes, more than the memory tier may take: put back on the store's disk",
                 content.groups.name, content.index.size)  # fmt: skip
        content.use_whole(fd, None, on_disk=lambda: self.stats.add(disk_copies_open=-1))

    # -- the put-back -----------------------------------------------------------------------

    @staticmethod
    def write_whole(content: FileContent, fd: int, scatter: Scatter, read_chunks: ReadChunks | None = None) -> int:
        """Write the loaded snapshot's bytes in file order into the empty ``fd``, checked against
        its file record's checksum (EIO, logged and counted, if they differ); the size.

        ``scatter`` reads the stored stream in pieces on its workers and has each written where
        the file has it (file/putback.py): a few pieces in memory at a time, whatever the file's
        size. ``read_chunks``: how the groups' headers are read, if not as the content's are."""
        index, record, locations = content.snapshot()
        # The groups: the record's, else parsed from their headers (a snapshot from before records).
        segs = content.groups.groups_before(index, index.size, read_chunks or content.read_chunks)
        out = putback.PutBack(fd, index.size, segs, summed=record is not None)
        pieces = scatter(index, out.write, locations)
        try:
            for written in pieces:
                out.sum_to(written)
        finally:
            pieces.close()  # now, not when collected: no worker may write once the caller drops ``fd``
        file_sum = out.finish()
        if record is not None and file_sum != record.file_sum:
            raise content.checks.mismatch(f"{content.groups.name or 'a file'}: the whole file put back for a restore")
        return index.size

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
        once no worker is still writing. ``executor``: the workers' (the put-back pool's if None).

        Memory: ``readers + 2`` pieces, whatever the file's size, and the chunks the file has
        again later (a repeat, zeros) up to ``REPEATS_KEPT``: a piece of repeats waits for the
        pieces that read them and takes them from there (read again past that bound)."""
        size = index.size
        if not size:
            return
        store = self.repo.store
        ids = index.ids
        known = locations if locations is not None and all(c in locations for c in ids) else None
        found = known if known is not None else store.locate_many(ids)
        repeated = {cid for cid, n in Counter(ids).items() if n > 1}
        kept: dict[bytes, bytes] = {}  # repeated chunks read already (set item: atomic)
        kept_bytes = [0]
        seen: dict[bytes, int] = {}  # chunk id -> the piece that reads it
        pieces: list[tuple[int, int, int]] = []  # (first chunk, count, bytes)
        after: list[int] = []  # per piece of repeats: the last piece it takes chunks from (-1: reads its own)
        i, last = 0, len(index) - 1
        while i <= last:
            n, length, wait_for = 0, 0, -1
            if ids[i] in seen:  # repeats, up to a piece's worth
                while i + n <= last and ids[i + n] in seen and (not n or length + index.length(i + n) <= PIECE):
                    wait_for = max(wait_for, seen[ids[i + n]])
                    length += index.length(i + n)
                    n += 1
            else:
                run, _ = _run(index, i, last, found, max(PIECE, index.length(i)))
                while n < run and ids[i + n] not in seen:  # a chunk read before ends it
                    length += index.length(i + n)
                    n += 1
                for cid in ids[i : i + n]:
                    seen.setdefault(cid, len(pieces))
            pieces.append((i, n, length))
            after.append(wait_for)
            i += n
        room = max(PIECE, *(p[2] for p in pieces)) + SLACK  # SLACK: direct reads
        ring = readers + 2
        whole = self.buffers.take(room * ring, brief=True)
        free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for k in range(ring):
            free.put(whole.data[k * room : (k + 1) * room])
        reads = _PieceReads(pieces, free)
        first = {j: k for k, (j, _, _) in enumerate(pieces)}

        def work(j: int, n: int, length: int, buf: memoryview) -> memoryview:
            k = first[j]
            if after[k] >= 0:  # the pieces that read them first are done
                reads.results[after[k]].result()
                view = buf[:length]
                missing = [cid for cid in ids[j : j + n] if cid not in kept]
                fetched = dict(zip(missing, store.get_many(missing), strict=True)) if missing else {}
                at = 0
                for x in range(j, j + n):
                    data = kept.get(ids[x]) or fetched[ids[x]]
                    if len(data) != index.length(x):
                        raise ChunkCorrupt(
                            f"chunk {ids[x].hex()} is {len(data)} bytes, the index says {index.length(x)}"
                        )
                    view[at : at + len(data)] = data
                    at += len(data)
            else:
                view = self._read(index, j, n, found, buf, length)
                at = 0
                for x in range(j, j + n):  # kept for their next places (copies: the buffer is reused)
                    cid, ln = ids[x], index.length(x)
                    if cid in repeated and cid not in kept and kept_bytes[0] + ln <= REPEATS_KEPT:
                        kept[cid] = bytes(view[at : at + ln])
                        kept_bytes[0] += ln
                    at += ln
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

    def _read(
        self, index: Index, i: int, n: int, found: dict[bytes, Location], room: memoryview, length: int
    ) -> memoryview:
        """Chunks ``i .. i+n-1`` (back to back in one pack, ``length`` bytes) read into ``room`` and
        checked; if GC deleted the pack meanwhile, they are looked up again and read one by one."""
        store = self.repo.store
        ids = index.ids[i : i + n]
        loc = found[ids[0]]
        out = room[:length]
        try:
            for view, _ in store.read_run_placed(loc.pack, loc.offset, length, room, length):
                out = view  # one read: the run's bytes, wherever a direct read put them
        except FileNotFoundError:  # GC compacted the pack after the chunks were located
            out, at = room[:length], 0
            for data in store.get_many(ids):  # looked up again, each checked against its id
                out[at : at + len(data)] = data
                at += len(data)
            if at != len(out):
                raise ChunkCorrupt(f"chunks from {ids[0].hex()} are {at} bytes, the index says {len(out)}") from None
            return out
        self.stats.add(chunks_read=n)
        at = 0
        for k, cid in enumerate(ids):
            c = found[cid]
            if self.verify and not _intact(cid, c, out[at : at + c.length]):
                err = ChunkCorrupt(f"chunk {cid.hex()} in pack {c.pack} at {c.offset} fails its checksum")
                log.error("%s", err)
                raise err
            if c.length != index.length(i + k):
                raise ChunkCorrupt(f"chunk {cid.hex()} is {c.length} bytes, the index says {index.length(i + k)}")
            at += c.length
        return out

    # -- the bucket -------------------------------------------------------------------------

    def fetches_into_whole(self, content: FileContent, key: str | None) -> bool:
        """Whether ``content`` is a snapshot with chunks only the bucket has, to put back as they
        come (into memory: a snapshot too big for it is fetched into the packs first)."""
        whole = self.repo.whole
        return (
            self.repo.remote is not None
            and whole is not None
            and content.staged is None
            and key is not None
            and len(content.locations or ()) != len(set(content.index.ids))
            and content.index.size <= whole.free_bytes() // 2
        )

    def fetch_into_whole(self, files: Loads, rel: str, first: FileContent, key: str) -> FileContent | None:
        """A snapshot with chunks only the bucket has, put back into a new whole file as its chunks
        arrive (each checked against its id on the worker that fetched it, then written where the
        file has it), while the same chunks are appended to the local packs; then loaded again,
        backed by the whole file, which becomes its hot copy. One pass over the bytes: no second
        read of them from the packs. None if the stub changed meanwhile (nothing kept).

        The first load's pins and the fetch's own (``owner``) hold every chunk until the second
        load has pinned them again."""
        whole, remote = self.repo.whole, self.repo.remote
        assert whole is not None and remote is not None and first.loaded_from is not None
        owner = object()
        content = first
        path, fd = whole.new_part()
        try:
            try:
                size = self.write_whole(first, fd, self._fetching_scatter(owner), self._fetching_reader(files, owner))
                content = files.load_stub(rel)
                if content.loaded_from is None or content.loaded_from[0] != first.loaded_from[0]:
                    content.close()
                    os.close(fd)
                    whole.drop_staged(path)
                    return None
                whole.hot_commit(path, key, size, rel=rel)
            except BaseException:
                if content is not first:
                    content.close()
                os.close(fd)
                whole.drop_staged(path)
                raise
            content.use_whole(fd, None)
            self.stats.add(to_memory=1)
        finally:
            first.close()
            self.repo.store.unpin(owner)
        remote.mark_partial(rel, len(content.locations or ()) != len(set(content.index.ids)))
        return content

    def fetch_missing(self, files: Loads, rel: str, content: FileContent) -> FileContent:
        """The snapshot loaded again once the chunks only the bucket has are in the local packs."""
        remote = self.repo.remote
        if remote is None:
            return content
        if content.all_local:
            remote.mark_partial(rel, False)
            return content
        # Chunks only the bucket has (a snapshot another host saved, or chunks evicted under
        # local_cache_size): fetch them into the local packs, outside the lock (network), then
        # load again. The first load's pins hold every chunk of the snapshot until the second
        # load has pinned them again: eviction must not take the local ones meanwhile.
        owner = object()
        first = content
        try:
            remote.fetch_missing(first.index.ids, owner)
            content = files.load_stub(rel)
        finally:
            first.close()
            self.repo.store.unpin(owner)
        remote.mark_partial(rel, not content.all_local)
        return content

    def _fetching_reader(self, files: Loads, owner: object) -> ReadChunks:
        """Reads of a snapshot's stored bytes (its groups' headers) that fetch the chunks they
        need from the bucket into the local packs first (pinned for ``owner``)."""
        remote = self.repo.remote
        assert remote is not None

        def read(index: Index, offset: int, size: int, ahead: int | None = None) -> bytes:
            # A header's reads grow at one offset (the parser looks ahead): one GET brings them all.
            end = min(offset + max(size, HEADER_FETCH), index.size)
            if offset < end:
                remote.fetch_missing(index.ids[index.find(offset) : index.find(end - 1) + 1], owner)
            return files.read_chunks(index, offset, size)

        return read

    def _fetching_scatter(self, owner: object) -> Scatter:
        """``scatter`` for a snapshot whose chunks are partly or only in the bucket: the missing
        ones fetched (``RemoteTier.fetch_missing``: parallel range GETs, stored in the local packs
        pinned for ``owner``) and each written at every place the file has it as it arrives, on
        the fetch workers; then the rest read from the local packs. Every place is written once,
        by one or the other, or the put-back fails (EIO): never a hole for bytes."""
        remote = self.repo.remote
        assert remote is not None

        def scatter(
            index: Index, write: Callable[[int, memoryview], None], locations: dict[bytes, Location] | None
        ) -> Generator[int, None, None]:
            if not index.size:
                return
            places: dict[bytes, list[int]] = {}  # missing chunk -> where the index has it
            have = self.repo.store.has(dict.fromkeys(index.ids))
            for i, cid in enumerate(index.ids):
                if cid not in have:
                    places.setdefault(cid, []).append(i)
            written: set[bytes] = set()  # chunks written at every place (set.add: atomic)
            # As many writers as a put-back from the packs has: more only queue on the file's lock
            # (a tmpfs write holds the inode's) while it zeroes new huge pages.
            writers = threading.BoundedSemaphore(SCATTER_READERS)

            def deliver(buf: memoryview, parts: list[tuple[bytes, int, int]]) -> None:
                with writers:
                    for pos, piece in _pieces(index, places, buf, parts):
                        write(pos, piece)
                written.update(cid for cid, _, _ in parts if cid in places)

            remote.fetch_missing(places, owner, deliver)
            # What no fetch wrote (local already; or stored meanwhile by another open's fetch),
            # read from the local packs a run of places at a time (ChunkMissing if not there).
            i, n = 0, len(index)
            while i < n:
                if index.ids[i] in written:
                    i += 1
                    continue
                j = i
                while j < n and index.ids[j] not in written:
                    j += 1
                for off, piece in _local_pieces(self, index, i, j):
                    write(off, piece)
                i = j
            yield index.size

        return scatter

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _local_pieces(restore: Restore, index: Index, i: int, j: int) -> Iterator[tuple[int, memoryview]]:
    """Chunks ``i .. j-1`` of ``index`` read from the local packs, a run at a time (ChunkMissing
    if the map lacks one): (offset in the stored stream, bytes)."""
    store = restore.repo.store
    found = store.locate_many(index.ids[i:j])
    k = i
    while k < j:
        n, length = _run(index, k, j - 1, found, max(PIECE, index.length(k)))
        room = np.empty(length + SLACK, np.uint8).data
        yield index.start(k), restore._read(index, k, n, found, room, length)
        k += n


def _disk_file(directory: Path) -> int:
    """An anonymous read-write file in ``directory``: ``O_TMPFILE`` where the file system has it,
    else a named one unlinked at once (a crash between leaves it for recovery to delete)."""
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        return os.open(directory, flags | os.O_TMPFILE, 0o600)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    path = directory / f"{DISK_PREFIX}{os.urandom(8).hex()}"
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.unlink(path)
    return fd


class _PieceReads:
    """``scatter``'s readers: workers that take the pieces in order, each read into a free buffer
    of the ring, its result (buffer, bytes) or error in that piece's future.

    A worker takes a free buffer before it takes a piece, so every piece taken has a buffer; the
    caller waits only for the earliest piece not yet handed back, which is taken or next to be
    taken, and a ring of ``readers + 2`` always has a buffer for it: no deadlock.
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


def _intact(cid: bytes, loc: Location, data: memoryview) -> bool:
    """The chunk's bytes are the ones its map row was written with: the row's quick sum where it
    has one (rows from before sums, or mapped by recovery, have none: then SHA-256, the id)."""
    if loc.sum is not None:
        return quick_sum(data) == loc.sum
    return hashlib.sha256(data).digest() == cid


def _run(index: Index, i: int, last: int, found: dict[bytes, Location], room: int) -> tuple[int, int]:
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


def _pieces(
    index: Index, places: dict[bytes, list[int]], buf: memoryview, parts: list[tuple[bytes, int, int]]
) -> Iterator[tuple[int, memoryview]]:
    """Where fetched chunks go in the stored stream: (offset, bytes) for each, chunks that follow
    each other both in ``buf`` and in the index (a pack written in file order) as one piece. A
    chunk whose length is not the index's is never written (ChunkCorrupt: EIO)."""
    start, end, nxt = -1, -1, -1  # the piece being grown: its bytes in buf, its next index place
    pos = 0
    for cid, off, n in parts:
        at = places.get(cid)
        if at is None:  # not one this file lacked
            continue
        for i in at:
            if index.length(i) != n:
                raise ChunkCorrupt(f"chunk {cid.hex()} is {n} bytes, the index says {index.length(i)}")
        if len(at) == 1 and at[0] == nxt and off == end:
            end, nxt = off + n, nxt + 1
            continue
        if start >= 0:
            yield pos, buf[start:end]
            start = -1
        if len(at) == 1:
            start, end, nxt, pos = off, off + n, at[0] + 1, index.start(at[0])
            continue
        for i in at:  # a chunk the file has more than once: written at each place
            yield index.start(i), buf[off : off + n]
    if start >= 0:
        yield pos, buf[start:end]
