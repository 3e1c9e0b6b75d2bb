"""GC's packs: a pack no row points into is deleted, dead bytes after the last live chunk of a
closed pack are cut off, a pack whose live share is below the threshold is compacted (its live
chunks copied, re-hashed, to a new pack of GC's own, batch by batch, each batch's rows moved only if
they still point at the old pack, then the old pack deleted); and the same decisions as a plan."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator

import numpy as np

from kvchunkfs.format import idarrays
from kvchunkfs.maint.gcreport import GCReport
from kvchunkfs.store.chunkstore import PruneStore
from kvchunkfs.store.layout import file_size
from kvchunkfs.store.packformat import PACK_HEADER_SIZE, has_header, scan
from kvchunkfs.store.packs import ChunkCorrupt
from kvchunkfs.store.packwriter import Batch, PackWriter
from kvchunkfs.store.repository import Repository

log = logging.getLogger(__name__)

COPY_BATCH = 4 << 20  # bytes copied (and rows moved) per step of a compaction


def reclaim_packs(
    repo: Repository,
    threshold: float,
    report: GCReport,
    stop: threading.Event | None,
    only: Iterable[int] | None = None,
) -> set[int]:
    """Delete, trim or compact packs with dead bytes: every pack, or ``only`` these. Returns the
    packs it left alone (the open one, the rest after an interruption): a later run looks again."""
    store: PruneStore = repo.store
    out = _Output(store)
    packs = store.pack_ids() if only is None else sorted(only)
    left: set[int] = set()
    try:
        usage = store.pack_usage(None if only is None else packs)
        for n, pack in enumerate(packs):
            if stop is not None and stop.is_set():
                report.interrupted = True
                left.update(packs[n:])
                return left
            if pack in out.packs:
                continue
            size = file_size(store.pack_path(pack))
            live = usage[pack][1] if pack in usage else 0
            # The pack saves append to is left alone, unless it is worth reclaiming: then it is
            # sealed (the next save starts a new one). Otherwise a store whose every save fits in
            # one pack would never get its space back until a remount.
            if pack == store.open_pack and not (_worth_reclaiming(store, pack, size, live, threshold)
                                                and store.seal(pack)):  # fmt: skip
                left.add(pack)
                continue
            if live == 0:
                if store.remove_pack(pack):  # re-checks under the lock: rows may have come since
                    report.packs_deleted += 1
                    report.disk_bytes_freed += size
                continue
            cut = store.trim_pack(pack)  # dead chunks at the end: no tail is left that looks like a crash's
            size -= cut
            report.disk_bytes_freed += cut
            if size and live / size < threshold and _dead_bytes(store, pack, size, live) > 0:
                _compact_logged(store, pack, size, out, report, stop)
    finally:
        out.close()
    return left


def _worth_reclaiming(store: PruneStore, pack: int, size: int, live: int, threshold: float) -> bool:
    """Whether GC would delete or compact ``pack`` (nothing live, or too little; a pack that holds
    no chunk yet is not: sealing it would only start another)."""
    if size <= PACK_HEADER_SIZE:
        return False
    return live == 0 or (bool(size) and live / size < threshold and _dead_bytes(store, pack, size, live) > 0)


def _dead_bytes(store: PruneStore, pack: int, size: int, live: int) -> int:
    """Bytes of ``pack`` that are neither live chunks nor batch records (which every pack has)."""
    try:
        fd = os.open(store.pack_path(pack), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    try:
        records = scan(fd, size).record_bytes + PACK_HEADER_SIZE if has_header(fd) else 0
    finally:
        os.close(fd)
    return size - records - live


def _compact_logged(
    store: PruneStore, pack: int, size: int, out: _Output, report: GCReport, stop: threading.Event | None
) -> None:
    try:
        moved = _compact(store, pack, out, report, stop)
    except (OSError, ChunkCorrupt) as e:
        msg = f"pack {pack} not compacted: {e}"
        log.error("gc: %s", msg)
        report.errors.append(msg)
        return
    if moved is not None and store.remove_pack(pack):
        report.packs_compacted += 1
        report.disk_bytes_freed += size - moved


def _compact(store: PruneStore, pack: int, out: _Output, report: GCReport, stop: threading.Event | None) -> int | None:
    """Copy the live chunks of ``pack`` elsewhere; the bytes copied, or None if interrupted."""
    with store.lock:
        if pack == store.open_pack:
            return None
    rows = store.chunks_in_pack(pack)
    src = os.open(store.pack_path(pack), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    moved = 0
    try:
        for batch in _batches(rows):
            if stop is not None and stop.is_set():
                report.interrupted = True
                return None
            report.chunks_moved += out.copy(src, pack, batch)
            nbytes = sum(n for _, _, n in batch)
            report.bytes_moved += nbytes
            moved += nbytes
    finally:
        os.close(src)
    return moved


def _batches(rows: list[tuple[bytes, int, int]]) -> Iterator[list[tuple[bytes, int, int]]]:
    """Rows in pack order, grouped so one pread of at most COPY_BATCH bytes covers a group."""
    batch: list[tuple[bytes, int, int]] = []
    for row in rows:
        if batch and row[1] + row[2] - batch[0][1] > COPY_BATCH:
            yield batch
            batch = []
        batch.append(row)
    if batch:
        yield batch


class _Output:
    """GC's output packs: written through the store's pack writer like any pack (self-describing,
    each batch fsynced before its rows move), but packs of their own, never the one saves append to."""

    def __init__(self, store: PruneStore) -> None:
        self.store = store
        self.packs: set[int] = set()  # the packs it created (not compacted again in the same run)
        self.writer = PackWriter(self._new_pack, store.pack_size, fsync=True)

    def _new_pack(self) -> tuple[int, int]:
        pack, fd = self.store.create_pack()
        self.packs.add(pack)
        return pack, fd

    def copy(self, src: int, old_pack: int, batch: list[tuple[bytes, int, int]]) -> int:
        """Append verified copies of ``batch`` (with their record) and point their rows at them,
        each only if it is still in ``old_pack``; returns the rows moved."""
        first = batch[0][1]
        span = batch[-1][1] + batch[-1][2] - first
        data = memoryview(os.pread(src, span, first))
        pieces: list[tuple[bytes, bytes | memoryview]] = []
        for cid, off, n in batch:
            piece = data[off - first : off - first + n]
            if len(piece) != n or hashlib.sha256(piece).digest() != cid:
                raise ChunkCorrupt(f"chunk {cid.hex()} in pack {old_pack} at {off} fails its checksum")
            pieces.append((cid, piece))
        moved = 0

        def commit(copied: Batch) -> None:
            nonlocal moved
            moved = self.store.move_chunks(old_pack, copied.placed(), (copied.pack, copied.end))

        self.writer.append(pieces, commit)
        return moved

    def close(self) -> None:
        empty = self.writer.pack if self.writer.end <= PACK_HEADER_SIZE else None  # nothing copied into it
        self.writer.close()
        if empty is not None:
            self.store.remove_pack(empty)


def plan_pack(repo: Repository, pack: int, dead: np.ndarray, threshold: float, report: GCReport) -> None:
    """``reclaim_packs``' decision for one pack, as if ``dead`` (sorted ids) were gone, counted in
    ``report``."""
    store = repo.store
    size = file_size(store.pack_path(pack))
    in_pack = store.chunks_in_pack(pack)
    gone = idarrays.contains(dead, idarrays.from_list([cid for cid, _, _ in in_pack]))
    rows = [(off, n) for (_, off, n), drop in zip(in_pack, gone.tolist(), strict=True) if not drop]
    live = sum(n for _, n in rows)
    if rows and not size:  # the pack is missing (fsck's business): nothing to reclaim
        return
    if pack == store.open_pack and not _worth_reclaiming(store, pack, size, live, threshold):
        return
    if not rows:
        if store.pack_state(pack)[1]:  # a pack the map does not know is never deleted (``remove_pack``)
            report.packs_deleted += 1
            report.disk_bytes_freed += size
        return
    end = max(off + n for off, n in rows)
    if size > end:  # ``trim_pack``: dead chunks at the end are cut off
        report.disk_bytes_freed += size - end
        size = end
    if live / size < threshold and _dead_bytes(store, pack, size, live) > 0:
        report.packs_compacted += 1
        report.chunks_moved += len(rows)
        report.bytes_moved += live
        report.disk_bytes_freed += size - live
