"""Eviction to the shared tier (``local_cache_size``): the local store becomes a cache of the bucket.

When the pack files pass the limit, chunks that are provably in the bucket lose their map rows,
least recently used snapshots' chunks first, and compaction gives their bytes back. The stubs stay
(listed, same size and xattrs); opening one fetches what it lacks again (``Files.load``).

**A chunk may be evicted only when** (all checked by ``run_eviction``):

1. every stub that names it is *confirmed*: its content is the version this host last synced with
   the bucket (``remote.db``: sha256 of the index), and a fresh LIST of the bucket shows that very
   index object (same ETag). The bucket never holds an index naming a missing chunk (index last),
   and ``gc --remote`` never deletes a named chunk, so the chunk is in the bucket. A stub waiting for
   its upload, changed since, or replaced in the bucket by another host protects its chunks;
2. no stub created during the walk names it (the namespace log, exactly as GC's catch-up; under
   ``store.lock`` right before the rows go, ``Repository.ns_settled``: no change began or ended
   since, none is in flight);
3. it is not pinned (an open file, a save in progress, a fetch), checked under the same lock;
4. it does not hold any of a snapshot's first ``KEEP_HEAD`` bytes: the header and token list,
   which the daemon's catalog reads without opening the file (``prefix-match``, the proxy's
   routing, the prefix tree) and which must stay readable after a restart. 256 KiB holds the
   tokens of a 64k-token context (4 bytes a token); it costs at most that per snapshot.

A bucket that cannot be listed evicts nothing. Victims: each candidate chunk is as recent as the
most recently used confirmed snapshot naming it (``user.kvcfs.last_use``, else ``created``, else
mtime), oldest first (within a snapshot from its end backwards: whole packs go, little is copied),
until the live bytes fit 90% of the limit (a low-water mark, so every save does not trigger
another pass).

Crash safety is GC's: rows are deleted in one transaction (the pack bytes stay described, so a
crash before compaction leaves dead space, no dangling row), then packs are compacted or deleted
as by GC (threshold 1: every pack with dead bytes). Recovery and fsck know that a confirmed stub's
unmapped chunks are in the bucket (``remote.read_synced``), not lost.

Runs in the collector's thread, after a GC run and when the upload queue drains
(``GarbageCollector.evict_soon``), under the collector's lock: never beside GC, never on the FUSE
thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvchunkfs.format import index as idx
from kvchunkfs.maint.gccompact import reclaim_packs
from kvchunkfs.maint.gcmarks import MAX_CATCH_UPS, created_entries, salvage_ids, walk_stubs
from kvchunkfs.maint.gcreport import GCReport
from kvchunkfs.store import stubs
from kvchunkfs.store.layout import file_size
from kvchunkfs.store.packs import PackStore
from kvchunkfs.store.remote import RemoteTier
from kvchunkfs.store.repository import Repository

log = logging.getLogger(__name__)

LOW_WATER = 0.9  # evict down to this share of the limit
PASSES = 3  # eviction passes in a row while the packs stay above the limit
KEEP_HEAD = 256 << 10  # a snapshot's first bytes (header, token list) are never evicted


@dataclass
class EvictReport:
    limit: int = 0
    pack_bytes_before: int = 0
    pack_bytes_after: int = -1  # -1 until measured (a pass that stopped early: the same as before)
    confirmed: int = 0  # snapshots provably in the bucket
    evicted_chunks: int = 0
    evicted_bytes: int = 0
    disk_bytes_freed: int = 0
    partial: int = 0  # snapshots with chunks only in the bucket after this pass
    skipped: str = ""  # why nothing was evicted
    errors: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        text = (
            f"eviction: {self.evicted_chunks} chunks ({self.evicted_bytes} bytes) evicted, {self.disk_bytes_freed} "
            f"bytes of disk reclaimed; packs {self.pack_bytes_before} -> {self.pack_bytes_after} bytes "
            f"(limit {self.limit}); {self.confirmed} snapshots in the bucket, {self.partial} partly local; "
            f"{self.duration_s:.2f}s"
        )
        if self.skipped:
            text += f"; {self.skipped}"
        if self.errors:
            text += f"; {len(self.errors)} errors: " + "; ".join(self.errors)
        return text


def pack_bytes(store: PackStore) -> int:
    """Bytes of the pack files on disk (live, dead and records): what the limit bounds."""
    total = 0
    for pack in store.pack_ids():
        with contextlib.suppress(FileNotFoundError):  # GC removed it meanwhile
            total += file_size(store.pack_path(pack))
    return total


# -- victim selection (pure) ----------------------------------------------------------------------


Use = tuple[float, int, int]  # (last use, -position in the snapshot, length)


def rank(uses: dict[bytes, Use], protected: Iterable[bytes]) -> list[tuple[bytes, int]]:
    """(id, length) of the candidates, least recently used first; within one snapshot from its end
    backwards (a snapshot's chunks lie in save order in the packs, so a partial eviction frees whole
    packs instead of leaving every pack part live for compaction to copy); then by id.

    ``uses``: id -> (last use of the most recently used confirmed snapshot naming it, minus the
    chunk's position in that snapshot, length)."""
    keep = set(protected)
    ordered = sorted(uses.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0]))
    return [(cid, n) for cid, (_, _, n) in ordered if cid not in keep]


