"""A collection of the changes: free the chunks that became garbage since the last run without
walking the stubs (ids the store mapped meanwhile, ids whose last snapshot went: the daemon's catalog
counts references, service/live.py), and reclaim only the packs it freed rows in."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Protocol

from kvchunkfs.format import idarrays
from kvchunkfs.format.idarrays import PrefixSet
from kvchunkfs.maint.gccompact import reclaim_packs
from kvchunkfs.maint.gcmarks import MAX_CATCH_UPS, checkpoint, kept_ids
from kvchunkfs.maint.gcreport import GCReport
from kvchunkfs.maint.gcsweep import SWEEP_BATCH
from kvchunkfs.store.chunkstore import PruneStore
from kvchunkfs.store.repository import Repository

log = logging.getLogger(__name__)


class NameIndex(Protocol):
    """What ``collect_changes`` asks of the daemon's catalog (``service.live.LiveCatalog``)."""

    def unnamed(self, ids: Iterable[bytes]) -> set[bytes] | None: ...

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the catalog has read every stub once (waiting up to ``timeout``)."""
        ...


def collect_changes(
    repo: Repository, names: NameIndex, threshold: float, stop: threading.Event | None = None
) -> GCReport | None:
    """Free the chunks that became garbage since the last run without walking the stubs; None
    if the catalog cannot tell which those are (the caller walks instead).

    Candidates: ids the store mapped since the last run and ids whose last snapshot went. The
    catalog keeps those not named by any snapshot after applying every reported change. The check
    is the walk's: ``ns_gen`` is read before asking and checked under ``store.lock`` at each batch of
    the sweep (``Repository.ns_settled``: no change began or ended meanwhile, none in flight). A
    change is reported to the catalog before it ends, so a settled generation means the answer saw
    every change; a save installs its stub before it unpins its chunks, so a stub installed after
    the answer still has its chunks pinned.
    Pinned candidates (open files, saves in progress) are kept for the next run.
    """
    start = time.monotonic()
    store: PruneStore = repo.store
    report = GCReport(mode="changes")
    checkpoint(repo)
    candidates = store.take_fresh()
    if candidates is None:
        return None
    packs: set[int] = set()
    try:
        for _ in range(MAX_CATCH_UPS):
            gen = repo.ns_gen
            dead = names.unnamed(candidates)
            if dead is None:
                store.requeue_fresh(candidates)  # a walk follows; keep them in case it fails
                return None
            kept = _kept_of(kept_ids(repo), dead)  # left for a later run, once the checkpoint dropped them
            todo = dead - kept
            settled = _sweep_while(repo, gen, todo, report, packs)
            candidates = todo | kept  # what is left is asked about again
            if settled:
                break
            report.catch_ups += 1
        else:
            report.errors.append(f"snapshots kept changing during {MAX_CATCH_UPS} catch-ups; rest left for next time")
            log.warning("gc: %s", report.errors[-1])
    finally:
        store.requeue_fresh(candidates)  # what is left (pinned, or not yet decided) is looked at next time
    packs |= store.take_revisit()
    store.revisit(reclaim_packs(repo, threshold, report, stop, packs))
    report.live_chunks = store.stats()[0]
    report.duration_s = time.monotonic() - start
    return report


def _kept_of(kept: PrefixSet, ids: set[bytes]) -> set[bytes]:
    """Those of ``ids`` that ``kept`` may hold."""
    listed = list(ids)
    return {cid for cid, hit in zip(listed, kept.might_hold(idarrays.from_list(listed)).tolist(), strict=True) if hit}


def _sweep_while(repo: Repository, gen: int, ids: set[bytes], report: GCReport, packs: set[int]) -> bool:
    """Delete the rows of ``ids`` but pinned ones, a batch per hold of ``store.lock`` (a save waits
    for one batch at most), while ``repo.ns_settled(gen)``. Decided ids leave ``ids``; pinned ones
    stay in it. False if a namespace change came first (what is left must be asked about again)."""
    store: PruneStore = repo.store
    todo = list(ids)
    for i in range(0, len(todo), SWEEP_BATCH):
        batch = todo[i : i + SWEEP_BATCH]
        with store.lock:
            if not repo.ns_settled(gen):
                return False
            dead = [cid for cid in batch if not store.is_pinned(cid)]
            rows = store.drop_rows(dead)
        ids.difference_update(dead)
        report.chunks_freed += len(rows)
        report.bytes_freed += sum(n for _, n in rows)
        packs.update(pack for pack, _ in rows)
    return True
