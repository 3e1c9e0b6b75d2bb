"""Storing a plain file's bytes as chunks: the one way a save becomes an index.

``store_file`` reads a file itself, a window at a time, and stores it: cut format-aware
(format/cutter.py), a group the cutter reaches (chunker ``relayout``) cut from the file a window of
its stored form at a time (``Cutter.group_windows``: never held whole), predicted chunks taken
without a cut where a known snapshot repeats (file/predict.py), chunk ids hashed on every core,
only the chunks the store lacks written (``put_many``). A hole (SEEK_HOLE) where the cut is plain
CDC is not read: its chunks are ``zero_chunk`` repeated (``StreamChunker.feed_zeros``). Memory is a
few windows whatever the file's size.

It returns the index, the file record (format/filerecord.py: the checksum of the file's bytes and
the groups stored permuted) and the bytes the store did not have. The stored form is checked to
parse to the groups stored, reading the few header bytes it needs from the chunks just stored
(each checked against its id); a file whose stored form parses otherwise is stored again in file
order. Ingestion calls it behind a save's close, ``durability = fsync`` at the close itself, and
in-process users (offline tools, benchmarks) directly: every save is cut by this one function.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np

from kvchunkfs.file.filesums import FileChecks, SaveSums
from kvchunkfs.file.hashing import chunk_ids
from kvchunkfs.file.predict import START, Pieces, Successors, cut_batch
from kvchunkfs.format import relayout
from kvchunkfs.format.chunker import BATCH, StreamChunker
from kvchunkfs.format.cutter import CutState, Cutter
from kvchunkfs.format.filerecord import FileRecord, Form, Listed, same_groups
from kvchunkfs.format.filerecord import make as make_record
from kvchunkfs.format.index import Index
from kvchunkfs.format.llama_state import Segment
from kvchunkfs.store.chunkstore import ChunkStore

log = logging.getLogger(__name__)

WINDOW = BATCH  # file bytes read (and cut) at a time
AHEAD = 1  # windows of a group made ahead of their use (memory: this and two more)

T = TypeVar("T")


@dataclass
class Stored:
    """A file stored: its index, its file record and the bytes the store did not have."""

    index: Index
    record: FileRecord
    new_bytes: int


def store_file(
    fd: int,
    store: ChunkStore,
    cutter: Cutter,
    owner: object,
    successors: Successors | None = None,
    checks: FileChecks | None = None,
    name: str = "a file",
) -> Stored:
    """Store the file ``fd`` (read from offset 0 to its size now; nothing may change it meanwhile,
    or the checksums say so) as chunks, pinned for ``owner``. Blocking. EIO if a check fails;
    the store's errors (ENOSPC, ...) as they come."""
    checks = checks if checks is not None else FileChecks()
    run = _Run(fd, store, cutter, owner, successors)
    file_sum, groups = run.all()
    new = run.new
    index = run.index
    group_w = cutter.group_w
    if not group_w or not index.size:
        return Stored(index, make_record(file_sum, groups, group_w), new)
    stored = [x.seg for x in groups]
    parsed = relayout.groups(_StoredReader(store, index).read, index.size, group_w)
    if same_groups(parsed, stored):
        return Stored(index, make_record(file_sum, groups, group_w), new)
    checks.add(file_order_saves=1)
    log.warning(
        "%s: its stored form parses to %d groups, not the %d stored (first difference at byte %d): "
        "stored in file order",
        name, len(parsed), len(stored), _first_difference(parsed, stored),
    )  # fmt: skip
    # Cut again by the ``format`` rules (no group stored permuted), from the file itself.
    plain = Cutter(cutter.min, cutter.avg, cutter.max, "format")
    again = _Run(fd, store, plain, owner, None)
    again_sum, _ = again.all()
    if again_sum != file_sum:
        raise checks.mismatch(f"{name}: the file read again to be stored in file order")
    return Stored(again.index, FileRecord(Form.FILE_ORDER, file_sum), new + again.new)


