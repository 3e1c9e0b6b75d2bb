"""``kv-chunk-fs fsck``: check that every snapshot can be read back, and optionally repair the store.

Checks: chunks.db is readable; every stub parses (index and size xattr); every chunk it names is
mapped, lies inside its pack and has the length the index gives it; map rows do not overlap and
agree with their pack's batch records; no pack has bytes after its last mapped chunk (crash
leftovers, normally handled by recovery at mount); no temp or staging files are left. A chunk a
snapshot names that the map lacks but a pack describes is a stale map (repairable), not damage.
Without ``--verify-data`` no chunk byte is read: a byte changed inside a pack goes unnoticed.
``--verify-data`` re-hashes every mapped chunk (SHA-256 = id) and puts back every snapshot that has
a file record (format/filerecord.py) to check its file checksum and its groups' checksums: that
catches what chunk ids cannot, chunks in a wrong order or groups put back with a wrong layout.
``--verify-data SUBSET`` (a fraction such as ``10%`` or a byte budget such as ``2GiB``) re-hashes
only that much, the packs in order from a random one, so routine runs cover the store over time
(no file is put back whole then).

Informational, not problems: garbage (mapped chunks no snapshot names) and slack (dead bytes
inside packs GC has not compacted, and packs no chunk is mapped to): GC's job. Batch records
are neither.

``--repair`` (store not mounted): moves an unreadable chunks.db aside, removes temp files, catches
the map up with the packs' records exactly as recovery does at mount (a missing map is rebuilt
whole), drops map rows that point outside their pack, disagree with its records or (with
--verify-data) at corrupt bytes, re-maps chunks snapshots name from any pack that describes them
(checksum verified), cuts pack bytes that hold no complete chunk, marks snapshots that still
cannot be read with the xattr ``user.kvcfs.broken`` (never deletes them: what is intact stays
readable through an export or a later save of the same bytes), and runs GC with threshold 1,
which removes unreferenced rows and compacts every pack with dead bytes. It never deletes a pack
that describes a chunk the map has not dropped as unreferenced.

On a mounted store fsck checks read-only and skips what a running daemon legitimately has in
flight (pack tails, unused packs, temp files, garbage); a stub that fails is read again in case it
was replaced meanwhile. ``kv-chunk-fs fsck`` then also compares the daemon's kept rows and
reference counts (what GC without a walk relies on) with a recount of every stub
(``service.catalog.compare_with_daemon``).
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvchunkfs.format import filerecord, relayout
from kvchunkfs.format import index as idx
from kvchunkfs.format.cutter import GROUP_WIDTH
from kvchunkfs.maint.gc import run_gc
from kvchunkfs.maint.gcmarks import salvage_ids, walk_stubs
from kvchunkfs.maint.recovery import (
    RecoveryReport,
    check_snapshots,
    clean_temp_dirs,
    prepare_map_file,
    repair_packs,
)
from kvchunkfs.store import stubs
from kvchunkfs.store.chunkmap import MapReader
from kvchunkfs.store.layout import Layout, try_lock_store
from kvchunkfs.store.packformat import PACK_HEADER_SIZE, has_header, is_torn_header, scan
from kvchunkfs.store.remotesync import read_synced
from kvchunkfs.store.repository import Repository
from kvchunkfs.units import parse_size

READ_SPAN = 4 << 20
LIVE_RETRIES = 3
DISAGREES = "disagrees with the records of pack"
REMAPPABLE = "the map lacks"


@dataclass
class FsckReport:
    snapshots: int = 0
    chunks: int = 0
    chunk_bytes: int = 0
    packs: int = 0
    pack_bytes: int = 0
    bytes_verified: int = 0
    files_verified: int = 0  # snapshots put back whole and checked against their file checksum
    garbage_chunks: int = 0
    garbage_bytes: int = 0
    slack_bytes: int = 0  # pack bytes no chunk maps, inside packs or in unused ones (GC's job)
    unused_packs: int = 0
    legacy_packs: int = 0  # packs without batch records (only the map knows what they hold)
    problems: list[str] = field(default_factory=list)
    broken: dict[str, str] = field(default_factory=dict)  # snapshot -> why it cannot be read in full
    marked: list[str] = field(default_factory=list)  # broken snapshots an earlier --repair marked so
    verify_subset: str = ""  # --verify-data SUBSET: which part was read
    repaired: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # entries under snapshots/ that are not snapshots
    in_bucket: dict[str, int] = field(default_factory=dict)  # snapshot -> chunks only the shared tier has
    live: bool = False  # checked while a daemon serves the store
    counts_compared: int = 0  # live: rows of the daemon's catalog compared with a recount of the stubs
    counts_skipped: str = ""  # live: why they were not compared
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
        if self.verify_subset:
            text += f" ({self.verify_subset})"
        if self.files_verified:
            text += f", {self.files_verified} files checked whole"
        if not self.live:
            text += f"; garbage {self.garbage_chunks} chunks ({self.garbage_bytes} bytes)"
        text += f", slack {self.slack_bytes} bytes ({self.unused_packs} unused packs)"
        if self.skipped:
            text += f"; {len(self.skipped)} entries that are not snapshots skipped"
        if self.in_bucket:
            text += f"; {len(self.in_bucket)} snapshots partly in the shared tier only (fetched when opened)"
        if self.repaired:
            text += f"; {len(self.repaired)} repairs"
        if self.live:
            text += " (mounted: read-only check; "
            if self.counts_skipped:
                text += f"the daemon's reference counts not compared: {self.counts_skipped})"
            else:
                text += f"the daemon's reference counts compared for {self.counts_compared} snapshots)"
        return text + f"; {self.duration_s:.2f}s"


ProgressFn = Callable[[str, int, int], None]  # (phase, done, total); the CLI draws it


@dataclass(frozen=True)
class Subset:
    """``--verify-data SUBSET``: a share of the chunk bytes (``10%``, ``0.1``) or a byte budget (``2GiB``)."""

    fraction: float | None = None
    max_bytes: int | None = None

    @classmethod
    def parse(cls, text: str) -> Subset:
        text = text.strip()
        try:
            if text.endswith("%"):
                fraction = float(text[:-1]) / 100
            elif "." in text and text.replace(".", "", 1).isdigit():
                fraction = float(text)
            else:
                return cls(max_bytes=parse_size(text))
        except ValueError as e:
            raise ValueError(f"--verify-data {text!r}: a share (10%, 0.1) or a byte budget (2GiB): {e}") from None
        if not 0 < fraction <= 1:
            raise ValueError(f"--verify-data {text!r}: a share must be above 0 and at most 100%")
        return cls(fraction=fraction)

    def budget(self, total: int) -> int:
        return self.max_bytes if self.max_bytes is not None else max(1, int(total * (self.fraction or 1.0)))


def _no_progress(label: str, done: int, total: int) -> None:
    pass


class Damage(enum.Enum):
    """Why a mapped chunk cannot be read back."""

    PACK_MISSING = "pack missing"
    PAST_END = "past the end of its pack"
    CORRUPT = "fails its checksum"
    DISAGREES = "the map disagrees with its pack's records"


@dataclass
class _Row:
    pack: int
    offset: int
    length: int


class _Checker:
    def __init__(self, layout: Layout, chunk_map: MapReader, live: bool, progress: ProgressFn) -> None:
        self.layout = layout
        self.root = layout.root
        self.map = chunk_map
        self.live = live
        self.progress = progress
        self.report = FsckReport(live=live)
        self.rows: dict[bytes, _Row] = {}
        self.bad: dict[bytes, tuple[Damage, str]] = {}  # chunk id -> why it cannot be read
        self.referenced: set[bytes] = set()
        self.described: dict[bytes, _Row] = {}  # offline: a place each described chunk is at
        self.records: dict[int, set[tuple[bytes, int, int]]] = {}  # described pack -> its chunks
        self.record_bytes: dict[int, int] = {}  # described pack -> bytes of header and records
        # Stubs synced with the bucket (remote.db): their unmapped chunks are in the bucket, not lost.
        self.synced = read_synced(layout.root)
        self.verify_files = False  # --verify-data: snapshots with a file record are put back whole
        # Bytes a cell of a stored group (chunker relayout): a record that does not list its groups
        # is parsed with it. None: the store's chunker is not known (an unreadable map).
        kind = chunk_map.meta("chunker")
        self.group_w: int | None = None if kind is None else GROUP_WIDTH if kind == "relayout" else 0

    def pack_path(self, pack: int) -> Path:
        return self.layout.pack_path(pack)

    # -- map and packs ------------------------------------------------------------------------

    def check_map(self) -> None:
        by_pack: dict[int, list[tuple[bytes, int, int]]] = defaultdict(list)
        for cid, pack, off, n in self.map.rows():
            by_pack[pack].append((cid, off, n))
            self.rows[cid] = _Row(pack, off, n)
        self.report.chunks = len(self.rows)
        self.report.chunk_bytes = sum(r.length for r in self.rows.values())
        sizes = {pack: _size(self.pack_path(pack)) for pack in self.layout.pack_ids()}
        on_disk = {pack: size for pack, size in sizes.items() if size is not None}  # GC may delete meanwhile
        self.report.packs = len(on_disk)
        self.report.pack_bytes = sum(on_disk.values())
        if not self.live:  # a running daemon appends to its open pack meanwhile
            for pack, size in sorted(on_disk.items()):
                self._read_records(pack, size)
        for pack in sorted(set(by_pack) | set(on_disk)):
            problems = self._check_pack(pack, by_pack.get(pack, []), on_disk.get(pack))
            if problems and self.live:  # GC may have moved or deleted it meanwhile: look again
                problems = self._check_pack(pack, self._pack_rows(pack), _size(self.pack_path(pack)))
            self.report.problems += problems

    def _read_records(self, pack: int, size: int) -> None:
        try:
            fd = os.open(self.pack_path(pack), os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            if not has_header(fd):
                self.report.legacy_packs += not is_torn_header(os.pread(fd, PACK_HEADER_SIZE, 0))
                return
            found = scan(fd, size)
        finally:
            os.close(fd)
        self.records[pack] = {(c.id, c.offset, c.length) for c in found.chunks}
        self.record_bytes[pack] = PACK_HEADER_SIZE + found.record_bytes
        for c in found.chunks:
            self.described.setdefault(c.id, _Row(pack, c.offset, c.length))

    def _pack_rows(self, pack: int) -> list[tuple[bytes, int, int]]:
        return self.map.rows_of_pack(pack)

    def _check_pack(self, pack: int, rows: list[tuple[bytes, int, int]], size: int | None) -> list[str]:
        if not rows:  # e.g. the open pack of a daemon that stopped after GC emptied it
            if size is not None:
                self.report.unused_packs += 1
                self.report.slack_bytes += size
            return []
        if size is None:
            for cid, _, _ in rows:
                self.bad[cid] = (Damage.PACK_MISSING, f"pack {pack} is missing")
            return [f"pack {pack} is missing: {len(rows)} mapped chunks lost"]
        problems = []
        past = [cid for cid, off, n in rows if off + n > size]
        for cid in past:
            self.bad[cid] = (Damage.PAST_END, f"lies past the end of pack {pack} ({size} bytes)")
        if past:
            problems.append(f"pack {pack}: {len(past)} chunks lie past its end ({size} bytes)")
        overlaps = sum(1 for (_, a, n), (_, b, _) in zip(rows, rows[1:], strict=False) if b < a + n)
        if overlaps:
            problems.append(f"pack {pack}: {overlaps} chunks overlap the previous one")
        problems += self._check_records(pack, rows)
        end = max(off + n for _, off, n in rows)
        if size > end and not self.live:
            problems.append(f"pack {pack}: {size - end} bytes after its last mapped chunk (uncommitted tail)")
        overhead = self.record_bytes.get(pack, 0)
        self.report.slack_bytes += max(0, min(end, size) - sum(n for _, _, n in rows) - overhead)
        return problems

    def _check_records(self, pack: int, rows: list[tuple[bytes, int, int]]) -> list[str]:
        """Offline: every row into a described pack must be a chunk its records list there."""
        described = self.records.get(pack)
        if described is None:
            return []
        wrong = [(cid, off, n) for cid, off, n in rows if (cid, off, n) not in described]
        for cid, off, _ in wrong:
            self.bad.setdefault(cid, (Damage.DISAGREES, f"{DISAGREES} {pack} (map says offset {off})"))
        if not wrong:
            return []
        cid, off, n = wrong[0]
        return [f"pack {pack}: {len(wrong)} map rows {DISAGREES} {pack} (first: {cid.hex()} at {off}, {n} bytes)"]

    def verify_data(self, budget: int | None = None) -> None:
        """Re-hash every mapped chunk, or (``budget``) about that many bytes of them: whole packs in
        order from a random one (the last one cut short)."""
        total = self.report.chunk_bytes if budget is None else min(budget, self.report.chunk_bytes)
        by_pack: dict[int, list[tuple[bytes, _Row]]] = defaultdict(list)
        for cid, row in self.rows.items():
            if cid not in self.bad:
                by_pack[row.pack].append((cid, row))
        order = sorted(by_pack)
        if budget is not None and order:
            first = random.randrange(len(order))  # each routine run checks another part
            order = order[first:] + order[:first]
        for n, pack in enumerate(order):
            items = sorted(by_pack[pack], key=lambda item: item[1].offset)
            if budget is not None:
                left = budget - self.report.bytes_verified
                if left <= 0:
                    self.report.verify_subset = (
                        f"a subset: {n} of {len(order)} packs from pack {order[0]} on; "
                        f"{self.report.chunk_bytes} chunk bytes in all"
                    )
                    break
                items = _within(items, left)
            try:
                fd = os.open(self.pack_path(pack), os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:  # compacted by a running daemon meanwhile
                continue
            try:
                self._verify_pack(fd, pack, items, total)
            finally:
                os.close(fd)
        self.progress("", 1, 1)

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
                    self.bad[cid] = (Damage.CORRUPT, f"fails its checksum (pack {pack} at {row.offset})")
                    self.report.problems.append(f"pack {pack}: chunk {cid.hex()} at {row.offset} fails its checksum")
                self.report.bytes_verified += row.length
            self.progress("verify", self.report.bytes_verified, total)
            i = j

    # -- snapshots ----------------------------------------------------------------------------

    def check_snapshots(self, snapshots: Path) -> None:
        total = sum(1 for _ in walk_stubs(snapshots)) if self.progress is not _no_progress else 0
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
                note = ""
                if not reason.startswith(REMAPPABLE):
                    self.report.broken[rel] = reason
                    if self._marked(entry):
                        self.report.marked.append(rel)
                        note = " (marked broken)"
                self.report.problems.append(f"snapshot {rel}: {reason}{note}")
            self.progress("stubs", n, max(n, total))
        self.progress("", 1, 1)

    @staticmethod
    def _marked(entry: stubs.Entry) -> bool:
        try:
            fd = entry.open()
        except OSError:
            return False
        try:
            return _is_marked(fd)
        finally:
            os.close(fd)

    def _check_stub(self, entry: stubs.Entry) -> str | None:
        try:
            if entry.error is not None:
                raise entry.error
            fd = entry.open()
            try:
                data, size = stubs.read_stub(fd)
                record = stubs.read_record(fd)
            finally:
                os.close(fd)
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
        in_bucket = self.synced.get(entry.rel) == hashlib.sha256(data).digest()
        problem = self._chunk_problems(index, entry.rel if in_bucket else None)
        if problem is None and record is not None and self.verify_files:
            problem = self._file_problem(index, record)
        return problem

    def _file_problem(self, index: idx.Index, raw: bytes) -> str | None:
        """Why the snapshot, put back whole, is not the file its record describes (None: it is,
        or it cannot be read here: chunks only the shared tier has, an unknown chunker)."""
        try:
            record = filerecord.decode(raw, index.size)
        except filerecord.RecordError as e:
            return f"its file record is not one: {e}"
        if not record.form.groups_given and self.group_w is None:
            return None
        locations = {cid: self._location(cid) for cid in dict.fromkeys(index.ids)}
        if any(loc is None for loc in locations.values()):
            return None  # in the bucket only (or reported as missing already)
        fds: dict[int, int] = {}

        def read_chunk(cid: bytes) -> bytes:
            row = locations[cid]
            assert row is not None
            fd = fds.get(row.pack)
            if fd is None:
                fd = fds[row.pack] = os.open(self.pack_path(row.pack), os.O_RDONLY | os.O_NOFOLLOW)
            return os.pread(fd, row.length, row.offset)

        def read(off: int, n: int) -> bytes:
            end, out = min(off + n, index.size), bytearray()
            i = index.find(off)
            while i < len(index) and index.start(i) < end:
                chunk = read_chunk(index.ids[i])
                lo, hi = max(off, index.start(i)) - index.start(i), min(end, index.ends[i]) - index.start(i)
                out += chunk[lo:hi]
                i += 1
            return bytes(out)

        try:
            if record.form.groups_given:
                found = record.segments
            else:
                assert self.group_w is not None
                found = relayout.groups(read, index.size, self.group_w)
            why = filerecord.mismatch(relayout.file_pieces(read, index.size, found), record)
            if why is not None:
                changed = next((cid for cid in locations if hashlib.sha256(read_chunk(cid)).digest() != cid), None)
                if changed is not None:  # mounted: GC moved it meanwhile (the check is run again)
                    return f"chunk {changed.hex()} changed while it was read"
        except OSError as e:
            return f"cannot be put back whole: {e}"
        finally:
            for fd in fds.values():
                os.close(fd)
        self.report.files_verified += 1
        return f"{why} (every chunk has its id: the chunks are in a wrong order or put back wrong)" if why else None

    def _location(self, cid: bytes) -> _Row | None:
        """Where a chunk is: the rows read at the start, or (mounted: GC may move chunks) the map now."""
        if self.live:
            loc = self.map.locate(cid)
            return _Row(loc.pack, loc.offset, loc.length) if loc is not None else None
        return self.rows.get(cid)

    def _chunk_problems(self, index: idx.Index, in_bucket: str | None = None) -> str | None:
        """What keeps ``index`` from being read; ``in_bucket``: the snapshot's path if it is the
        version synced with the shared tier (chunks the store lacks are fetched from there)."""
        missing: list[int] = []
        damaged: list[int] = []
        remappable: list[int] = []
        wrong_length: list[int] = []
        for i, cid in enumerate(index.ids):
            if cid not in self.rows and not self._mapped_now(cid):
                (remappable if cid in self.described else missing).append(i)
            elif cid in self.bad:
                damaged.append(i)
            elif self.rows[cid].length != index.length(i):
                wrong_length.append(i)
        if in_bucket is not None and (missing or remappable):
            self.report.in_bucket[in_bucket] = len(missing) + len(remappable)
            missing, remappable = [], []
        if not missing and not damaged and not wrong_length:
            if not remappable:
                return None
            i = remappable[0]
            row = self.described[index.ids[i]]
            return (
                f"{REMAPPABLE} {len(remappable)} chunks that packs describe (first at {index.start(i)}: "
                f"{index.ids[i].hex()} in pack {row.pack}); --repair or the next mount re-maps those that are intact"
            )
        parts = []
        if wrong_length:
            i = wrong_length[0]
            mapped = self.rows[index.ids[i]].length
            parts.append(
                f"{len(wrong_length)} chunks whose length disagrees with the map (first: chunk {i} at "
                f"{index.start(i)} is {index.length(i)} bytes in the index, {mapped} in the map)"
            )
        if missing:
            i = missing[0]
            parts.append(f"{len(missing)} chunks not in the store (first at {index.start(i)}: {index.ids[i].hex()})")
        if damaged:
            i = damaged[0]
            cid = index.ids[i]
            parts.append(f"{len(damaged)} chunks damaged (first at {index.start(i)}: {cid.hex()} {self.bad[cid][1]})")
        return f"{len(index)} chunks, " + ", ".join(parts)

    def _mapped_now(self, cid: bytes) -> bool:
        """On a mounted store a save may have added the chunk after the map was read."""
        if not self.live:
            return False
        loc = self.map.locate(cid)
        if loc is not None:
            self.rows[cid] = _Row(loc.pack, loc.offset, loc.length)
        return loc is not None

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


def _within(items: list[tuple[bytes, _Row]], budget: int) -> list[tuple[bytes, _Row]]:
    """The first of ``items`` whose lengths add up to at most ``budget`` (at least one)."""
    used = 0
    for i, (_, row) in enumerate(items):
        used += row.length
        if used > budget:
            return items[: max(1, i)]
    return items


def _size(path: Path) -> int | None:
    try:
        return path.lstat().st_size
    except FileNotFoundError:
        return None


def check(
    root: Path,
    verify_data: bool = False,
    live: bool = False,
    progress: ProgressFn = _no_progress,
    subset: Subset | None = None,
) -> tuple[FsckReport, _Checker]:
    """Read-only check of the store at ``root``; ``live``: a daemon serves it; ``subset``: with
    ``verify_data``, re-hash only that part of the chunk bytes."""
    start = time.monotonic()
    layout = Layout(root)
    if not layout.is_store():
        raise FileNotFoundError(f"no store at {root} (no chunks.db, no packs)")
    chunk_map, problem = MapReader.open_or_empty(layout)
    try:
        checker = _Checker(layout, chunk_map, live, progress)
        if problem:
            checker.report.problems.append(problem)
        checker.check_map()
        if verify_data and subset is not None:
            checker.verify_data(subset.budget(checker.report.chunk_bytes))
        elif verify_data:
            checker.verify_data()
            checker.verify_files = True
        checker.check_snapshots(layout.snapshots)
        if not live:
            checker.check_leftovers()
    finally:
        chunk_map.close()
    checker.report.duration_s = time.monotonic() - start
    return checker.report, checker


def repair(repo: Repository, checker: _Checker, moved_aside: str = "") -> None:
    """Fix what ``check`` found; the store lock must be held and no daemon may serve the store."""
    report = checker.report
    if moved_aside:
        report.repaired.append(f"moved the unreadable chunk map to {moved_aside}")
    n = clean_temp_dirs(repo)
    if n:
        report.repaired.append(f"removed {n} leftover temp/staging files")
    disagreeing = [cid for cid, (damage, _) in checker.bad.items() if damage is Damage.DISAGREES]
    if disagreeing:
        repo.store.delete_chunks(disagreeing)
        report.repaired.append(f"dropped {len(disagreeing)} map rows that disagree with their pack's records")
    rec = RecoveryReport()
    repair_packs(repo.store, rec)
    if rec.rows_dropped or rec.packs_truncated or rec.packs_removed:
        report.repaired.append(
            f"dropped {rec.rows_dropped} map rows outside their pack, cut {rec.packs_truncated} pack tails "
            f"({rec.tail_bytes_cut} bytes), removed {rec.packs_removed} unused packs"
        )
    if rec.chunks_added:
        n, packs = rec.chunks_added, rec.packs_scanned
        report.repaired.append(f"added {n} chunks the packs describe to the map ({packs} packs scanned)")
    corrupt = [cid for cid, (damage, _) in checker.bad.items() if damage is Damage.CORRUPT]
    if corrupt:
        repo.store.delete_chunks(corrupt)
        report.repaired.append(
            f"dropped {len(corrupt)} corrupt chunks from the map (a save of the same bytes restores them)"
        )
    after = RecoveryReport()
    check_snapshots(repo, after, rescue_marked=True)
    if after.chunks_rescued:
        report.repaired.append(f"re-mapped {after.chunks_rescued} chunks snapshots name from their packs' records")
    _mark_broken(repo, report, _still_broken(report, after))
    gc_report = run_gc(repo, threshold=1.0)
    if gc_report.chunks_freed or gc_report.disk_bytes_freed:
        report.repaired.append(
            f"removed {gc_report.chunks_freed} unreferenced chunks, deleted {gc_report.packs_deleted} and compacted "
            f"{gc_report.packs_compacted} packs ({gc_report.disk_bytes_freed} bytes of unmapped pack space freed)"
        )
    report.repaired += [f"gc: {e}" for e in gc_report.errors]


def _still_broken(report: FsckReport, after: RecoveryReport) -> dict[str, str]:
    """Snapshots that cannot be read in full once the map is repaired (re-mapped ones can)."""
    now = set(after.unreadable) | set(after.missing) | set(after.mismatched)
    out = {rel: why for rel, why in report.broken.items() if rel in now}
    for rel in now - set(out):
        out[rel] = after.mismatched.get(rel) or f"{after.missing.get(rel, 0)} chunks not in the store"
    return out


def _mark_broken(repo: Repository, report: FsckReport, broken: dict[str, str]) -> None:
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
            reason = broken.get(rel)
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
    root: Path,
    verify_data: bool = False,
    do_repair: bool = False,
    progress: ProgressFn = _no_progress,
    open_repo: Callable[[], Repository] | None = None,
    subset: Subset | None = None,
) -> FsckReport:
    """Check (and with ``do_repair`` fix) the store; a mounted store is only checked."""
    lock_fd = try_lock_store(root) if Layout(root).is_store() else None
    live = lock_fd is None
    try:
        if do_repair and live:
            raise RuntimeError(f"store {root} is mounted (or locked by another tool); unmount it to repair")
        report, checker = check(root, verify_data, live, progress, subset)
        if do_repair:
            moved_aside = prepare_map_file(root)
            repo = open_repo() if open_repo is not None else Repository(root)
            try:
                repair(repo, checker, moved_aside)
            finally:
                repo.close()
        return report
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
