"""Chunk store: append-only pack files plus a SQLite map chunk id -> (pack, offset, length).

Packs are the truth, the map is a cache. Write order for new chunks (see docs/design.md): a batch
record listing the chunks (``packformat``) and their bytes are written at the open pack's known end
first, then the map rows and the pack's new committed end (table ``packs``) are committed in one
transaction. A crash between the two leaves a described batch past the committed end, which
recovery adds to the map. A map row therefore never points at bytes that were not written, and
the map can always be rebuilt from the packs.

The map file may be deleted or replaced under a running daemon; every write transaction first
checks that ``chunks.db`` is still the file this connection opened, and refuses (EIO) otherwise.

Pins protect chunks that open files use but no stub names yet (a save in progress, a file that
was unlinked while open). Garbage collection treats pinned ids as live; the existence check and
the pin of a save happen under ``lock``, the same lock GC holds while it deletes map rows, so a
chunk found in the store cannot vanish before the stub that names it is renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from kvchunkfs.format.index import Index
from kvchunkfs.store.layout import Layout, fsync_dir
from kvchunkfs.store.packformat import (
    BATCH_HEADER_SIZE,
    ENTRY_SIZE,
    PACK_HEADER_SIZE,
    Described,
    batch_record,
    pack_header,
)

log = logging.getLogger(__name__)

_SQL_BATCH = 500
_IOV_MAX = 512  # writev takes at most IOV_MAX (1024) buffers
MAX_FDS = 64  # read fds kept open (least recently used idle ones are closed)
FRESH_MAX = 1 << 18  # new ids kept for GC between collections (~30 MB; 16 GB of 64 KiB chunks)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    id BLOB PRIMARY KEY, pack INTEGER NOT NULL, offset INTEGER NOT NULL, length INTEGER NOT NULL
) WITHOUT ROWID;
DROP INDEX IF EXISTS chunks_by_pack;
CREATE INDEX IF NOT EXISTS chunks_by_pack_len ON chunks (pack, offset, length);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS packs (pack INTEGER PRIMARY KEY, end INTEGER NOT NULL);
"""
_CLEAN = "clean_unmount"
# A pack's committed end only grows (a commit of an older batch must not move it back).
_UPSERT_END = (
    "INSERT INTO packs (pack, end) VALUES (?, ?) ON CONFLICT (pack) DO UPDATE SET end = max(end, excluded.end)"
)


class ChunkMissing(LookupError):
    """A chunk an index names is not in the store."""


class ChunkCorrupt(ValueError):
    """Chunk bytes read from a pack do not hash to their id."""


def quick_sum(data: bytes | memoryview) -> bytes:
    """The map's check of a chunk's bytes (xxh3-64, ~9x faster than SHA-256 here): local reads
    compare it instead of re-hashing the id. It guards against what a re-hash would (bytes changed
    on disk, a row pointing at the wrong bytes); not against a forger, who would need write access
    to the store, packs and map alike (see the threat model)."""
    return xxhash.xxh3_64_digest(data)


@dataclass(frozen=True)
class Location:
    pack: int
    offset: int
    length: int
    sum: bytes | None = None  # xxh3-64 of the chunk's bytes as written (None: a row that has none)


@dataclass
class StoreCounters:
    """Monotonic counters for metrics and tests (bytes and reads that reached disk).

    Worker threads update them concurrently: always through ``add`` (``x += n`` is a read and a
    write, and two threads can lose one of the updates). Readers may read fields without the lock.
    """

    chunks_written: int = 0
    bytes_written: int = 0
    chunks_deduped: int = 0
    bytes_deduped: int = 0
    pack_reads: int = 0
    pack_bytes_read: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, n in amounts.items():
                setattr(self, name, getattr(self, name) + n)


class _PackFd:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.retired = False


