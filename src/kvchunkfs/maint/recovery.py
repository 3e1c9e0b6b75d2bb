"""Crash recovery: bring a store back to a consistent state before it is served.

Packs are the truth, the map is a cache. Every pack describes its chunks (``packformat``: a record
before each batch), written before the batch's map rows, and the map keeps each pack's committed
end (table ``packs``). A crash therefore leaves at most

* a described batch past a pack's committed end (written, not committed) -> added to the map
  (GC frees it if no stub names it: recovery cannot tell it from a batch an older map forgot);
* bytes past the last complete chunk a pack describes (a torn batch, junk) -> cut;
* packs that describe nothing (a pack created, then cut by a crash) -> deleted;
* staging copies and half-written temp stubs under ``staging/`` and ``tmp/`` -> deleted;
* committed chunks no stub names (the save died before its rename) -> left to GC.

The same catching-up rebuilds a map that is missing (a new empty map knows no pack, so every pack
is scanned), unreadable (moved aside first, see ``prepare_map_file``) or older than the packs
(packs past their committed end, packs it does not know). Chunks a stub names that the map still
lacks are looked for in every pack's records and re-mapped if their bytes hash right. Recovery
never deletes a pack that describes a chunk; whole unused packs are GC's job, from a map caught up
with the packs. Legacy packs (no records) are known only through the map: one the map does not
know is never touched.

Map rows that point past the end of their pack or into a missing pack are damage, not crash
leftovers. Unless a pack describes the chunk elsewhere they are dropped, so the store never claims
a chunk it cannot return (a later save of the same bytes stores it again), and every snapshot that
needs a chunk the store lacks, or whose index disagrees with the map about a chunk's length, is
reported. Such snapshots are not touched: opening or reading them fails with EIO.

Only one process may work on a store at a time: the daemon holds an flock on ``STORE/lock`` for
its lifetime, and offline tools (gc, fsck --repair) take the same lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvchunkfs.format import idarrays
from kvchunkfs.format import index as idx
from kvchunkfs.store import stubs
from kvchunkfs.store.layout import DB_NAME, file_size, fsync_dir
from kvchunkfs.store.packformat import PACK_HEADER_SIZE, Described, Scan, has_header, is_torn_header, scan
from kvchunkfs.store.packs import PackStore
from kvchunkfs.store.remotesync import read_synced
from kvchunkfs.store.repository import Repository, prev_rel

log = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    temp_files_removed: int = 0
    packs_truncated: int = 0
    tail_bytes_cut: int = 0
    rows_dropped: int = 0
    packs_removed: int = 0
    packs_scanned: int = 0  # packs the map did not know, or knew only up to an earlier end
    chunks_added: int = 0  # described chunks the map lacked (uncommitted batches, a lost or older map)
    chunks_rescued: int = 0  # chunks snapshots name that the map had lost, found in a pack's records
    legacy_unknown: int = 0  # packs without records the map does not know: kept untouched
    map_moved_aside: str = ""  # where an unreadable chunks.db went
    clean: bool = False  # the last daemon unmounted cleanly: only stubs changed since were checked
    snapshots: int = 0
    unreadable: list[str] = field(default_factory=list)  # stubs that are not a valid index
    skipped: list[str] = field(default_factory=list)  # entries under snapshots/ that are not snapshots
    missing: dict[str, int] = field(default_factory=dict)  # snapshot -> chunks it needs that are gone
    mismatched: dict[str, str] = field(default_factory=dict)  # snapshot -> how its index disagrees with the map
    in_bucket: dict[str, int] = field(default_factory=dict)  # snapshot -> chunks only the shared tier has
    restored: list[str] = field(default_factory=list)  # snapshots whose save a power cut took back: previous version
    set_aside: dict[str, str] = field(default_factory=dict)  # after a crash: unreadable snapshot -> where it went
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        clean = " after a clean unmount" if self.clean else ""
        return (
            f"recovery{clean}: {self.snapshots} snapshots checked, {self.temp_files_removed} temp files removed, "
            f"{self.packs_truncated} pack tails cut ({self.tail_bytes_cut} bytes), {self.packs_removed} unused packs "
            f"removed, {self.rows_dropped} map rows dropped, {self.packs_scanned} packs scanned "
            f"({self.chunks_added} chunks added to the map, {self.chunks_rescued} rescued), "
            f"{self.legacy_unknown} unknown legacy packs kept, {len(self.unreadable)} unreadable, "
            f"{len(self.missing)} incomplete and {len(self.mismatched)} inconsistent snapshots, "
            f"{len(self.skipped)} entries skipped, {len(self.restored)} previous versions restored, "
            f"{len(self.set_aside)} set aside in lost+found, {self.duration_s:.2f}s"
        )


def prepare_map_file(root: Path) -> str:
    """Before the map is opened (store lock held): move aside what SQLite must not open.

    An unreadable chunks.db is renamed, never deleted (recovery rebuilds the map from the packs);
    a WAL left without its database is renamed too, or SQLite would replay it into the new, empty
    one. Returns where a moved database went, or "".
    """
    db = root / DB_NAME
    wal, shm = db.with_name(DB_NAME + "-wal"), db.with_name(DB_NAME + "-shm")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if not db.exists():
        for path in (wal, shm):
            if path.exists():
                os.rename(path, path.with_name(f"{path.name}.orphan-{stamp}"))
                log.warning("%s has no database: moved aside", path)
        return ""
    error = _unreadable(db)
    if error is None:
        return ""
    aside = db.with_name(f"{DB_NAME}.unreadable-{stamp}")
    for path in (db, wal, shm):
        if path.exists():
            os.rename(path, path.with_name(aside.name + path.name[len(DB_NAME) :]))
    log.error("%s is unreadable (%s): moved to %s; the map is rebuilt from the packs", db, error, aside)
    return str(aside)


def _unreadable(db: Path) -> str | None:
    try:
        con = sqlite3.connect(db)
    except sqlite3.DatabaseError as e:
        return str(e)
    try:
        con.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return None
    except sqlite3.OperationalError:  # e.g. locked: not a reason to move a database aside
        raise
    except sqlite3.DatabaseError as e:
        return str(e)
    finally:
        con.close()


def recover(repo: Repository, moved_aside: str = "") -> RecoveryReport:
    """Undo what a crash left behind; call with the store lock held, before serving."""
    start = time.monotonic()
    report = RecoveryReport(map_moved_aside=moved_aside)
    # Taken (cleared, durably) before anything else: a crash from here on is not a clean unmount.
    unmounted = repo.store.take_clean_mark()
    checked_at = repo.store.get_meta(_CHECKED_AT)
    report.clean = unmounted is not None
    now = time.time()
    report.temp_files_removed = clean_temp_dirs(repo)
    repair_packs(repo.store, report)
    # Stubs changed since the clean unmount (or since the last check, after a crash) are checked;
    # every stub if the packs were damaged or the map is older or new.
    since = unmounted if unmounted is not None else float(checked_at) if checked_at else None
    if moved_aside or _packs_changed(report):
        report.clean, since = False, None
    check_snapshots(repo, report, since=None if since is None else since - _CLOCK_SLACK)
    # A crash: the last daemon did not unmount cleanly, and the map is the one it used (a lost,
    # new or moved-aside map has no marks: its stubs lack chunks the map forgot, not the disk).
    crashed = unmounted is None and checked_at is not None and not moved_aside
    resolve_damaged(repo, report, crashed=crashed)
    repo.store.set_meta(_CHECKED_AT, repr(now))  # every stub changed before now is checked
    report.duration_s = time.monotonic() - start
    log.info("%s", report.summary())
    return report


_CHECKED_AT = "snapshots_checked_at"
_CLOCK_SLACK = 5.0  # seconds: ctime comes from the kernel's coarse clock


def _packs_changed(report: RecoveryReport) -> bool:
    r = report
    return bool(r.rows_dropped or r.packs_truncated or r.packs_removed or r.packs_scanned or r.chunks_added
                or r.legacy_unknown)  # fmt: skip


def resolve_damaged(repo: Repository, report: RecoveryReport, crashed: bool) -> None:
    """After the checks: put back the previous version of a snapshot whose last save a power cut took
    back (kept in ``prev/``, durability=close), and after a crash set every snapshot that still
    cannot be read aside into ``lost+found/`` (reported by name; its name is free again), so the store
    fsck sees is clean instead of flagged at every mount. After a clean unmount, or with a map that
    is new or was moved aside, nothing is moved: the damage then is not a crash's doing (the map
    forgot chunks the packs may still give back), and stays for fsck --repair to mark."""
    damaged = set(report.unreadable) | set(report.missing) | set(report.mismatched)
    changed = False
    try:
        kept = list(os.scandir(repo.layout.prev))
    except FileNotFoundError:  # a store made before prev/ existed, opened read-only
        kept = []
    for entry in kept:
        rel = prev_rel(entry.name)
        if rel is not None and rel in damaged and repo.whole_stub(Path(entry.path)):
            os.rename(entry.path, repo.path(rel))
            damaged.discard(rel)
            _forget_damage(report, rel)
            report.restored.append(rel)
            log.warning("snapshot %s: its last save was lost with the power; the version before it is back", rel)
        elif rel is not None and _names_staged(repo, rel):
            continue  # its staged save may be lost (a reboot): the mount decides (``lose_staged``)
        else:  # the current version is whole, or the name was removed or renamed since
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(entry.path)
        changed = True
    if crashed:
        for rel in sorted(damaged):
            report.set_aside[rel] = _set_aside(repo, rel)
            _forget_damage(report, rel)
            log.error("snapshot %s cannot be read after a crash: set aside as %s", rel, report.set_aside[rel])
            changed = True
    if changed:  # the resolution survives the next power cut (it is redone if it does not)
        dirs = {repo.path(rel).parent for rel in [*report.restored, *report.set_aside]} | {repo.layout.prev}
        if report.set_aside:
            dirs.add(repo.layout.lost_found)
        for d in dirs:
            with contextlib.suppress(FileNotFoundError):
                fsync_dir(d)


def _names_staged(repo: Repository, rel: str) -> bool:
    """Whether the current stub of ``rel`` names a staged save (then its index may not be a version
    to fall back to: the version kept for it stays until the save is stored or lost)."""
    try:
        return repo.staged(rel) is not None
    except OSError:
        return False


def _forget_damage(report: RecoveryReport, rel: str) -> None:
    if rel in report.unreadable:
        report.unreadable.remove(rel)
    report.missing.pop(rel, None)
    report.mismatched.pop(rel, None)


def _set_aside(repo: Repository, rel: str) -> str:
    """Move the stub of ``rel`` into ``lost+found/`` (a name of its own); returns where it went."""
    lost = repo.layout.lost_found
    lost.mkdir(mode=0o700, exist_ok=True)
    name = rel.replace("%", "%25").replace("/", "%2F")
    if len(os.fsencode(name)) > 200:
        name = name[:100] + "..." + hashlib.sha256(os.fsencode(rel)).hexdigest()[:16]
    dest = lost / f"{name}.{time.strftime('%Y%m%dT%H%M%S')}.{os.urandom(4).hex()}"
    os.rename(repo.path(rel), dest)
    return str(dest)


def clean_temp_dirs(repo: Repository) -> int:
    """Remove staging copies and temp stubs: no open file survives a restart."""
    removed = 0
    for d in (repo.tmp, repo.staging):
        for entry in os.scandir(d):
            with contextlib.suppress(FileNotFoundError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed += 1
    return removed


def repair_packs(store: PackStore, report: RecoveryReport) -> None:
    """Catch the map up with the packs, then drop rows that point outside their pack."""
    sizes = {pack: file_size(store.pack_path(pack)) for pack in store.pack_ids()}
    ends = store.pack_ends()
    for pack in sorted(set(ends) - set(sizes)):
        store.forget_pack(pack)
    bad = _rows_outside(store, sizes)
    bad_ids = {cid for ids in bad.values() for cid in ids}
    for pack, size in sorted(sizes.items()):
        found = catch_up_pack(store, pack, size, ends.get(pack), bad_ids, report)
        bad_ids -= found
    for pack, ids in sorted(bad.items()):
        lost = [cid for cid in ids if cid in bad_ids]
        if not lost:
            continue
        if pack in sizes:
            size = sizes[pack]
            log.error("pack %d is %d bytes, shorter than the map says: dropping %d chunks", pack, size, len(lost))
        else:
            log.error("pack %d is missing: dropping its %d chunks from the map", pack, len(lost))
        report.rows_dropped += store.delete_chunks(lost)


def _rows_outside(store: PackStore, sizes: dict[int, int]) -> dict[int, list[bytes]]:
    """pack -> ids of rows that point into it although it is missing or too short."""
    out = {pack: store.rows_outside(pack, -1) for pack in set(store.mapped_packs()) - set(sizes)}
    for pack, size in sizes.items():
        past = store.rows_outside(pack, size)
        if past:
            out[pack] = past
    return out


def catch_up_pack(
    store: PackStore, pack: int, size: int, end: int | None, bad: set[bytes], report: RecoveryReport
) -> set[bytes]:
    """Map what ``pack`` describes past its committed ``end`` (all of it if the map does not know
    it), cut bytes that hold no complete chunk, delete it if it describes nothing; returns the
    ids of ``bad`` rows it re-mapped."""
    try:
        fd = os.open(store.pack_path(pack), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return set()
    try:
        head = os.pread(fd, PACK_HEADER_SIZE, 0)
        if not has_header(fd) and not is_torn_header(head) and pack < store.described_from:
            _legacy(pack, end, report)
            return set()
        start = PACK_HEADER_SIZE if end is None else max(end, PACK_HEADER_SIZE)
        if size <= start and end is not None:
            return set()
        found = _scan_from(fd, size, start)
    finally:
        os.close(fd)
    report.packs_scanned += 1
    if end is None and not found.chunks:
        store.adopt(pack, [], PACK_HEADER_SIZE)  # known now, so it can be removed
        if store.remove_pack(pack):
            report.packs_removed += 1
            log.info("removed pack %d: no chunk in it (%d bytes)", pack, size)
        return set()
    remapped = {c.id for c in found.chunks} & bad
    added = store.adopt(pack, found.chunks, found.end, replace=remapped)
    report.chunks_added += added
    if added:
        log.warning(
            "pack %d: added %d chunks it describes past the map's end (%s)",
            pack,
            added,
            "a pack the map did not know" if end is None else "a batch cut off before its commit, or an older map",
        )
    if size > found.end:
        _cut(store, pack, size, found.end, report)
    return remapped


def _scan_from(fd: int, size: int, start: int) -> Scan:
    """The records from ``start`` on; from the pack's start if ``start`` is not a batch boundary."""
    found = scan(fd, size, start)
    if found.end == start and size > start > PACK_HEADER_SIZE:
        full = scan(fd, size)
        if full.end > start:
            return Scan(start, full.end, [c for c in full.chunks if c.offset >= start], full.record_bytes)
    return found


