"""GC's sweep after a walk: the catch-up with the namespace changes made meanwhile, then the
deletion of the map rows of every candidate nothing pins, under ``store.lock``."""

from __future__ import annotations

import logging

from kvchunkfs.format import idarrays
from kvchunkfs.maint.gcmarks import MAX_CATCH_UPS, Candidates, add_created, find_candidates, kept_ids, named_ids
from kvchunkfs.maint.gcreport import GCReport
from kvchunkfs.store.chunkstore import PruneStore
from kvchunkfs.store.repository import Repository

log = logging.getLogger(__name__)

SWEEP_BATCH = 2048  # rows a collection of the changes deletes per hold of ``store.lock``


def mark_and_sweep(repo: Repository, report: GCReport) -> None:
    """Walk once, then catch up with the namespace changes made meanwhile until none is left.

    The check that nothing changed since the last catch-up is made under ``store.lock``, and the
    sweep follows under it. A save installs its stub (a logged change) before it unpins its chunks,
    and unpinning needs ``store.lock``: so a stub installed after the check still has its chunks
    pinned during the sweep.
    """
    store: PruneStore = repo.store
    gen = repo.ns_mark()
    report.walks = 1
    named = named_ids(repo, report)
    for _ in range(MAX_CATCH_UPS):
        now, created = repo.created_since(gen)
        add_created(repo, created, named, report)
        gen = now
        named.add_prefixes(kept_ids(repo).sorted())  # read after the generation the sweep checks
        candidates = find_candidates(repo, named, report)
        with store.lock:
            if repo.ns_settled(gen):
                _sweep(store, candidates, report)
                return
        report.catch_ups += 1
    report.errors.append(f"snapshots kept changing during {MAX_CATCH_UPS} catch-ups; sweep skipped this run")
    log.warning("gc: %s", report.errors[-1])


def _sweep(store: PruneStore, candidates: Candidates, report: GCReport) -> None:
    """Under ``store.lock``: nothing can pin or add a chunk until the rows are gone."""
    if report.unreadable:  # what they name is unknown: any candidate may be live
        report.errors += [f"{what}; no chunk was freed" for what in report.unreadable]
        report.live_chunks = store.stats()[0]
        return
    pinned = store.pinned()
    for first in range(0, len(candidates), SWEEP_BATCH):
        ids = idarrays.to_list(candidates.ids[first : first + SWEEP_BATCH])
        lengths = candidates.lengths[first : first + SWEEP_BATCH].tolist()
        dead = [(cid, n) for cid, n in zip(ids, lengths, strict=True) if cid not in pinned]
        report.chunks_freed += store.delete_chunks([cid for cid, _ in dead])
        report.bytes_freed += sum(n for _, n in dead)
    report.live_chunks = store.stats()[0]