class PackStore:
    def __init__(self, root: Path, pack_size: int = 64 << 20, durable: bool = False, max_fds: int = MAX_FDS) -> None:
        self.root = root
        self.layout = Layout(root)
        self.packs_dir = self.layout.packs
        self.layout.create_dirs()
        self.layout.make_private()  # every snapshot's bytes: the daemon's user only
        self.pack_size = pack_size
        self.durable = durable
        self.lock = threading.RLock()  # map writes, pack appends, pins, GC sweep
        self._fd_lock = threading.Lock()
        self._fds: OrderedDict[int, _PackFd] = OrderedDict()  # least recently used first
        self.max_fds = max_fds
        self.db_path = self.layout.db
        self.db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
        self._db_ident = _ident(self.db_path)  # the file this connection writes to
        self._db_lost: str | None = None
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        self._db_lock = threading.Lock()  # sqlite3 connection is shared between threads
        self._migrate()
        self._pack_id: int | None = None  # pack currently appended to
        self._pack_fd = -1
        self._pack_end = 0
        self._unsynced: set[int] = set()  # packs written since the last sync()
        self.pins: dict[object, set[bytes]] = {}
        self.counters = StoreCounters()
        # (rows, bytes) of the map, counted once and then kept up to date by every write; None:
        # count again. Read without a lock (metrics), written under _db_lock.
        self._map_stats: tuple[int, int] | None = None
        # Ids mapped since GC last took them (under ``lock``): with the catalog's dropped ids, what
        # a collection of the changes looks at (maint/gc.py). None once too many piled up: the
        # next collection must walk every stub.
        self._fresh: set[bytes] | None = set()
        self._revisit: set[int] = set()  # packs with dead bytes GC left alone (e.g. the open one)
        # Bumped whenever rows of chunks a snapshot may name are dropped (eviction to the shared
        # tier): locations remembered from before (``Files``' reopen cache) may now lack chunks.
        self.drop_gen = 0

    def _migrate(self) -> None:
        """Create the schema; a map without the ``packs`` table is a new or a legacy one.

        ``described_from``: packs numbered below it may be legacy packs (no header, written before
        packs described themselves). A legacy map is taken as the truth about the packs it knows;
        a new map over existing packs (chunks.db was lost) knows none of them, so recovery scans
        the described ones and leaves legacy ones alone.
        """
        tables = {name for (name,) in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        self.db.executescript(_SCHEMA)
        if "sum" not in {row[1] for row in self.db.execute("PRAGMA table_info(chunks)")}:
            self.db.execute("ALTER TABLE chunks ADD COLUMN sum BLOB")  # rows from before have none
        if "packs" in tables:
            self.described_from = int(self.get_meta("described_from") or 1)
            return
        on_disk = self.pack_ids()
        last = max(int(self.get_meta("last_pack") or 0), on_disk[-1] if on_disk else 0)
        steps: list[tuple[str, Sequence[tuple]]] = [
            ("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", [("described_from", str(last + 1))]),
            ("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", [("last_pack", str(last))]),
        ]
        if "chunks" in tables:
            ends = dict(self.db.execute("SELECT pack, max(offset + length) FROM chunks GROUP BY pack"))
            known = [(pack, ends.get(pack, 0)) for pack in sorted(set(on_disk) | set(ends))]
            steps.append(("INSERT OR REPLACE INTO packs (pack, end) VALUES (?, ?)", known))
            log.info("chunk map: %d legacy packs (no batch records) are known only to the map", len(on_disk))
        self._commit(steps)
        self.described_from = last + 1

    # -- metadata ---------------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        with self._db_lock:
            row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self._db_lock:
            self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    # -- queries ----------------------------------------------------------------------------

    def locate_many(self, ids: Iterable[bytes]) -> dict[bytes, Location]:
        wanted = list(dict.fromkeys(ids))
        found: dict[bytes, Location] = {}
        with self._db_lock:
            for i in range(0, len(wanted), _SQL_BATCH):
                part = wanted[i : i + _SQL_BATCH]
                q = f"SELECT id, pack, offset, length, sum FROM chunks WHERE id IN ({','.join('?' * len(part))})"
                for cid, pack, off, length, check in self.db.execute(q, part):
                    found[cid] = Location(pack, off, length, check)
        return found

    def locate(self, cid: bytes) -> Location:
        loc = self.locate_many([cid]).get(cid)
        if loc is None:
            raise ChunkMissing(cid.hex())
        return loc

    @staticmethod
    def length_mismatch(index: Index, found: dict[bytes, Location]) -> str | None:
        """How ``index`` disagrees with the map (``found``: its chunks located) about a chunk's
        length, or None. Chunks the map lacks are not judged here (reading them fails with EIO)."""
        for i, cid in enumerate(index.ids):
            loc = found.get(cid)
            if loc is not None and loc.length != index.length(i):
                return f"chunk {i} ({cid.hex()}) is {index.length(i)} bytes in the index, {loc.length} in the map"
        return None

    def pack_ids(self) -> list[int]:
        return self.layout.pack_ids()

    def chunks_in_pack(self, pack: int) -> list[tuple[bytes, int, int]]:
        """(id, offset, length) of the mapped chunks of one pack, in pack order."""
        with self._db_lock:
            q = "SELECT id, offset, length FROM chunks WHERE pack = ? ORDER BY offset"
            return self.db.execute(q, (pack,)).fetchall()

    def pack_path(self, pack: int) -> Path:
        return self.layout.pack_path(pack)

    def stats(self) -> tuple[int, int]:
        """(chunk count, stored chunk bytes) according to the map: counted once, then kept."""
        known = self._map_stats
        if known is not None:
            return known
        with self._db_lock:
            if self._map_stats is None:
                q = "SELECT count(*), coalesce(sum(length), 0) FROM chunks"
                n, total = self.db.execute(q).fetchone()
                self._map_stats = (n, total)
            return self._map_stats

    def cached_stats(self) -> tuple[int, int] | None:
        """``stats`` if known, without waiting for any lock (a scrape must not queue behind saves)."""
        return self._map_stats

    def _count_rows(self, rows: int, length: int) -> None:
        """Under ``_db_lock``, after a commit that added (or, negative, removed) rows."""
        if self._map_stats is not None:
            n, total = self._map_stats
            self._map_stats = (n + rows, total + length)

    # -- maintenance: GC, recovery, fsck ----------------------------------------------------

    def chunk_lengths(self) -> dict[bytes, int]:
        """Every mapped chunk id with its length."""
        with self._db_lock:
            return dict(self.db.execute("SELECT id, length FROM chunks"))

    def pack_usage(self, packs: Iterable[int] | None = None) -> dict[int, tuple[int, int, int]]:
        """pack -> (mapped chunks, mapped bytes, end of its last mapped chunk), for every mapped
        pack or only ``packs`` (one covering-index range each, not a walk of the map)."""
        if packs is None:
            q = "SELECT pack, count(*), sum(length), max(offset + length) FROM chunks GROUP BY pack"
            with self._db_lock:
                return {pack: (n, total, end) for pack, n, total, end in self.db.execute(q)}
        out = {}
        q = "SELECT count(*), coalesce(sum(length), 0), coalesce(max(offset + length), 0) FROM chunks WHERE pack = ?"
        for pack in packs:
            with self._db_lock:  # per pack: a save's map write waits for one range at most
                n, total, end = self.db.execute(q, (pack,)).fetchone()
            if n:
                out[pack] = (n, total, end)
        return out

    def take_fresh(self) -> set[bytes] | None:
        """The ids mapped since the last call (None: too many to have kept; walk every stub)."""
        with self.lock:
            fresh, self._fresh = self._fresh, set()
        return fresh

    def revisit(self, packs: Iterable[int]) -> None:
        """Packs a later GC should look at again (dead bytes it could not reclaim yet)."""
        with self.lock:
            self._revisit.update(packs)

    def take_revisit(self) -> set[int]:
        with self.lock:
            packs, self._revisit = self._revisit, set()
        return packs

    def _note_fresh(self, ids: Iterable[bytes]) -> None:
        """Under ``lock``."""
        if self._fresh is not None:
            self._fresh.update(ids)
            if len(self._fresh) > FRESH_MAX:
                self._fresh = None

    def mapped_packs(self) -> list[int]:
        """Packs some row points into: one index seek per pack, not a walk of every row."""
        out: list[int] = []
        q = "SELECT pack FROM chunks WHERE pack > ? ORDER BY pack LIMIT 1"
        with self._db_lock:
            while (row := self.db.execute(q, (out[-1] if out else -(1 << 62),)).fetchone()) is not None:
                out.append(row[0])
        return out

    def set_clean_mark(self) -> None:
        """At a clean unmount (every save finished, nothing in flight): the time, so the next mount
        checks only the stubs changed since. Durable, like its removal."""
        row = (_CLEAN, repr(time.time()))
        self._commit([("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", [row])], durable=True)

    def take_clean_mark(self) -> float | None:
        """When the last daemon unmounted cleanly (None: it did not); removes the mark (durably)."""
        value = self.get_meta(_CLEAN)
        if value is None:
            return None
        self._commit([("DELETE FROM meta WHERE key = ?", [(_CLEAN,)])], durable=True)
        try:
            return float(value)
        except ValueError:
            return None

    def pack_ends(self) -> dict[int, int]:
        """pack -> committed end: the map knows every batch before it (table ``packs``)."""
        with self._db_lock:
            return dict(self.db.execute("SELECT pack, end FROM packs"))

    def _commit(self, steps: Sequence[tuple[str, Sequence[tuple]]], durable: bool = False) -> int:
        """Run each (sql, rows) of ``steps`` in one transaction; returns the rows changed.

        ``durable``: the commit itself is fsynced (WAL + synchronous=FULL), whatever the setting.
        """
        with self._db_lock:
            self._check_db()
            if durable and not self.durable:
                self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("BEGIN")
            try:
                changed = 0
                for sql, params in steps:
                    for row in params:
                        changed += self.db.execute(sql, row).rowcount
                self.db.execute("COMMIT")
            except sqlite3.Error:
                with contextlib.suppress(sqlite3.Error):
                    self.db.execute("ROLLBACK")
                raise
            finally:
                if durable and not self.durable:
                    self.db.execute("PRAGMA synchronous=NORMAL")
        return changed

    def _check_db(self) -> None:
        """Refuse to write into a map file that was deleted or replaced under us (EIO, logged once).

        Writing on would commit rows nobody will read (a deleted file) or mix two maps; reopening
        would need a rebuild while saves run. The packs describe every chunk written so far, so
        the next mount rebuilds the map from them.
        """
        if self._db_lost is None:
            now = _ident(self.db_path)
            if now == self._db_ident:
                return
            self._db_lost = "was deleted" if now is None else "was replaced by another file"
            log.error(
                "%s %s while the store is in use: refusing to save (EIO) until the store is mounted again; "
                "the packs describe every chunk written so far and the next mount rebuilds the map from them",
                self.db_path,
                self._db_lost,
            )
        raise OSError(errno.EIO, f"chunk map {self.db_path} {self._db_lost}; remount the store")

    def delete_chunks(self, ids: Iterable[bytes]) -> int:
        """Drop map rows (GC's sweep: call under ``lock``); the pack bytes become dead space."""
        return len(self.drop_rows(ids))

    def drop_rows(self, ids: Iterable[bytes]) -> list[tuple[int, int]]:
        """``delete_chunks``, returning (pack, length) of each row deleted."""
        with self._db_lock:
            self._check_db()
            self.db.execute("BEGIN")
            try:
                sql = "DELETE FROM chunks WHERE id = ? RETURNING pack, length"
                rows = [row for cid in ids for row in self.db.execute(sql, (cid,))]
                self.db.execute("COMMIT")
            except sqlite3.Error:
                with contextlib.suppress(sqlite3.Error):
                    self.db.execute("ROLLBACK")
                raise
            self._count_rows(-len(rows), -sum(n for _, n in rows))
        return rows

    def evict_chunks(self, ids: Sequence[bytes]) -> tuple[int, int]:
        """Drop the rows of ``ids`` that are not pinned (eviction: the chunks are safely in the
        shared tier); returns (rows dropped, their bytes). Call under ``lock`` after checking that no
        stub appeared meanwhile (as GC's sweep does). The pack bytes become dead space that
        compaction gives back; the open pack is closed first if it holds one of them, so that
        compaction may touch it (saves simply start a new pack)."""
        with self.lock:
            pinned = self.pinned()
            drop = [cid for cid in ids if cid not in pinned]
            if not drop:
                return 0, 0
            found = self.locate_many(drop)
            if self._pack_id is not None and any(loc.pack == self._pack_id for loc in found.values()):
                self._close_pack()
            n = self.delete_chunks(drop)
            self.drop_gen += 1
            return n, sum(loc.length for loc in found.values())

    def move_chunks(self, old_pack: int, moves: Sequence[tuple[bytes, int, int]], new_end: tuple[int, int]) -> int:
        """Point rows at copies (id, new pack, new offset), each only if it is still in ``old_pack``.

        ``new_end``: (new pack, end of the copied batch), committed with the rows. Durable even with
        durability=close: the old pack is deleted next, and a power failure must not bring back rows
        that point into it.
        """
        sql = "UPDATE chunks SET pack = ?, offset = ? WHERE id = ? AND pack = ?"
        with self.lock:
            steps: list[tuple[str, Sequence[tuple[Any, ...]]]] = [
                (sql, [(pack, off, cid, old_pack) for cid, pack, off in moves]),
                (_UPSERT_END, [new_end]),
            ]
            return self._commit(steps, durable=True) - 1

    def adopt(self, pack: int, chunks: Sequence[Described], end: int, replace: Iterable[bytes] = ()) -> int:
        """Map described chunks the map lacks (ids in ``replace``: overwrite their bad rows) and
        record ``end`` as the pack's committed end; returns the rows added or replaced."""
        bad = set(replace)
        rows = [(c.id, pack, c.offset, c.length) for c in chunks]
        sql = "INSERT OR {} INTO chunks (id, pack, offset, length) VALUES (?,?,?,?)"
        steps = [
            (sql.format("REPLACE"), [r for r in rows if r[0] in bad]),
            (sql.format("IGNORE"), [r for r in rows if r[0] not in bad]),
        ]
        with self.lock:
            added = self._commit([*steps, (_UPSERT_END, [(pack, end)])]) - 1
            self._note_fresh(r[0] for r in rows)  # adopted rows may name no snapshot: GC looks at them
            self._map_stats = None  # replaced rows change lengths: count again when asked
            return added

    def forget_pack(self, pack: int) -> None:
        """Drop the committed end of a pack that is gone."""
        self._commit([("DELETE FROM packs WHERE pack = ?", [(pack,)])])

    def rows_outside(self, pack: int, size: int) -> list[bytes]:
        """Ids of the rows of ``pack`` that end past ``size`` bytes."""
        with self._db_lock:
            q = "SELECT id FROM chunks WHERE pack = ? AND offset + length > ?"
            return [cid for (cid,) in self.db.execute(q, (pack, size))]

    def trim_pack(self, pack: int) -> int:
        """Cut the dead bytes after the last mapped chunk of a closed pack; returns the bytes cut."""
        with self.lock:
            if pack == self._pack_id:
                return 0
            with self._db_lock:
                q = "SELECT coalesce(max(offset + length), 0) FROM chunks WHERE pack = ?"
                (end,) = self.db.execute(q, (pack,)).fetchone()
            path = self.pack_path(pack)
            size = path.lstat().st_size
            if end == 0 or size <= end:
                return 0
            self._commit([("UPDATE packs SET end = min(end, ?) WHERE pack = ?", [(end, pack)])])
            self.truncate_pack(pack, end)
            return size - end

    def truncate_pack(self, pack: int, length: int) -> None:
        """Cut a pack file to ``length`` bytes; never through a symlink."""
        fd = os.open(self.pack_path(pack), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, length)
        finally:
            os.close(fd)

    def remove_pack(self, pack: int) -> bool:
        """Delete a pack no row points into (never the open one, never one the map does not know,
        e.g. a legacy pack after chunks.db was lost); False if it is kept."""
        with self.lock:
            with self._db_lock:
                used = self.db.execute("SELECT 1 FROM chunks WHERE pack = ? LIMIT 1", (pack,)).fetchone()
                known = self.db.execute("SELECT 1 FROM packs WHERE pack = ?", (pack,)).fetchone()
            if pack == self._pack_id or used or not known:
                return False
            self._check_db()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.pack_path(pack))
            self.forget_pack(pack)
        self.retire_pack(pack)
        return True

    # -- the ChunkStore interface (store/chunkstore.py) ----------------------------------------

    def has(self, ids: Iterable[bytes]) -> set[bytes]:
        return set(self.locate_many(ids))

    def get_many(self, ids: Sequence[bytes]) -> list[bytes]:
        """Each chunk read and checked on its own (the read-ahead reads runs instead: file/fetcher.py)."""
        found = self.locate_many(ids)
        out = []
        for cid in ids:
            loc = found.get(cid)
            if loc is None:
                raise ChunkMissing(cid.hex())
            data = self.read_run(loc.pack, loc.offset, loc.length)
            if hashlib.sha256(data).digest() != cid:
                raise ChunkCorrupt(f"chunk {cid.hex()} in pack {loc.pack} at {loc.offset} fails its checksum")
            out.append(data)
        return out

    # -- writing ----------------------------------------------------------------------------

    def put_many(self, chunks: Sequence[tuple[bytes, bytes | memoryview]], owner: object) -> int:
        """Store the chunks the store lacks and pin all of them for ``owner``.

        Returns the number of new bytes written. Raises OSError (e.g. ENOSPC) with nothing
        committed for the failing batch; chunks already in the store are still pinned.
        """
        with self.lock:
            pinned = self.pins.setdefault(owner, set())
            pinned.update(cid for cid, _ in chunks)
            self._check_db()  # also a save that finds every chunk: its stub would name a lost map's rows
            try:
                present = self.locate_many(cid for cid, _ in chunks)
            except sqlite3.Error as e:  # callers (the chunker thread) handle OSError only
                raise _os_error(e) from e
            new: dict[bytes, bytes | memoryview] = {}
            for cid, data in chunks:
                if cid in present or cid in new:
                    self.counters.add(chunks_deduped=1, bytes_deduped=len(data))
                else:
                    new[cid] = data
            if new:
                self._append_packed(new)
            return sum(len(d) for d in new.values())

    def _append_packed(self, new: dict[bytes, bytes | memoryview]) -> None:
        """Append a batch, starting a new pack whenever the next chunk would overflow ``pack_size``.

        A backlog can make one batch many MiB; packs stay near their size, so GC can delete or
        compact them piece by piece.
        """
        items = list(new.items())
        i = 0
        while i < len(items):
            cost = BATCH_HEADER_SIZE + ENTRY_SIZE + len(items[i][1])
            if self._pack_id is not None and self._pack_end + cost > self.pack_size:
                self._close_pack()
            _, _, end = self._open_pack()
            room = self.pack_size - end - BATCH_HEADER_SIZE
            group: dict[bytes, bytes | memoryview] = {}
            size = 0
            while i < len(items) and (not group or size + ENTRY_SIZE + len(items[i][1]) <= room):
                group[items[i][0]] = items[i][1]
                size += ENTRY_SIZE + len(items[i][1])
                i += 1
            self._append(group)

    def _append(self, new: dict[bytes, bytes | memoryview]) -> None:
        """Write one batch (record + chunks) at the pack's known end, then commit its rows."""
        fd, pack, start = self._open_pack()
        datas = list(new.values())
        record = batch_record([(cid, len(data)) for cid, data in new.items()])
        rows = []
        off = start + len(record)
        for cid, data in new.items():
            rows.append((cid, pack, off, len(data), quick_sum(data)))
            off += len(data)
        try:
            pwrite_all(fd, [record, *datas], start)
            if self.durable:
                os.fsync(fd)
            self._insert_rows(rows, pack, off)
        except (OSError, sqlite3.Error) as e:
            # Nothing of this batch is in the map. The next batch is written at _pack_end again
            # (explicit offsets), so even a failing truncate only leaves dead bytes behind it.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            if isinstance(e, sqlite3.Error):
                raise _os_error(e) from e
            raise
        self._pack_end = off
        self._unsynced.add(pack)
        self.counters.add(chunks_written=len(rows), bytes_written=off - start - len(record))
        if self._pack_end >= self.pack_size:
            self._close_pack()

    def _insert_rows(self, rows: list[tuple[bytes, int, int, int, bytes]], pack: int, end: int) -> None:
        """The batch's rows and the pack's new committed end, in one transaction."""
        with self._db_lock:
            self._check_db()
            self.db.execute("BEGIN")
            try:
                sql = "INSERT OR REPLACE INTO chunks (id, pack, offset, length, sum) VALUES (?,?,?,?,?)"
                self.db.executemany(sql, rows)
                self.db.execute(_UPSERT_END, (pack, end))
                self.db.execute("COMMIT")
            except sqlite3.Error:
                with contextlib.suppress(sqlite3.Error):
                    self.db.execute("ROLLBACK")
                raise
            # put_many found none of these ids in the map under ``lock``: every row is new.
            self._count_rows(len(rows), sum(r[3] for r in rows))
        self._note_fresh(r[0] for r in rows)

    def _open_pack(self) -> tuple[int, int, int]:
        if self._pack_id is None:
            pack, fd = self.create_pack()
            self._pack_id, self._pack_fd, self._pack_end = pack, fd, PACK_HEADER_SIZE
        return self._pack_fd, self._pack_id, self._pack_end

    def create_pack(self) -> tuple[int, int]:
        """A new pack holding just its header (number, write fd), under a number never used before.

        Numbers of deleted packs are not reused: a reader that located a chunk in a pack GC
        deleted must get FileNotFoundError and look again, not read another pack's bytes. The
        pack is known to the map (table ``packs``) before its file exists.
        """
        with self.lock:
            ids = self.pack_ids()
            try:
                pack = max(int(self.get_meta("last_pack") or 0), ids[-1] if ids else 0) + 1
                self._commit(
                    [
                        ("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", [("last_pack", str(pack))]),
                        ("INSERT OR REPLACE INTO packs (pack, end) VALUES (?, ?)", [(pack, PACK_HEADER_SIZE)]),
                    ]
                )
            except sqlite3.Error as e:
                raise _os_error(e) from e
            path = self.pack_path(pack)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                pwrite_all(fd, [pack_header()], 0)
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
            return pack, fd

    def _close_pack(self) -> None:
        if self._pack_id is not None:
            os.close(self._pack_fd)
            self._pack_id, self._pack_fd, self._pack_end = None, -1, 0

    @property
    def open_pack(self) -> int | None:
        """The pack new chunks go to; GC never touches it (it may ``seal`` it first)."""
        return self._pack_id

    def seal(self, pack: int) -> bool:
        """Stop appending to ``pack`` if it is still the open one: the next batch starts a new pack,
        and GC may delete, trim or compact this one like any other. False if it was not open."""
        with self.lock:  # appends hold it: none is writing to the fd being closed
            if self._pack_id != pack:
                return False
            self._close_pack()
            return True

    def sync(self) -> None:
        """Make every chunk written so far durable (pack data, then the map)."""
        with self.lock:
            for pack in sorted(self._unsynced):
                with contextlib.suppress(FileNotFoundError), self.pack_fd(pack) as fd:
                    os.fsync(fd)
            self._unsynced.clear()
            with self._db_lock:
                self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            fsync_dir(self.packs_dir)

    # -- pins -------------------------------------------------------------------------------

    def pin(self, owner: object, ids: Iterable[bytes]) -> None:
        with self.lock:
            self.pins.setdefault(owner, set()).update(ids)

    def unpin(self, owner: object) -> None:
        with self.lock:
            self.pins.pop(owner, None)

    def pinned(self) -> set[bytes]:
        with self.lock:
            out: set[bytes] = set()
            for ids in self.pins.values():
                out |= ids
            return out

    def is_pinned(self, cid: bytes) -> bool:
        """Under ``lock`` (GC's sweep): one lookup per pin owner, not a union of every pin."""
        return any(cid in ids for ids in self.pins.values())

    def requeue_fresh(self, ids: Iterable[bytes]) -> None:
        """Give ids back to the next ``take_fresh`` (GC could not decide on them this time)."""
        with self.lock:
            self._note_fresh(ids)

    # -- reading ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def pack_fd(self, pack: int) -> Iterator[int]:
        """A read fd for ``pack`` that stays valid even if GC deletes the pack meanwhile.

        At most ``max_fds`` are cached: opening one more closes the least recently used fd that
        no reader holds (a store has far more packs than a process may have fds).
        """
        with self._fd_lock:
            entry = self._fds.get(pack)
            if entry is None:
                entry = _PackFd(os.open(self.pack_path(pack), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
                self._fds[pack] = entry
            else:
                self._fds.move_to_end(pack)
            entry.users += 1
            self._evict_idle()
        try:
            yield entry.fd
        finally:
            with self._fd_lock:
                entry.users -= 1
                if entry.retired and entry.users == 0:
                    os.close(entry.fd)

    def _evict_idle(self) -> None:
        """Under ``_fd_lock``: close idle fds, oldest first, until the cache fits ``max_fds``."""
        excess = len(self._fds) - self.max_fds
        for pack in [p for p, e in self._fds.items() if e.users == 0][: max(0, excess)]:
            os.close(self._fds.pop(pack).fd)

    def retire_pack(self, pack: int) -> None:
        """Forget the cached fd of a deleted pack; readers holding it finish first."""
        with self._fd_lock:
            entry = self._fds.pop(pack, None)
            if entry is not None:
                entry.retired = True
                if entry.users == 0:
                    os.close(entry.fd)

    def read_run(self, pack: int, offset: int, length: int) -> bytes:
        with self.pack_fd(pack) as fd:
            data = os.pread(fd, length, offset)
        if len(data) != length:
            raise OSError(errno.EIO, f"pack {pack} is short: wanted {length} bytes at {offset}, got {len(data)}")
        self.counters.add(pack_reads=1, pack_bytes_read=length)
        return data

    def read_run_into(self, pack: int, offset: int, out: memoryview, piece: int) -> Iterator[int]:
        """Fill ``out`` with the pack's bytes from ``offset``, ``piece`` bytes a read, yielding how
        many are in place after each: a reader may use a run's first chunks while the rest is still
        on its way. No WILLNEED hint: the kernel's own read-ahead of sequential preads streams the
        disk, and announcing a whole run first made cold reads slower, not faster."""
        length = len(out)
        with self.pack_fd(pack) as fd:
            done = 0
            if not length:
                yield 0  # a run of empty chunks is in place at once
            while done < length:
                n = os.preadv(fd, [out[done : min(length, done + piece)]], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"pack {pack} is short: wanted {length} bytes at {offset}, got {done}")
                done += n
                yield done
        self.counters.add(pack_reads=1, pack_bytes_read=length)

    def close(self) -> None:
        with self.lock:
            self._close_pack()
        with self._fd_lock:
            for entry in self._fds.values():
                os.close(entry.fd)
            self._fds.clear()
        with self._db_lock:
            self.db.close()


def pwrite_all(fd: int, datas: Sequence[bytes | memoryview], offset: int) -> None:
    """Write ``datas`` at ``offset`` (never at the fd's position: a failed batch cannot shift the next)."""
    for i in range(0, len(datas), _IOV_MAX):
        part = datas[i : i + _IOV_MAX]
        total = sum(len(d) for d in part)
        written = os.pwritev(fd, part, offset)
        if written < total:  # short write (rare on regular files): finish from a joined copy, or raise
            rest = memoryview(b"".join(part))
            while written < total:
                written += os.pwrite(fd, rest[written:], offset + written)
        offset += total


def _ident(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _os_error(e: sqlite3.Error) -> OSError:
    """A chunk-map failure as the OSError callers handle (a full disk stays ENOSPC)."""
    full = "full" in str(e).lower()
    return OSError(errno.ENOSPC if full else errno.EIO, f"chunk map: {e}")


class MapReader:
    """A read-only view of a store's chunk map, safe beside a running daemon (fsck, offline listings)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    @classmethod
    def open(cls, layout: Layout) -> MapReader:
        if not layout.exists():
            raise FileNotFoundError(errno.ENOENT, "no store here (no chunk map)", str(layout.db))
        try:
            db = sqlite3.connect(f"{layout.db.as_uri()}?mode=ro", uri=True)
            db.execute("SELECT 1 FROM chunks LIMIT 1")
        except sqlite3.Error as e:  # e.g. no permission for the WAL index of a root-owned store
            raise OSError(errno.EIO, f"cannot read the chunk map {layout.db}: {e}") from None
        return cls(db)

    @classmethod
    def open_or_empty(cls, layout: Layout) -> tuple[MapReader, str]:
        """The map, or an empty one and the problem (missing or unreadable: the packs still tell)."""
        path = layout.db
        if path.exists():
            db = sqlite3.connect(path)
            try:
                db.execute("SELECT count(*) FROM chunks").fetchone()
                return cls(db), ""
            except sqlite3.OperationalError as e:
                if "no such table" not in str(e):
                    db.close()
                    raise
                why = "has no chunk table"
            except sqlite3.DatabaseError as e:
                why = f"is unreadable ({e})"
            db.close()
        else:
            why = "is missing"
        empty = sqlite3.connect(":memory:")
        empty.execute("CREATE TABLE chunks (id BLOB PRIMARY KEY, pack INTEGER, offset INTEGER, length INTEGER)")
        return cls(empty), f"{path} {why}; --repair (or the next mount) rebuilds the map from the packs"

    def rows(self) -> Iterator[tuple[bytes, int, int, int]]:
        """(id, pack, offset, length) of every row, in pack order."""
        yield from self.db.execute("SELECT id, pack, offset, length FROM chunks ORDER BY pack, offset")

    def rows_of_pack(self, pack: int) -> list[tuple[bytes, int, int]]:
        q = "SELECT id, offset, length FROM chunks WHERE pack = ? ORDER BY offset"
        return self.db.execute(q, (pack,)).fetchall()

    def locate(self, cid: bytes) -> Location | None:
        row = self.db.execute("SELECT pack, offset, length FROM chunks WHERE id = ?", (cid,)).fetchone()
        return Location(*row) if row else None

    def stats(self) -> tuple[int, int]:
        """(chunk count, stored chunk bytes)."""
        n, total = self.db.execute("SELECT count(*), coalesce(sum(length), 0) FROM chunks").fetchone()
        return n, total

    def close(self) -> None:
        self.db.close()