def _cut(store: PackStore, pack: int, size: int, end: int, report: RecoveryReport) -> None:
    store.truncate_pack(pack, end)
    report.packs_truncated += 1
    report.tail_bytes_cut += size - end
    log.info("pack %d: cut %d bytes past its last complete batch (a torn write)", pack, size - end)


def _legacy(pack: int, end: int | None, report: RecoveryReport) -> None:
    if end is None:
        report.legacy_unknown += 1
        log.warning(
            "pack %d has no batch records (written before packs described themselves) and the map does not "
            "know it: kept untouched; only a chunks.db that knows it can use it",
            pack,
        )


def check_snapshots(
    repo: Repository, report: RecoveryReport, rescue_marked: bool = False, since: float | None = None
) -> None:
    """Report every snapshot that cannot be read in full (never served as zeros: reads fail).

    ``since``: only stubs changed (ctime) since then; older ones were checked by an earlier recovery,
    and a crash changes no map row an older stub names (rows are committed before the stub's rename
    and only GC deletes them; eviction only those of chunks the bucket has).

    Chunks a snapshot names that the map lacks are first looked for in the packs' records (not
    for snapshots fsck already marked broken, unless ``rescue_marked``: it looked for them then),
    unless the stub is the version this host synced with the bucket (``remote.db``): then they
    are in the bucket (evicted under ``local_cache_size``, or not fetched yet) and not lost.
    """
    # A few changed stubs: look up their chunks; all of them: read the whole map once (as arrays).
    mapped = _Mapped(repo.store, whole=since is None)
    synced = read_synced(repo.root)  # with a shared tier: stubs whose chunks are all in the bucket
    missing: dict[str, np.ndarray] = {}
    wanted: list[np.ndarray] = []
    for entry in stubs.walk(repo.snapshots):
        rel = entry.rel
        if entry.skipped is not None:  # named, never opened: a FIFO would block, a symlink lead out
            report.skipped.append(entry.problem())
            log.warning("not a snapshot, skipped: %s", entry.problem())
            continue
        if since is not None and entry.ctime_ns < since * 1e9:
            continue
        report.snapshots += 1
        try:
            if entry.error is not None:
                raise entry.error
            fd = entry.open()
            try:
                lacking = _check_stub(fd, rel, mapped, report)
                marked = _is_marked(fd)
                in_bucket = len(lacking) and rel in synced and stubs.hash_stub(fd).digest() == synced[rel]
            finally:
                os.close(fd)
        except FileNotFoundError:
            continue
        except OSError as e:
            report.unreadable.append(rel)
            log.error("snapshot %s is unreadable: %s", rel, e)
            continue
        if in_bucket:
            report.in_bucket[rel] = len(lacking)  # evicted or not fetched yet: the next open fetches them
        elif len(lacking):
            missing[rel] = lacking
            if rescue_marked or not marked:
                wanted.append(lacking)
    if report.in_bucket:
        log.info("%d snapshots have chunks only in the shared tier (fetched when opened)", len(report.in_bucket))
    rescued: dict[bytes, int] = {}
    if wanted:
        rescued = rescue_chunks(repo.store, {cid for part in wanted for cid in idarrays.to_list(part)}, report)
    for rel, lacking in sorted(missing.items()):
        lost = [cid for cid in idarrays.to_list(lacking) if cid not in rescued]
        if lost:
            report.missing[rel] = len(lost)
            log.error(
                "snapshot %s needs %d chunks the store does not have (e.g. %s); reads of it fail with EIO",
                rel,
                len(lost),
                lost[0].hex(),
            )