class _Run:
    """One pass over a file: its index, checksums and new bytes."""

    def __init__(self, fd: int, store: ChunkStore, cutter: Cutter, owner: object, successors: Successors | None):
        self.fd, self.store, self.cutter, self.owner, self.successors = fd, store, cutter, owner, successors
        self.size = os.fstat(fd).st_size
        self.index = Index(cutter.min, cutter.avg, cutter.max)
        self.sums = SaveSums()
        self.new = 0
        self._buf = np.empty(0, np.uint8)  # the window being cut (its tail first), reused

    def all(self) -> tuple[bytes, list[Listed]]:
        """Cut and store the whole file: (its checksum, the groups stored permuted)."""
        cutter, size = self.cutter, self.size
        state, tail, pos = cutter.initial(), b"", 0  # ``tail``: the file's bytes [state.pos, pos), not final yet
        while True:
            seg = _group_at(state)
            if seg is not None and seg.end is not None and seg.end <= size:
                self._group(seg)
                state, tail, pos = CutState(seg.end, state.segments[1:], state.next), b"", max(pos, seg.end)
                continue
            if seg is not None:  # cut off by the end of the file: cut by content from its start, as ``cut`` does
                state = CutState(seg.start, (Segment(seg.start, None),), None)
            if pos >= size:
                break
            data, hole = self._next(pos)
            if hole and state.plain_cdc:
                state, tail = self._zeros(state, tail, hole)
                pos += hole
                continue
            n = min(hole, WINDOW) if hole else data
            state, tail = self._batch(state, tail, n, zeros=bool(hole))
            pos += n
        groups: list[Listed] = []
        pieces, _ = cutter.cut(state, tail, final=True, groups=groups)
        self._put(list(zip(chunk_ids(pieces, parallel=True), pieces, strict=True)))
        lengths = [len(p) for p in pieces]
        if self.sums.size + sum(lengths) != self.index.size:
            log.error("a save's checksum covers %d bytes of its %d: not saved", self.sums.size, self.index.size)
            raise OSError(errno.EIO, "the save's checksum does not cover its chunks")
        file_sum, listed = self.sums.final(tail, lengths, groups)
        return file_sum, listed

    def _next(self, pos: int) -> tuple[int, int]:
        """At ``pos``: (bytes read into the window after the tail, 0) or (0, a hole's length)."""
        fd, size = self.fd, self.size
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            data = size  # only a hole up to the end
        if data > pos:
            return 0, min(data, size) - pos
        end = min(os.lseek(fd, pos, os.SEEK_HOLE), size, pos + WINDOW)
        return end - pos, 0

    def _window(self, tail: bytes, n: int) -> memoryview:
        """The tail, then room for ``n`` bytes: a view of the reused buffer."""
        need = len(tail) + n
        if len(self._buf) < need:
            self._buf = np.empty(max(need, len(tail) + WINDOW), np.uint8)
        view = memoryview(self._buf.data)[:need]
        view[: len(tail)] = tail
        return view

    def _batch(self, state: CutState, tail: bytes, n: int, zeros: bool) -> tuple[CutState, bytes]:
        """The next ``n`` bytes (read from the file, or with ``zeros`` a hole's) cut after the tail,
        predicted chunks taken where they repeat."""
        pos = state.pos + len(tail)
        window = self._window(tail, n)
        if zeros:
            self._buf[len(tail) : len(tail) + n] = 0
        else:
            _pread_into(self.fd, pos, window[len(tail) :])
        batch = Pieces([window])
        groups: list[Listed] = []
        prev = self.index.ids[-1] if len(self.index) else START
        chunks, tail, state = cut_batch(
            self.cutter, state, batch, prev, self.successors, parallel=True, groups=groups, skip_groups=self.size
        )
        self._put(chunks)
        self.sums.add([window], [len(p) for _, p in chunks], groups)
        return state, tail

    def _zeros(self, state: CutState, tail: bytes, n: int) -> tuple[CutState, bytes]:
        """A hole of ``n`` bytes where the cut is plain CDC: its chunks without reading or cutting it."""
        stream = StreamChunker(self.cutter.cdc, tail)
        runs = stream.feed_zeros(n)
        if runs:
            ids = chunk_ids([p for p, _ in runs])
            self.new += self.store.put_many([(cid, p) for cid, (p, _) in zip(ids, runs, strict=True)], self.owner)
            for cid, (p, repeat) in zip(ids, runs, strict=True):
                for _ in range(repeat):
                    self.index.append(cid, len(p))
        done = sum(len(p) * k for p, k in runs)  # final now: the tail's bytes, then zeros
        self.sums.add([tail], [min(done, len(tail))])
        self.sums.add_zeros(max(0, done - len(tail)))
        return replace(state, pos=state.pos + done), stream.tail

    def _group(self, seg: Segment) -> None:
        """The group ``seg`` cut from the file a window of its stored form at a time."""
        fd = self.fd

        def read(off: int, out: memoryview) -> None:
            _pread_into(fd, off, out)

        reader, windows = self.cutter.group_windows(seg, read)
        for pieces in _ahead(windows) if reader.windows > 1 else windows:
            self._put(list(zip(chunk_ids(pieces, parallel=True), pieces, strict=True)))
        self.sums.add_group(seg, reader.file_pieces())

    def _put(self, chunks: list[tuple[bytes, bytes | memoryview]]) -> None:
        if not chunks:
            return
        self.new += self.store.put_many(chunks, self.owner)
        for cid, p in chunks:
            self.index.append(cid, len(p))