def choose_victims(ranked: Sequence[tuple[bytes, int]], skip: set[bytes], need: int) -> list[bytes]:
    """The first ranked chunks not in ``skip`` (pinned, not mapped) whose bytes add up to ``need``."""
    out: list[bytes] = []
    total = 0
    for cid, n in ranked:
        if total >= need:
            break
        if cid in skip:
            continue
        out.append(cid)
        total += n
    return out


# -- the pass -------------------------------------------------------------------------------------


@dataclass
class _Walk:
    confirmed: dict[str, bytes]  # rel -> sha256 of the stub content in the bucket
    mapped: dict[bytes, int]  # the map before the walk
    gen: int  # the namespace generation the walk started at
    uses: dict[bytes, Use] = field(default_factory=dict)
    protected: set[bytes] = field(default_factory=set)
    last_use: dict[str, float] = field(default_factory=dict)  # confirmed rel -> its last use
    lacking: set[str] = field(default_factory=set)  # rels naming a chunk the map lacked
    unreadable: list[str] = field(default_factory=list)

    def add(self, entry: stubs.Entry, created: bool = False) -> None:
        """One stub; ``created``: met through the namespace log (made during the walk: protected)."""
        if entry.skipped is not None:
            return
        try:
            if entry.error is not None:
                raise entry.error
            fd = entry.open()
            try:
                data, _ = stubs.read_stub(fd)
                used = _last_use(fd)
            finally:
                os.close(fd)
        except FileNotFoundError:  # renamed or unlinked meanwhile: the namespace log tells
            return
        except OSError as e:
            self.unreadable.append(f"{entry.rel}: {e}")
            return
        try:
            index = idx.decode(data)
        except idx.IndexFormatError:
            self.protected.update(salvage_ids(data))
            return
        if any(cid not in self.mapped for cid in index.ids):
            self.lacking.add(entry.rel)
        if created or self.confirmed.get(entry.rel) != hashlib.sha256(data).digest():
            self.protected.update(index.ids)
            return
        self.last_use[entry.rel] = used
        head = 0
        while head < len(index) and index.start(head) < KEEP_HEAD:
            self.protected.add(index.ids[head])
            head += 1
        for i, cid in enumerate(index.ids):
            seen = self.uses.get(cid)
            if seen is None or seen[0] < used:
                self.uses[cid] = (used, -i, index.length(i))


def _last_use(fd: int) -> float:
    """When the snapshot was last restored (else created, else written): the LRU clock."""
    for name in (stubs.LAST_USE, stubs.CREATED):
        with contextlib.suppress(OSError, ValueError):
            return float(os.getxattr(fd, name))
    return os.fstat(fd).st_mtime


def run_eviction(repo: Repository, tier: RemoteTier, limit: int, stop: threading.Event | None = None) -> EvictReport:
    """One pass: evict down to ``LOW_WATER * limit`` if the packs are above ``limit``."""
    start = time.monotonic()
    store = repo.store
    report = EvictReport(limit=limit, pack_bytes_before=pack_bytes(store))
    over = report.pack_bytes_before > limit
    try:
        walk = _mark(repo, tier.confirmed(), report)
    except OSError as e:  # e.g. the bucket cannot be listed: nothing is provably there
        report.skipped = f"nothing evicted: {e}"
        if over:
            report.errors.append(str(e))
        return _done(tier, report, start)
    evicted: set[bytes] = set()
    if walk is not None and over:
        evicted = _evict(repo, walk, limit, report)
    if walk is not None:
        partial = _partial(repo, walk, evicted)
        tier.set_partial(partial)
        report.partial = len(partial)
    if over:
        gc = GCReport()
        store.revisit(reclaim_packs(repo, 1.0, gc, stop))  # what it left (interrupted): GC looks again
        report.disk_bytes_freed = gc.disk_bytes_freed
        report.errors += gc.errors
    elif not report.skipped:
        report.skipped = "under the limit"
    report.pack_bytes_after = pack_bytes(store)
    return _done(tier, report, start)


