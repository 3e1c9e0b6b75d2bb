"""Garbage collection: drop chunks no snapshot and no open file needs, and give their space back.

1. Mark (no lock): walk ``snapshots/`` and mark every mapped chunk a stub names (``Marks``: the
   map's ids as sorted 8-byte prefixes and a flag each, no Python object per chunk). A stub renamed
   during the walk may be missed by the directory listing, so the repository logs the path every
   rename and save creates; after the walk GC reads those paths (and again, for changes made
   meanwhile) until a round finds none (see ``mark_and_sweep``).
2. Sweep (under ``store.lock``): live = named ids | ``store.pinned()``; delete the map rows of
   every other chunk. A save checks "store has it" and pins the chunk under the same
   ``store.lock``, so a chunk it is about to reuse cannot vanish before its stub is renamed.
3. Packs (outside the long lock): a pack no row points into is deleted if the map knows it (not a
   legacy pack a new map never saw); dead bytes after the last
   live chunk of a closed pack are cut off; a pack whose live share is below the threshold is
   compacted: live chunks are copied (and re-hashed) to a new pack in batches, each batch's rows
   are moved only if they still point at the old pack, then the old pack is deleted. The open
   pack saves append to is never touched. A reader that already has the old pack open keeps
   reading it (``PackStore.pack_fd``); one that opens it after the unlink gets FileNotFoundError
   and locates the chunks again.

A save waits for GC only while the sweep deletes rows (one SQL transaction) and while one batch
of moved rows is committed; renames and unlinks never wait for GC. Copying and deleting packs
never blocks either.

In the daemon most runs do not walk: ``collect_changes`` looks only at the chunks that may have
become garbage since the last run (ids the store mapped meanwhile, ids whose last snapshot went:
the daemon's catalog counts references, service/live.py), and reclaims only the packs it freed
rows in. A walk (``run_gc``) is the safety net: at mount, every ``gc_walk_interval``, on request,
and whenever the catalog cannot tell (an unreadable stub, too many changes kept).

This module is the driver (a run, a dry run, the daemon's ``GarbageCollector``); the parts it
drives: gcmarks.py (the marks: what the stubs name), gcsweep.py (the catch-up and the sweep after
a walk), gcchanges.py (a collection of the changes), gccompact.py (the packs), gcreport.py.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from kvchunkfs.format import idarrays
from kvchunkfs.maint.gcchanges import NameIndex, collect_changes
from kvchunkfs.maint.gccompact import plan_pack, reclaim_packs
from kvchunkfs.maint.gcmarks import checkpoint, find_candidates, kept_ids, named_ids
from kvchunkfs.maint.gcreport import GCReport
from kvchunkfs.maint.gcsweep import mark_and_sweep
from kvchunkfs.store.repository import Repository

log = logging.getLogger(__name__)


def run_gc(repo: Repository, threshold: float, stop: threading.Event | None = None) -> GCReport:
    """One collection. Raises (before deleting anything) if the snapshots cannot be walked."""
    start = time.monotonic()
    report = GCReport()
    checkpoint(repo)
    mark_and_sweep(repo, report)
    repo.store.take_revisit()  # every pack is looked at now
    repo.store.revisit(reclaim_packs(repo, threshold, report, stop))
    report.duration_s = time.monotonic() - start
    return report


def plan_gc(repo: Repository, threshold: float) -> GCReport:
    """What ``run_gc`` would reclaim now, deleting and changing nothing (``gc --dry-run``): the same
    walk, the chunks it would free, and what their packs would then give back. An estimate: saves,
    renames and deletions meanwhile change it, and no recovery runs first (a crash's unmapped
    leftovers, which recovery maps and the run then frees, count as dead pack bytes)."""
    start = time.monotonic()
    report = GCReport(dry_run=True)
    store = repo.store
    named = named_ids(repo, report)
    named.add_prefixes(kept_ids(repo).sorted())
    candidates = find_candidates(repo, named, report)
    dead = np.empty(0, idarrays.ID)  # in id order
    if report.unreadable:  # as ``_sweep``: what they name is unknown
        report.errors += [f"{what}; no chunk would be freed" for what in report.unreadable]
    else:
        pinned = store.pinned()
        keep = np.fromiter((cid in pinned for cid in idarrays.to_list(candidates.ids)), bool, len(candidates))
        dead = candidates.ids[~keep]
        report.bytes_freed = int(candidates.lengths[~keep].sum())
    report.chunks_freed = len(dead)
    report.live_chunks = store.stats()[0] - len(dead)
    for pack in store.pack_ids():
        plan_pack(repo, pack, dead, threshold, report)
    report.duration_s = time.monotonic() - start
    return report


class GarbageCollector:
    """One GC at a time for a mounted store: at start, every ``interval`` seconds, on SIGUSR1 and on
    demand (``run()``, e.g. the API's POST /gc).

    With ``names`` (the daemon's catalog) a run collects only the changes since the last run; it
    walks every stub at mount, when asked to, when the last walk is ``walk_interval`` old, and
    whenever a collection of the changes cannot tell (see ``collect_changes``)."""

    def __init__(self, repo: Repository, threshold: float = 0.5, interval: int = 3600, walk_interval: int = 86400
                 ) -> None:  # fmt: skip
        self.repo = repo
        self.threshold = threshold
        self.interval = interval
        self.walk_interval = walk_interval
        self.names: NameIndex | None = None
        self.last: GCReport | None = None
        self.runs = 0
        self.walks = 0
        self.idle_skips = 0  # timer runs skipped: nothing could have become garbage since the last run
        # (namespace generation, chunks written) when the last clean run started: while both stay
        # the same, no stub was replaced or deleted and no chunk was added, so a walk would free nothing.
        self._clean_at: tuple[int, int] | None = None
        # monotonic start of the last clean walk; None: the changes since are not all known, walk next
        self._walked_at: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set at unmount: a long compaction stops between batches
        self._wake: trio.Event | None = None
        # Called after every run, periodic or on demand (the metrics count GC runs and bytes freed).
        self.observers: list[Callable[[GCReport], None]] = []
        # ``local_cache_size`` (maint/evict.py): run after every collection and by ``evict_soon``,
        # under ``_lock`` (it uses the namespace log and compaction, as GC does).
        self.evictor: Callable[[threading.Event], Any] | None = None
        self._evict_thread: threading.Thread | None = None
        self._evict_lock = threading.Lock()  # leaf: starting the eviction thread
        # Gives free heap pages back to the system (set by the daemon): before and after the walk at
        # mount, so the catalog's first load and the walk (tens of MB each for an index of a
        # million chunks) do not stay in the heap, each in its thread's arena.
        self.trim: Callable[[], None] | None = None

    def run(self, walk: bool = False) -> GCReport:
        """Collect now (waits for a collection already running, then starts a new one); ``walk``:
        read every stub even if the changes are known."""
        with self._lock:
            state = self._state()
            report = None if walk else self._collect_changes()
            if report is None:
                started = time.monotonic()
                report = run_gc(self.repo, self.threshold, self._stop)
                self.walks += 1
                clean_walk = not (report.errors or report.unreadable or report.interrupted)
                self._walked_at = started if clean_walk else None
            self.last = report
            self.runs += 1
            clean = not (report.errors or report.unreadable or report.interrupted)
            self._clean_at = state if clean else None
            self._evict_locked()
        log.log(logging.ERROR if report.errors else logging.INFO, "%s", report.summary())
        for observe in self.observers:
            observe(report)
        return report

    def plan(self) -> GCReport:
        """What a run would free now, deleting nothing (``plan_gc``); not counted as a run."""
        with self._lock:  # not beside a run: its deletions would blur the figures
            report = plan_gc(self.repo, self.threshold)
        log.info("%s", report.summary())
        return report

    def _evict_locked(self) -> None:
        if self.evictor is None or self._stop.is_set():
            return
        try:
            self.evictor(self._stop)
        except Exception:  # nothing is evicted in the failing phase; the next run tries again
            log.exception("eviction failed")

    def evict_soon(self) -> None:
        """Run an eviction pass in a thread of its own unless one is running or waiting (never
        blocks: the upload thread calls it when its queue drains)."""
        if self.evictor is None or self._stop.is_set():
            return
        with self._evict_lock:
            if self._evict_thread is not None and self._evict_thread.is_alive():
                return
            self._evict_thread = threading.Thread(target=self._evict_now, name="kvcfs-evict", daemon=True)
            self._evict_thread.start()

    def close(self, timeout: float = 60) -> None:
        """At unmount: stop a compaction between batches and wait for an eviction thread."""
        self._stop.set()
        thread = self._evict_thread
        if thread is not None:
            thread.join(timeout)

    def _evict_now(self) -> None:
        with self._lock:
            self._evict_locked()

    def _collect_changes(self) -> GCReport | None:
        """A run without a walk, if the changes since the last clean walk are all known."""
        walked = self._walked_at
        if self.names is None or walked is None:
            return None
        if self.walk_interval and time.monotonic() - walked >= self.walk_interval:
            log.info("gc: the last walk of every stub is %s s old: walking", int(time.monotonic() - walked))
            return None
        self._walked_at = None  # until it succeeds: what it took from the store is not known twice
        report = collect_changes(self.repo, self.names, self.threshold, self._stop)
        if report is None:
            log.info("gc: the changes since the last run are not all known (an unreadable stub?): walking")
            return None
        self._walked_at = walked
        return report

    def _state(self) -> tuple[int, int]:
        return self.repo.ns_gen, self.repo.store.counters.chunks_written

    def unchanged(self) -> bool:
        """Nothing saved, renamed or deleted since the last clean run started (through this daemon:
        changes made behind the mount's back are not seen; SIGUSR1 or POST /gc always collect)."""
        return self._clean_at is not None and self._clean_at == self._state()

    def _run_logged(self, timer: bool = False, walk: bool = False) -> None:
        if timer and self.unchanged():
            self.idle_skips += 1
            log.info("gc skipped: nothing was saved, renamed or deleted since the last collection")
            return
        try:
            self.run(walk)
        except Exception:
            log.exception("gc failed; nothing was deleted in the failing phase")

    async def periodic(self) -> None:
        """Background task for ``daemon.serve``: GC at mount, then every ``interval`` (0 = never again)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._loop)
            nursery.start_soon(self._on_sigusr1)
            try:
                await trio.sleep_forever()
            finally:
                self._stop.set()  # before the nursery waits for a GC thread to finish

    async def _loop(self) -> None:
        timer = False  # the run at mount always walks: it is what finds a crash's leftovers
        walk = True
        # The walk at mount waits for the catalog's first load: both read every stub, and one
        # after the other the daemon holds the transient memory of one only (with an index of a
        # million chunks, tens of MB).
        while self.names is not None and not await trio.to_thread.run_sync(self.names.wait, 1.0):
            pass
        while True:
            self._wake = wake = trio.Event()  # a request during this run triggers one more run
            if walk and self.trim is not None:
                await trio.to_thread.run_sync(self.trim)
            await trio.to_thread.run_sync(self._run_logged, timer, walk)
            if walk and self.trim is not None:
                await trio.to_thread.run_sync(self.trim)
            walk = False
            with trio.move_on_after(self.interval or math.inf):
                await wake.wait()
            timer = not wake.is_set()

    async def _on_sigusr1(self) -> None:
        with trio.open_signal_receiver(signal.SIGUSR1) as signals:
            async for _ in signals:
                log.info("gc requested by SIGUSR1")
                if self._wake is not None:
                    self._wake.set()
