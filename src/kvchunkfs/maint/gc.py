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
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import math
import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import trio

from kvchunkfs.format import idarrays
from kvchunkfs.format import index as idx
from kvchunkfs.format.idarrays import PrefixSet
from kvchunkfs.store import stubs
from kvchunkfs.store.chunkstore import PruneStore
from kvchunkfs.store.layout import file_size
from kvchunkfs.store.packformat import PACK_HEADER_SIZE, has_header, scan
from kvchunkfs.store.packs import ChunkCorrupt
from kvchunkfs.store.packwriter import Batch, PackWriter
from kvchunkfs.store.remote import read_synced
from kvchunkfs.store.repository import Repository

log = logging.getLogger(__name__)

MAX_CATCH_UPS = 20  # rounds of reading what renames created during the walk before giving up
COPY_BATCH = 4 << 20  # bytes copied (and rows moved) per step of a compaction
SWEEP_BATCH = 2048  # rows a collection of the changes deletes per hold of ``store.lock``
_ITEMS_AT = 64  # where a caibx item table starts: 48-byte header + 16-byte table header
_ITEM = 40


class NameIndex(Protocol):
    """What ``collect_changes`` asks of the daemon's catalog (``service.live.LiveCatalog``)."""

    def unnamed(self, ids: Iterable[bytes]) -> set[bytes] | None: ...

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the catalog has read every stub once (waiting up to ``timeout``)."""
        ...


@dataclass
class GCReport:
    mode: str = "walk"  # "walk": every stub read; "changes": only what changed since the last run
    chunks_freed: int = 0
    bytes_freed: int = 0  # chunk bytes whose map rows were deleted
    disk_bytes_freed: int = 0  # pack file bytes given back to the filesystem
    packs_deleted: int = 0
    packs_compacted: int = 0
    chunks_moved: int = 0
    bytes_moved: int = 0
    live_chunks: int = 0
    snapshots: int = 0
    unreadable_snapshots: int = 0
    missing_chunks: int = 0  # named by a stub but neither in the store nor in the shared tier (fsck tells which)
    skipped: list[str] = field(default_factory=list)  # entries under snapshots/ that are not snapshots
    unreadable: list[str] = field(default_factory=list)  # entries that could not be read: nothing was freed
    walks: int = 0
    catch_ups: int = 0  # rounds of reading stubs created by renames and saves during the walk
    interrupted: bool = False
    errors: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    dry_run: bool = False  # ``plan_gc``: the figures are what a run would free; nothing was deleted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return format_summary(self.to_dict())


def format_summary(r: dict[str, Any]) -> str:
    """One line for a report (also for the JSON a daemon sends back)."""
    where = f" in {r['snapshots']} snapshots" if r.get("mode", "walk") == "walk" else ""
    if r.get("dry_run"):
        return _dry_run_summary(r, where)
    text = (
        f"gc finished: freed {r['chunks_freed']} chunks ({r['bytes_freed']} bytes), "
        f"deleted {r['packs_deleted']} "
        f"packs, compacted {r['packs_compacted']} ({r['bytes_moved']} bytes moved), {r['disk_bytes_freed']} bytes "
        f"of disk reclaimed; {r['live_chunks']} live chunks{where}; {r['duration_s']:.2f}s"
    )
    text += "; every stub read" if r.get("mode", "walk") == "walk" else "; only the changes since the last run"
    if r.get("missing_chunks"):
        text += f"; {r['missing_chunks']} chunks missing (run fsck)"
    if r.get("skipped"):  # the first few by name; the report has them all
        more = f"; and {len(r['skipped']) - 5} more" if len(r["skipped"]) > 5 else ""
        text += f"; {len(r['skipped'])} entries skipped: " + "; ".join(r["skipped"][:5]) + more
    if r.get("interrupted"):
        text += "; interrupted"
    if r.get("errors"):
        text += f"; {len(r['errors'])} errors: " + "; ".join(r["errors"])
    return text


def _dry_run_summary(r: dict[str, Any], where: str) -> str:
    text = (
        f"gc dry run, nothing deleted: would free {r['chunks_freed']} chunks ({r['bytes_freed']} bytes), "
        f"delete {r['packs_deleted']} packs, compact {r['packs_compacted']} ({r['bytes_moved']} bytes to move), "
        f"reclaiming {r['disk_bytes_freed']} bytes of disk; {r['live_chunks']} live chunks{where}; "
        f"{r['duration_s']:.2f}s"
    )
    if r.get("missing_chunks"):
        text += f"; {r['missing_chunks']} chunks missing (run fsck)"
    if r.get("errors"):
        text += f"; {len(r['errors'])} errors: " + "; ".join(r["errors"])
    return text


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
    candidates = _candidates(repo, named, report)
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
        _plan_pack(repo, pack, dead, threshold, report)
    report.duration_s = time.monotonic() - start
    return report


def _plan_pack(repo: Repository, pack: int, dead: np.ndarray, threshold: float, report: GCReport) -> None:
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


# -- mark -----------------------------------------------------------------------------------------


def walk_stubs(snapshots: Path) -> Iterator[stubs.Entry]:
    """Every entry under ``snapshots`` but directories (see ``stubs.walk``): stubs to read, entries
    that could not be read and ones that are skipped; callers name the last two in their reports."""
    if not snapshots.is_dir():  # an empty walk would make every chunk garbage
        raise FileNotFoundError(errno.ENOENT, "the snapshots directory is missing", str(snapshots))
    return stubs.walk(snapshots)


def salvage_ids(data: bytes) -> list[bytes]:
    """Whatever a damaged index seems to name: kept live so a stub fsck may still rescue loses nothing."""
    return [data[o + 8 : o + _ITEM] for o in range(_ITEMS_AT, len(data) - _ITEM + 1, _ITEM)]


def salvage_array(data: bytes) -> np.ndarray:
    """``salvage_ids`` as ``idarrays.ID`` rows (a view of ``data``)."""
    n = max(0, (len(data) - _ITEMS_AT - _ITEM) // _ITEM + 1)
    if not n:
        return np.empty(0, idarrays.ID)
    return np.ndarray((n,), idarrays.ID, data, _ITEMS_AT + 8, (_ITEM,))


class Marks:
    """The mark phase's memory: the map's ids when the walk began, as sorted prefixes (their first
    8 bytes: the map is read in id order, so no sort), and a flag each: named by a stub. 9 bytes a
    mapped chunk, nothing per stub entry. A chunk whose prefix a stub names is kept (a chance
    collision only keeps a chunk). Named ids not in the map then are kept as prefixes too, to count
    the chunks stubs name that the store lacks."""

    def __init__(self, store: PruneStore) -> None:
        mapped = np.empty(store.stats()[0], np.uint64)
        n = 0
        for page, _ in store.mapped_pages():
            if n + len(page) > len(mapped):  # rows added since the count (saves go on meanwhile)
                mapped = idarrays.grown(mapped, n, n + len(page))
            mapped[n : n + len(page)] = idarrays.prefixes(page)
            n += len(page)
        self.mapped = mapped[:n]
        self.named = np.zeros(n, bool)
        self.unmapped = PrefixSet()

    def add(self, ids: np.ndarray) -> None:
        """Mark ``idarrays.ID`` rows as named."""
        self.add_prefixes(idarrays.prefixes(ids))

    def add_prefixes(self, keys: np.ndarray) -> None:
        at, hit = self.lookup(keys)
        self.named[at[hit]] = True
        self.unmapped.add_prefixes(keys[~hit])

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position in ``mapped``, whether it is there) of each prefix (the first of equal ones)."""
        at = np.searchsorted(self.mapped, keys)
        hit = at < len(self.mapped)
        hit[hit] = self.mapped[at[hit]] == keys[hit]
        return at, hit