def _done(tier: RemoteTier, report: EvictReport, start: float) -> EvictReport:
    report.duration_s = time.monotonic() - start
    if report.pack_bytes_after < 0:
        report.pack_bytes_after = report.pack_bytes_before
    e = tier.eviction
    e.limit = report.limit
    e.local_bytes = report.pack_bytes_after
    e.runs += 1
    e.evicted_chunks += report.evicted_chunks
    e.evicted_bytes += report.evicted_bytes
    return report


def _mark(repo: Repository, confirmed: dict[str, bytes], report: EvictReport) -> _Walk | None:
    """Walk every stub (None if one could not be read: it might name any chunk)."""
    report.confirmed = len(confirmed)
    gen = repo.ns_mark()
    walk = _Walk(confirmed, repo.store.chunk_lengths(), gen)
    for entry in walk_stubs(repo.snapshots):
        walk.add(entry)
    if walk.unreadable:
        report.skipped = "nothing evicted: unreadable entries " + "; ".join(walk.unreadable[:3])
        return None
    return walk


def _evict(repo: Repository, walk: _Walk, limit: int, report: EvictReport) -> set[bytes]:
    """Catch up with namespace changes made during the walk, then drop the victims' rows under
    ``store.lock`` if none was made since (GC's rule: a stub installed after the check still has
    its chunks pinned)."""
    store = repo.store
    gen = walk.gen
    for _ in range(MAX_CATCH_UPS):
        now, created = repo.created_since(gen)
        for entry in created_entries(repo, created):
            walk.add(entry, created=True)
        gen = now
        ranked = [(cid, n) for cid, n in rank(walk.uses, walk.protected) if cid in walk.mapped]
        need = store.stats()[1] - int(limit * LOW_WATER)  # live bytes: compaction frees the rest
        with store.lock:
            if not repo.ns_settled(gen):  # a change began or ended meanwhile, or is in flight
                continue
            if need <= 0:
                return set()
            victims = choose_victims(ranked, store.pinned(), need)
            report.evicted_chunks, report.evicted_bytes = store.evict_chunks(victims)
            return set(victims)
    report.errors.append(f"snapshots kept changing during {MAX_CATCH_UPS} catch-ups; nothing evicted")
    return set()


def _partial(repo: Repository, walk: _Walk, evicted: set[bytes]) -> set[str]:
    """Snapshots whose chunks are not all local now: those that lacked some (checked again: a
    fetch may have brought them) and the confirmed ones naming an evicted chunk."""
    out: set[str] = set()
    for rel in walk.lacking | (set(walk.last_use) if evicted else set()):
        try:
            ids = set(repo.read_index(rel).ids)
        except OSError:
            continue
        if not ids.isdisjoint(evicted) or (rel in walk.lacking and len(repo.store.locate_many(ids)) < len(ids)):
            out.add(rel)
    return out


class Evictor:
    """The daemon's eviction: ``GarbageCollector.evictor`` (runs under the collector's lock)."""

    def __init__(self, repo: Repository, tier: RemoteTier, limit: int) -> None:
        self.repo = repo
        self.tier = tier
        self.limit = limit
        self.last: EvictReport | None = None
        self._uploads_seen = -1  # the tier's uploaded_indexes when the last pass started
        tier.eviction.limit = limit

    def __call__(self, stop: threading.Event) -> EvictReport:
        """Passes until the packs are under the limit, a pass evicts nothing, or ``PASSES`` ran: a
        pass aims at the low-water mark by chunk bytes, and the packs can end above it (batch
        records, a compaction's new packs); seen once in CI as a store left at 7.5 MiB of 6 MiB."""
        self._uploads_seen = self.tier.uploaded_indexes
        for _ in range(PASSES):
            report = run_eviction(self.repo, self.tier, self.limit, stop)
            self.last = report
            level = logging.ERROR if report.errors else logging.INFO if report.evicted_chunks else logging.DEBUG
            log.log(level, "%s", report.summary())
            if report.errors or not report.evicted_chunks or report.pack_bytes_after <= self.limit or stop.is_set():
                break
        return report

    def wanted(self) -> bool:
        """Over the limit, and the packs grew or a snapshot was uploaded since the last pass (a pass
        that could not get below the limit, e.g. with the bucket down, is not repeated until
        something changes). Cheap: a listing of packs/ and a stat per pack."""
        now = pack_bytes(self.repo.store)
        self.tier.eviction.local_bytes = now
        if now <= self.limit:
            return False
        last = self.last
        return last is None or now > last.pack_bytes_after or self.tier.uploaded_indexes != self._uploads_seen