class _Mapped:
    """The lengths the map gives chunks: every row read once into sorted arrays (36 bytes a chunk,
    when every stub is checked), or each piece of a stub looked up (a few changed stubs)."""

    def __init__(self, store: PackStore, whole: bool) -> None:
        self.store = store
        self.ids: np.ndarray | None = None
        if not whole:
            return
        ids = np.empty(store.stats()[0], idarrays.ID)  # pages come in id order: filled in place
        lens = np.empty(len(ids), np.uint32)
        n = 0
        for page, page_lens in store.mapped_pages():
            if n + len(page) > len(ids):  # rows the count missed: room for them
                ids, lens = idarrays.grown(ids, n, n + len(page)), idarrays.grown(lens, n, n + len(page))
            if len(page_lens) and int(page_lens.max()) >= 1 << 32 and lens.dtype != np.int64:
                lens = lens.astype(np.int64)
            ids[n : n + len(page)] = page
            lens[n : n + len(page)] = page_lens
            n += len(page)
        self.ids, self.lens = ids[:n], lens[:n]

    def lengths(self, ids: np.ndarray) -> np.ndarray:
        """The map's length of each id (int64), -1 for ids it lacks."""
        if self.ids is None:
            found = self.store.locate_many(idarrays.to_list(ids))
            return np.array([found[c].length if c in found else -1 for c in idarrays.to_list(ids)], np.int64)
        at = np.searchsorted(self.ids, ids)
        hit = at < len(self.ids)
        hit[hit] = self.ids[at[hit]] == ids[hit]
        out = np.full(len(ids), -1, np.int64)
        out[hit] = self.lens[at[hit]]
        return out