def _ahead(items: Iterator[T]) -> Iterator[T]:
    """``items``, each made on a thread of its own one ahead of the caller's use of the last (the
    next window of a group read and permuted while this one is hashed and written): at most
    ``AHEAD`` made and not yet taken. An error comes out where its item would have."""
    q: queue.Queue[tuple[bool, T | BaseException | None]] = queue.Queue(AHEAD)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                q.put((True, item))
            q.put((False, None))
        except BaseException as e:  # handed to the caller
            q.put((False, e))

    t = threading.Thread(target=produce, name="chunking-ahead", daemon=True)
    t.start()
    try:
        while True:
            more, item = q.get()
            if not more:
                if isinstance(item, BaseException):
                    raise item
                return
            yield item  # type: ignore[misc]
    finally:
        stop.set()
        while t.is_alive():  # let it finish (it may wait to put one more)
            with contextlib.suppress(queue.Empty):
                q.get(timeout=0.05)
        t.join()


def _group_at(state: CutState) -> Segment | None:
    """The group the cutter is at the start of, if any."""
    segs = state.segments
    if not segs or segs[0].group is None or segs[0].start != state.pos:
        return None
    return segs[0]


class _StoredReader:
    """The stored stream of ``index``, read a chunk at a time from the store (each checked against
    its id): the few header bytes the stored-form check parses."""

    def __init__(self, store: ChunkStore, index: Index) -> None:
        self.store, self.index = store, index
        self._last: tuple[int, bytes] = (-1, b"")

    def _chunk(self, i: int) -> bytes:
        if self._last[0] != i:
            self._last = (i, self.store.get_many([self.index.ids[i]])[0])
        return self._last[1]

    def read(self, off: int, n: int) -> bytes:
        index = self.index
        end = min(off + n, index.size)
        out = bytearray()
        i = index.find(off)
        while off < end:
            start = index.start(i)
            data = self._chunk(i)
            if len(data) != index.length(i):
                raise OSError(errno.EIO, f"chunk {i} of a save is {len(data)} bytes, its index says {index.length(i)}")
            piece = data[off - start : min(end, start + len(data)) - start]
            out += piece
            off += len(piece)
            i += 1
        return bytes(out)


def _pread_into(fd: int, off: int, out: memoryview) -> None:
    """Fill ``out`` with ``fd``'s bytes at ``off``; EIO if the file is shorter."""
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], off + done)
        if n <= 0:
            raise OSError(errno.EIO, f"the file ended {len(out) - done} bytes early at {off + done}")
        done += n


def _first_difference(a: list[Segment], b: list[Segment]) -> int:
    for x, y in zip(a, b, strict=False):
        if (x.start, x.end, x.group) != (y.start, y.end, y.group):
            return min(x.start, y.start)
    longer = a if len(a) > len(b) else b
    return longer[min(len(a), len(b))].start if len(a) != len(b) else 0