def named_ids(repo: Repository, report: GCReport) -> Marks:
    """Ids the stubs name (one full walk), marked against the map (``Marks``). An entry that cannot
    be read may name any chunk: it goes to ``report.unreadable`` and the sweep then frees nothing."""
    named = Marks(repo.store)
    report.snapshots = report.unreadable_snapshots = 0
    report.skipped, report.unreadable = [], []
    for entry in walk_stubs(repo.snapshots):
        _add_entry(entry, named, report)
    return named


def _add_entry(entry: stubs.Entry, named: Marks, report: GCReport) -> None:
    if entry.skipped is not None:
        report.skipped.append(entry.problem())
        return
    try:
        if entry.error is not None:
            raise entry.error
        fd = entry.open()
    except FileNotFoundError:  # renamed or unlinked meanwhile: the namespace log tells
        return
    except OSError as e:
        entry.error = e
        report.unreadable.append(entry.problem())
        return
    try:
        valid = add_stub_ids(fd, named)
    except OSError as e:
        entry.error = e
        report.unreadable.append(entry.problem())
        return
    finally:
        os.close(fd)
    report.snapshots += 1
    if not valid:
        report.unreadable_snapshots += 1
        log.warning("gc: %s is not a valid index; keeping every chunk it may name", entry.rel)


def add_stub_ids(fd: int, named: Marks | PrefixSet) -> bool:
    """Add the ids the open stub ``fd`` names, read a piece at a time; False if it is not a valid
    index (then whatever it seems to name is added: ``salvage_ids``)."""
    try:
        for _, ids in stubs.read_table(fd):
            named.add(ids)
        return True
    except idx.IndexFormatError:
        data, _ = stubs.read_stub(fd)
        named.add(salvage_array(data))
        return False


def _add_created(repo: Repository, paths: list[str], named: Marks, report: GCReport) -> None:
    """Read what namespace changes created during the walk."""
    for entry in created_entries(repo, paths):
        _add_entry(entry, named, report)