def _check_stub(fd: int, rel: str, mapped: _Mapped, report: RecoveryReport) -> np.ndarray:
    """Check the open stub ``fd`` against the map a piece of its index at a time; returns the
    distinct ids it names that the map lacks. A chunk whose length the map gives otherwise is
    reported (the first one). OSError (``StubError``) if it is not a valid index."""
    lacking: list[np.ndarray] = []
    first = end = 0
    mismatch: tuple[int, bytes, int, int] | None = None  # reported once the whole index checks out
    try:
        for ends, ids in stubs.read_table(fd):
            lens = np.diff(ends, prepend=np.uint64(end)).astype(np.int64)
            have = mapped.lengths(ids)
            bad = np.flatnonzero((have >= 0) & (have != lens)) if mismatch is None else np.empty(0, np.int64)
            if len(bad):
                at = int(bad[0])
                mismatch = (first + at, ids[at].tobytes(), int(lens[at]), int(have[at]))
            if (have < 0).any():
                lacking.append(np.unique(ids[have < 0]))
            first, end = first + len(ends), int(ends[-1])
    except idx.IndexFormatError as e:
        raise stubs.StubError(f"{rel}: {e}") from e
    size = stubs.stub_size(fd)
    if size is not None and size != end:
        raise stubs.StubError(f"{rel}: size xattr {size} does not match index size {end}")
    if mismatch is not None:
        _report_mismatch(rel, *mismatch, report)
    if not lacking:
        return np.empty(0, idarrays.ID)
    return np.unique(np.concatenate(lacking))


