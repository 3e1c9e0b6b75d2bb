"""Crash recovery: bring a store back to its last committed state before it is served.

A save writes in this order (docs/design.md, "Crash safety"): pack data, map commit, stub temp
file, rename. A crash therefore leaves at most

* pack bytes after the last committed chunk (a batch written but not committed) -> truncated;
* packs no map row points into (GC dropped the rows, then died before unlinking) -> deleted;
* staging copies and half-written temp stubs under ``staging/`` and ``tmp/`` -> deleted;
* committed chunks no stub names (the save died before its rename) -> left to GC.

Map rows that point past the end of their pack or into a missing pack are not crash leftovers
(the map is only committed after the bytes are written) but damage, e.g. a truncated pack or data
lost to a power failure with ``durability = close``. They are dropped, so the store never claims
to have a chunk it cannot return (a later save of the same bytes stores them again), and every
snapshot that needs a chunk the store lacks is reported. Such snapshots are not touched: reads of
them fail with EIO.

Only one process may work on a store at a time: the daemon holds an flock on ``STORE/lock`` for
its lifetime, and offline tools (gc, fsck --repair) take the same lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import stubs
from .gc import walk_stubs
from .packstore import PackStore
from .repo import Repository

log = logging.getLogger(__name__)

LOCK_NAME = "lock"


class StoreLocked(RuntimeError):
    """Another process (a mounted daemon or an offline tool) holds the store."""


def lock_store(root: Path) -> int:
    """Take the store's lock for this process; returns the fd to keep open (closing it unlocks)."""
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with contextlib.suppress(OSError):  # made 0644 by older versions
        os.fchmod(fd, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StoreLocked(f"store {root} is in use by another kv-chunk-fs process (pid {holder})") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def try_lock_store(root: Path) -> int | None:
    """The lock fd, or None if a daemon (or another tool) holds the store."""
    try:
        return lock_store(root)
    except StoreLocked:
        return None


@dataclass
class RecoveryReport:
    temp_files_removed: int = 0
    packs_truncated: int = 0
    tail_bytes_cut: int = 0
    rows_dropped: int = 0
    packs_removed: int = 0
    snapshots: int = 0
    unreadable: list[str] = field(default_factory=list)  # stubs that are not a valid index
    skipped: list[str] = field(default_factory=list)  # entries under snapshots/ that are not snapshots
    missing: dict[str, int] = field(default_factory=dict)  # snapshot -> chunks it needs that are gone
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return (
            f"recovery: {self.snapshots} snapshots checked, {self.temp_files_removed} temp files removed, "
            f"{self.packs_truncated} pack tails cut ({self.tail_bytes_cut} bytes), {self.packs_removed} unused packs "
            f"removed, {self.rows_dropped} map rows dropped, {len(self.unreadable)} unreadable and "
            f"{len(self.missing)} incomplete snapshots, {len(self.skipped)} entries skipped, {self.duration_s:.2f}s"
        )


def recover(repo: Repository) -> RecoveryReport:
    """Undo what a crash left behind; call with the store lock held, before serving."""
    start = time.monotonic()
    report = RecoveryReport()
    report.temp_files_removed = clean_temp_dirs(repo)
    repair_packs(repo.store, report)
    check_snapshots(repo, report)
    report.duration_s = time.monotonic() - start
    log.info("%s", report.summary())
    return report


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
    """Drop rows that point outside their pack, then cut unmapped tails and delete unused packs."""
    on_disk = set(store.pack_ids())
    for pack in sorted(set(store.pack_usage()) - on_disk):
        ids = store.rows_outside(pack, -1)
        log.error("pack %d is missing: dropping its %d chunks from the map", pack, len(ids))
        report.rows_dropped += store.delete_chunks(ids)
    sizes = {pack: _size(store.pack_path(pack)) for pack in on_disk}
    for pack, size in sorted(sizes.items()):
        past = store.rows_outside(pack, size)
        if past:
            log.error("pack %d is %d bytes, shorter than the map says: dropping %d chunks", pack, size, len(past))
            report.rows_dropped += store.delete_chunks(past)
    usage = store.pack_usage()
    for pack, size in sorted(sizes.items()):
        end = usage[pack][2] if pack in usage else 0
        if end == 0:
            if store.remove_pack(pack):
                report.packs_removed += 1
                log.info("removed pack %d: no committed chunk in it (%d bytes)", pack, size)
        elif size > end:
            store.truncate_pack(pack, end)
            report.packs_truncated += 1
            report.tail_bytes_cut += size - end
            log.info("pack %d: cut %d bytes written after its last committed chunk", pack, size - end)


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except FileNotFoundError:
        return 0


def check_snapshots(repo: Repository, report: RecoveryReport) -> None:
    """Report every snapshot that cannot be read in full (never served as zeros: reads fail)."""
    mapped = repo.store.chunk_lengths()
    for entry in walk_stubs(repo.snapshots):
        rel = entry.rel
        if entry.skipped is not None:  # named, never opened: a FIFO would block, a symlink lead out
            report.skipped.append(entry.problem())
            log.warning("not a snapshot, skipped: %s", entry.problem())
            continue
        report.snapshots += 1
        try:
            if entry.error is not None:
                raise entry.error
            fd = entry.open()
            try:
                index = stubs.read_index(fd)
            finally:
                os.close(fd)
        except FileNotFoundError:
            continue
        except OSError as e:
            report.unreadable.append(rel)
            log.error("snapshot %s is unreadable: %s", rel, e)
            continue
        missing = {cid for cid in index.ids if cid not in mapped}
        if missing:
            report.missing[rel] = len(missing)
            log.error(
                "snapshot %s needs %d chunks the store does not have (e.g. %s); reads of it fail with EIO",
                rel,
                len(missing),
                next(iter(missing)).hex(),
            )