def created_entries(repo: Repository, paths: list[str]) -> Iterator[stubs.Entry]:
    """The stubs at paths namespace changes created (a renamed directory: its whole subtree)."""
    for rel in dict.fromkeys(paths):
        path = repo.path(rel)
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:  # moved on again: a later entry of the log has it
            continue
        if stat.S_ISDIR(mode):
            with contextlib.suppress(FileNotFoundError):
                yield from stubs.walk(path)
        elif stat.S_ISREG(mode):
            yield stubs.entry_at(path, rel)


# -- sweep ----------------------------------------------------------------------------------------


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
        _add_created(repo, created, named, report)
        gen = now
        named.add_prefixes(kept_ids(repo).sorted())  # read after the generation the sweep checks
        candidates = _candidates(repo, named, report)
        with store.lock:
            if repo.ns_settled(gen):
                _sweep(store, candidates, report)
                return
        report.catch_ups += 1
    report.errors.append(f"snapshots kept changing during {MAX_CATCH_UPS} catch-ups; sweep skipped this run")
    log.warning("gc: %s", report.errors[-1])


def checkpoint(repo: Repository) -> None:
    """Before a collection: the versions kept for a power cut (durability=close) are live, so make
    the saves that replaced them durable first, which drops them (``Repository.checkpoint``). If
    that fails (a full disk can fail an fsync) GC still runs, keeping what they name."""
    try:
        repo.checkpoint()
    except OSError as e:
        log.warning("checkpoint before gc failed: %s", e)


def kept_ids(repo: Repository) -> PrefixSet:
    """Ids named by the versions kept in ``prev/`` for a power cut (durability=close): a save that
    replaced one after GC's checkpoint is not durable yet, so its old version may come back.
    Read after the generation the sweep checks: a save links its old version before its rename
    begins (``Repository._keep_previous``), so a link made later comes with a change that makes
    the sweep catch up first."""
    out = PrefixSet()
    try:
        entries = list(os.scandir(repo.layout.prev))
    except FileNotFoundError:
        return out
    for entry in entries:
        try:
            fd = stubs.open_stub(entry.path)
        except OSError:
            continue  # gone (a checkpoint dropped it), or not a stub: nothing to put back
        try:
            _add_valid_ids(fd, out)
        finally:
            os.close(fd)
    return out


def _add_valid_ids(fd: int, out: PrefixSet) -> None:
    """The ids of the open stub ``fd`` if it is a valid index (nothing if it is not)."""
    found = PrefixSet()
    try:
        for _, ids in stubs.read_table(fd):
            found.add(ids)
    except (OSError, idx.IndexFormatError):
        return
    out.update(found)


@dataclass
class Candidates:
    """Mapped chunks no stub names: ``ids`` (``idarrays.ID`` rows, in id order) and their lengths."""

    ids: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


def _candidates(repo: Repository, named: Marks, report: GCReport) -> Candidates:
    """Mapped chunks no stub names; pins are subtracted under the lock. The map is read a page at
    a time in id order (its lock held per page) and checked against ``named``: memory is the marks,
    one page and the candidates. A row mapped since the walk began is no candidate (its save pins
    it until its stub is in place, which a catch-up reads; the next run looks at it)."""
    unmapped = named.unmapped.sorted()
    found = np.zeros(len(unmapped), bool)  # named ids outside the marks' map that the map has now
    ids, lengths = [], []
    for page, page_lengths in repo.store.mapped_pages():
        keys = idarrays.prefixes(page)
        at, hit = named.lookup(keys)
        hit[hit] = ~named.named[at[hit]]  # in the marks and not named
        ids.append(page[hit])
        lengths.append(page_lengths[hit])
        if len(unmapped):
            where = np.searchsorted(unmapped, keys)
            inside = where < len(unmapped)
            inside[inside] = unmapped[where[inside]] == keys[inside]
            found[where[inside]] = True
    missing = unmapped[~found]
    if len(missing):
        missing = missing[~idarrays.contains(_in_bucket(repo).sorted(), missing)]
    report.missing_chunks = len(missing)
    if not ids:
        return Candidates(np.empty(0, idarrays.ID), np.empty(0, np.int64))
    return Candidates(np.concatenate(ids), np.concatenate(lengths))


def _in_bucket(repo: Repository) -> PrefixSet:
    """Ids named by stubs the shared tier holds whole (their content is the version ``remote.db``
    says was synced): evicted or not yet fetched, not missing. Empty without a shared tier."""
    out = PrefixSet()
    for rel, sha in read_synced(repo.root).items():
        try:
            fd = stubs.open_stub(repo.path(rel))
        except OSError:
            continue
        try:
            if stubs.hash_stub(fd).digest() == sha:
                _add_valid_ids(fd, out)
        finally:
            os.close(fd)
    return out


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


# -- a collection of the changes -----------------------------------------------------------------


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


# -- packs ----------------------------------------------------------------------------------------


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


# -- in the daemon --------------------------------------------------------------------------------


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