def _report_mismatch(rel: str, i: int, cid: bytes, length: int, mapped: int, report: RecoveryReport) -> None:
    why = f"chunk {i} ({cid.hex()}) is {length} bytes in the index, {mapped} in the map"
    report.mismatched[rel] = why
    log.error("snapshot %s disagrees with the map: %s; opening it fails with EIO", rel, why)


def _is_marked(fd: int) -> bool:
    try:
        return stubs.BROKEN in os.listxattr(fd)
    except OSError:
        return False


def rescue_chunks(store: PackStore, wanted: set[bytes], report: RecoveryReport) -> dict[bytes, int]:
    """Look for ``wanted`` chunks in every pack's records; map each copy whose bytes hash right.

    Reads the records of all packs: only when a snapshot names a chunk the map lacks.
    """
    rescued: dict[bytes, int] = {}
    left = set(wanted)
    for pack in store.pack_ids():
        if not left:
            break
        good = _good_copies(store, pack, left)
        if good:
            store.adopt(pack, good, PACK_HEADER_SIZE)
            for c in good:
                rescued[c.id] = c.length
                left.discard(c.id)
    if rescued:
        report.chunks_rescued += len(rescued)
        log.warning("re-mapped %d chunks that snapshots name from their packs' records", len(rescued))
    return rescued


def _hashes_right(fd: int, c: Described) -> bool:
    return hashlib.sha256(os.pread(fd, c.length, c.offset)).digest() == c.id


def _good_copies(store: PackStore, pack: int, wanted: set[bytes]) -> list[Described]:
    try:
        fd = os.open(store.pack_path(pack), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        if not has_header(fd):
            return []
        good: dict[bytes, Described] = {}
        for c in scan(fd, os.fstat(fd).st_size).chunks:
            if c.id in wanted and c.id not in good and _hashes_right(fd, c):
                good[c.id] = c
        return list(good.values())
    finally:
        os.close(fd)
