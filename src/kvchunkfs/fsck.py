"""``kv-chunk-fs fsck``: check that every snapshot can be read back, and optionally repair the store.

Checks: every stub parses (index and size xattr); every chunk it names is mapped and lies inside
its pack; map rows do not overlap; no pack has bytes after its last mapped chunk and no pack is
unused (crash leftovers, normally removed by recovery at mount); no temp or staging files are left.
``--verify-data`` re-hashes every mapped chunk (SHA-256 = id).

Informational, not problems: garbage (mapped chunks no snapshot names) and slack (dead bytes
inside packs GC has not compacted, and packs no chunk is mapped to): GC's job.

``--repair`` (store not mounted): removes temp files, drops map rows that point outside their pack
(or, with --verify-data, at corrupt bytes), cuts unmapped pack tails, deletes unused packs, marks
damaged snapshots with the xattr ``user.kvcfs.broken`` (never deletes them: what is intact stays
readable through an export or a later save of the same bytes), and runs GC with threshold 1, which
removes unreferenced rows and compacts every pack with unmapped bytes.

On a mounted store fsck checks read-only and skips what a running daemon legitimately has in
flight (pack tails, unused packs, temp files, garbage); a stub that fails is read again in case it
was replaced meanwhile.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import index as idx
from . import stubs
from .gc import run_gc, salvage_ids, walk_stubs
from .recovery import RecoveryReport, clean_temp_dirs, repair_packs, try_lock_store
from .repo import Repository

READ_SPAN = 4 << 20
LIVE_RETRIES = 3


@dataclass
class FsckReport:
    snapshots: int = 0
    chunks: int = 0
    chunk_bytes: int = 0
    packs: int = 0
    pack_bytes: int = 0
    bytes_verified: int = 0
    garbage_chunks: int = 0
    garbage_bytes: int = 0
    slack_bytes: int = 0  # pack bytes no chunk maps, inside packs or in unused ones (GC's job)
    unused_packs: int = 0
    problems: list[str] = field(default_factory=list)
    broken: dict[str, str] = field(default_factory=dict)  # snapshot -> why it cannot be read in full
    repaired: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # entries under snapshots/ that are not snapshots
    live: bool = False  # checked while a daemon serves the store
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        text = (
            f"fsck: {self.snapshots} snapshots, {self.chunks} chunks ({self.chunk_bytes} bytes) in {self.packs} packs "
            f"({self.pack_bytes} bytes): {len(self.problems)} problems, {len(self.broken)} broken snapshots"
        )
        if self.bytes_verified:
            text += f", {self.bytes_verified} bytes verified"
        if not self.live:
            text += f"; garbage {self.garbage_chunks} chunks ({self.garbage_bytes} bytes)"
        text += f", slack {self.slack_bytes} bytes ({self.unused_packs} unused packs)"
        if self.skipped:
            text += f"; {len(self.skipped)} entries that are not snapshots skipped"
        if self.repaired:
            text += f"; {len(self.repaired)} repairs"
        if self.live:
            text += " (mounted: read-only check)"
        return text + f"; {self.duration_s:.2f}s"


class Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0

    def show(self, label: str, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and done < total):
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{label:<8} [{bar:<30}] {100 * frac:5.1f}%")
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 50 + "\r")
            sys.stderr.flush()


@dataclass
class _Row:
    pack: int
    offset: int
    length: int


class _Checker:
    def __init__(self, root: Path, db: sqlite3.Connection, live: bool, progress: Progress) -> None:
        self.root = root
        self.db = db
        self.live = live
        self.progress = progress
        self.report = FsckReport(live=live)
        self.rows: dict[bytes, _Row] = {}
        self.bad: dict[bytes, str] = {}  # chunk id -> why it cannot be read
        self.referenced: set[bytes] = set()

    def pack_path(self, pack: int) -> Path:
        return self.root / "packs" / f"{pack:08d}.pack"

    # -- map and packs ------------------------------------------------------------------------

    def check_map(self) -> None:
        by_pack: dict[int, list[tuple[bytes, int, int]]] = defaultdict(list)
        for cid, pack, off, n in self.db.execute("SELECT id, pack, offset, length FROM chunks ORDER BY pack, offset"):
            by_pack[pack].append((cid, off, n))
            self.rows[cid] = _Row(pack, off, n)
        self.report.chunks = len(self.rows)
        self.report.chunk_bytes = sum(r.length for r in self.rows.values())
        packs = [p for p in (self.root / "packs").glob("*.pack") if p.name[:-5].isascii() and p.name[:-5].isdigit()]
        sizes = {int(p.name[:-5]): _size(p) for p in packs}
        on_disk = {pack: size for pack, size in sizes.items() if size is not None}  # GC may delete meanwhile
        self.report.packs = len(on_disk)
        self.report.pack_bytes = sum(on_disk.values())
        for pack in sorted(set(by_pack) | set(on_disk)):
            problems = self._check_pack(pack, by_pack.get(pack, []), on_disk.get(pack))
            if problems and self.live:  # GC may have moved or deleted it meanwhile: look again
                problems = self._check_pack(pack, self._pack_rows(pack), _size(self.pack_path(pack)))
            self.report.problems += problems

    def _pack_rows(self, pack: int) -> list[tuple[bytes, int, int]]:
        q = "SELECT id, offset, length FROM chunks WHERE pack = ? ORDER BY offset"
        return self.db.execute(q, (pack,)).fetchall()

    def _check_pack(self, pack: int, rows: list[tuple[bytes, int, int]], size: int | None) -> list[str]:
        if not rows:  # e.g. the open pack of a daemon that stopped after GC emptied it
            if size is not None:
                self.report.unused_packs += 1
                self.report.slack_bytes += size
            return []
        if size is None:
            for cid, _, _ in rows:
                self.bad[cid] = f"pack {pack} is missing"
            return [f"pack {pack} is missing: {len(rows)} mapped chunks lost"]
        problems = []
        past = [cid for cid, off, n in rows if off + n > size]
        for cid in past:
            self.bad[cid] = f"lies past the end of pack {pack} ({size} bytes)"
        if past:
            problems.append(f"pack {pack}: {len(past)} chunks lie past its end ({size} bytes)")
        overlaps = sum(1 for (_, a, n), (_, b, _) in zip(rows, rows[1:], strict=False) if b < a + n)
        if overlaps:
            problems.append(f"pack {pack}: {overlaps} chunks overlap the previous one")
        end = max(off + n for _, off, n in rows)
        if size > end and not self.live:
            problems.append(f"pack {pack}: {size - end} bytes after its last mapped chunk (uncommitted tail)")
        self.report.slack_bytes += max(0, min(end, size) - sum(n for _, _, n in rows))
        return problems

    def verify_data(self) -> None:
        total = self.report.chunk_bytes
        by_pack: dict[int, list[tuple[bytes, _Row]]] = defaultdict(list)
        for cid, row in self.rows.items():
            if cid not in self.bad:
                by_pack[row.pack].append((cid, row))
        for pack, items in sorted(by_pack.items()):
            items.sort(key=lambda item: item[1].offset)
            try:
                fd = os.open(self.pack_path(pack), os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:  # compacted by a running daemon meanwhile
                continue
            try:
                self._verify_pack(fd, pack, items, total)
            finally:
                os.close(fd)
        self.progress.done()

    def _verify_pack(self, fd: int, pack: int, items: list[tuple[bytes, _Row]], total: int) -> None:
        i = 0
        while i < len(items):
            first = items[i][1].offset
            j = i
            while j < len(items) and items[j][1].offset + items[j][1].length - first <= READ_SPAN:
                j += 1
            j = max(j, i + 1)
            span = items[j - 1][1].offset + items[j - 1][1].length - first
            data = memoryview(os.pread(fd, span, first))
            for cid, row in items[i:j]:
                piece = data[row.offset - first : row.offset - first + row.length]
                if hashlib.sha256(piece).digest() != cid:
                    self.bad[cid] = f"fails its checksum (pack {pack} at {row.offset})"
                    self.report.problems.append(f"pack {pack}: chunk {cid.hex()} at {row.offset} fails its checksum")
                self.report.bytes_verified += row.length
            self.progress.show("verify", self.report.bytes_verified, total)
            i = j

    # -- snapshots ----------------------------------------------------------------------------

    def check_snapshots(self, snapshots: Path) -> None:
        total = sum(1 for _ in walk_stubs(snapshots)) if self.progress.enabled else 0
        for n, entry in enumerate(walk_stubs(snapshots), 1):
            rel = entry.rel
            if entry.skipped is not None:
                self.report.skipped.append(entry.problem())
                continue
            reason = self._check_stub(entry)
            for _ in range(LIVE_RETRIES if self.live and reason else 0):
                reason = self._check_stub(entry)  # replaced or deleted meanwhile?
                if not reason:
                    break
            if reason == "gone":
                continue
            self.report.snapshots += 1
            if reason:
                self.report.broken[rel] = reason
                self.report.problems.append(f"snapshot {rel}: {reason}")
            self.progress.show("stubs", n, max(n, total))
        self.progress.done()

    def _check_stub(self, entry: stubs.Entry) -> str | None:
        try:
            if entry.error is not None:
                raise entry.error
            data, size = entry.read()
            index = idx.decode(data)
        except FileNotFoundError:
            return "gone"
        except idx.IndexFormatError as e:
            self.referenced.update(salvage_ids(data))
            return f"not a valid index: {e}"
        except OSError as e:
            return f"cannot be read: {e}"
        self.referenced.update(index.ids)
        if size != index.size:
            return f"size xattr {size} does not match the index ({index.size} bytes)"
        return self._chunk_problems(index)

    def _chunk_problems(self, index: idx.Index) -> str | None:
        missing: list[int] = []
        damaged: list[int] = []
        for i, cid in enumerate(index.ids):
            if cid not in self.rows and not self._mapped_now(cid):
                missing.append(i)
            elif cid in self.bad:
                damaged.append(i)
        if not missing and not damaged:
            return None
        parts = []
        if missing:
            i = missing[0]
            parts.append(f"{len(missing)} chunks not in the store (first at {index.start(i)}: {index.ids[i].hex()})")
        if damaged:
            i = damaged[0]
            cid = index.ids[i]
            parts.append(f"{len(damaged)} chunks damaged (first at {index.start(i)}: {cid.hex()} {self.bad[cid]})")
        return f"{len(index)} chunks, " + ", ".join(parts)

    def _mapped_now(self, cid: bytes) -> bool:
        """On a mounted store a save may have added the chunk after the map was read."""
        if not self.live:
            return False
        row = self.db.execute("SELECT pack, offset, length FROM chunks WHERE id = ?", (cid,)).fetchone()
        if row is not None:
            self.rows[cid] = _Row(*row)
        return row is not None

    # -- what is left over --------------------------------------------------------------------

    def check_leftovers(self) -> None:
        for name in ("tmp", "staging"):
            d = self.root / name
            left = list(d.iterdir()) if d.is_dir() else []
            if left:
                self.report.problems.append(f"{len(left)} leftover files in {d}")
        garbage = [r.length for cid, r in self.rows.items() if cid not in self.referenced]
        self.report.garbage_chunks = len(garbage)
        self.report.garbage_bytes = sum(garbage)


def _size(path: Path) -> int | None:
    try:
        return path.lstat().st_size
    except FileNotFoundError:
        return None


def check(
    root: Path, verify_data: bool = False, live: bool = False, progress: bool = False
) -> tuple[FsckReport, _Checker]:
    """Read-only check of the store at ``root``; ``live``: a daemon serves it."""
    start = time.monotonic()
    db_path = root / "chunks.db"
    if not db_path.exists():
        raise FileNotFoundError(f"no store at {root} (no chunks.db)")
    db = sqlite3.connect(db_path)
    try:
        checker = _Checker(root, db, live, Progress(progress))
        checker.check_map()
        if verify_data:
            checker.verify_data()
        checker.check_snapshots(root / "snapshots")
        if not live:
            checker.check_leftovers()
    finally:
        db.close()
    checker.report.duration_s = time.monotonic() - start
    return checker.report, checker


def repair(repo: Repository, checker: _Checker) -> None:
    """Fix what ``check`` found; the store lock must be held and no daemon may serve the store."""
    report = checker.report
    n = clean_temp_dirs(repo)
    if n:
        report.repaired.append(f"removed {n} leftover temp/staging files")
    rec = RecoveryReport()
    repair_packs(repo.store, rec)
    if rec.rows_dropped or rec.packs_truncated or rec.packs_removed:
        report.repaired.append(
            f"dropped {rec.rows_dropped} map rows outside their pack, cut {rec.packs_truncated} pack tails "
            f"({rec.tail_bytes_cut} bytes), removed {rec.packs_removed} unused packs"
        )
    corrupt = [cid for cid, why in checker.bad.items() if "checksum" in why]
    if corrupt:
        repo.store.delete_chunks(corrupt)
        report.repaired.append(
            f"dropped {len(corrupt)} corrupt chunks from the map (a save of the same bytes restores them)"
        )
    _mark_broken(repo, report)
    gc_report = run_gc(repo, threshold=1.0)
    if gc_report.chunks_freed or gc_report.disk_bytes_freed:
        report.repaired.append(
            f"removed {gc_report.chunks_freed} unreferenced chunks, deleted {gc_report.packs_deleted} and compacted "
            f"{gc_report.packs_compacted} packs ({gc_report.disk_bytes_freed} bytes of unmapped pack space freed)"
        )
    report.repaired += [f"gc: {e}" for e in gc_report.errors]


def _mark_broken(repo: Repository, report: FsckReport) -> None:
    for entry in walk_stubs(repo.snapshots):
        if entry.kind != "file":
            continue
        rel = entry.rel
        try:
            fd = entry.open()
        except OSError as e:
            report.repaired.append(f"could not mark snapshot {rel}: {e}")
            continue
        try:
            reason = report.broken.get(rel)
            if reason is not None:
                os.setxattr(fd, stubs.BROKEN, reason.encode())
                report.repaired.append(f"marked snapshot {rel} broken")
            elif _is_marked(fd):
                os.removexattr(fd, stubs.BROKEN)
                report.repaired.append(f"snapshot {rel} reads fine again: broken mark removed")
        finally:
            os.close(fd)


def _is_marked(fd: int) -> bool:
    with contextlib.suppress(OSError):
        return stubs.BROKEN in os.listxattr(fd)
    return False


def run_fsck(
    root: Path, verify_data: bool = False, do_repair: bool = False, progress: bool = False, cfg: Any = None
) -> FsckReport:
    """Check (and with ``do_repair`` fix) the store; a mounted store is only checked."""
    lock_fd = try_lock_store(root) if (root / "chunks.db").exists() else None
    live = lock_fd is None
    try:
        if do_repair and live:
            raise RuntimeError(f"store {root} is mounted (or locked by another tool); unmount it to repair")
        report, checker = check(root, verify_data, live, progress)
        if do_repair:
            repo = _open_repo(root, cfg)
            try:
                repair(repo, checker)
            finally:
                repo.close()
        return report
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def _open_repo(root: Path, cfg: Any) -> Repository:
    if cfg is None:
        return Repository(root)
    from .cli import open_repo

    return open_repo(cfg)


def main_fsck(cfg: Any, args: Any) -> int:
    """``kv-chunk-fs fsck``: exit 0 if the store is clean, 1 if problems were found, 2 if it could not run."""
    root = Path(cfg.store)
    try:
        report = run_fsck(root, args.verify_data, args.repair, progress=True, cfg=cfg)
    except (OSError, RuntimeError) as e:
        print(f"kv-chunk-fs: fsck: {e}", file=sys.stderr)
        return 2
    for line in report.problems:
        print(f"problem: {line}")
    for line in report.repaired:
        print(f"repaired: {line}")
    for line in report.skipped:
        print(f"skipped: {line}")
    print(report.summary())
    return 1 if report.problems else 0
