"""GC's marks: which mapped chunks the stubs name.

A walk reads every stub under ``snapshots/`` and marks the ids it names against the map as it is
when the walk begins (``Marks``); the stubs namespace changes created during the walk are read
after it (``created_entries``). The versions kept for a power cut (``kept_ids``) and the stubs the
shared tier holds whole count as named too. What is mapped and not named is a candidate
(``find_candidates``) for the sweep (maint/gcsweep.py)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvchunkfs.format import idarrays
from kvchunkfs.format import index as idx
from kvchunkfs.format.idarrays import PrefixSet
from kvchunkfs.maint.gcreport import GCReport
from kvchunkfs.store import stubs
from kvchunkfs.store.chunkstore import PruneStore
from kvchunkfs.store.remotesync import read_synced
from kvchunkfs.store.repository import Repository

log = logging.getLogger(__name__)

MAX_CATCH_UPS = 20  # rounds of reading what renames created during the walk before giving up
_ITEMS_AT = 64  # where a caibx item table starts: 48-byte header + 16-byte table header
_ITEM = 40


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


def add_created(repo: Repository, paths: list[str], named: Marks, report: GCReport) -> None:
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


def find_candidates(repo: Repository, named: Marks, report: GCReport) -> Candidates:
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
