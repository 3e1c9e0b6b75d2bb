"""The chunk map: a SQLite cache of chunk id -> (pack, offset, length, quick sum), and each pack's
committed end (table ``packs``). Packs are the truth (docs/design.md, "Packs are the truth, the map is
a cache"): every row names bytes its pack describes, and the map can always be rebuilt from them.

The map file may be deleted or replaced under a running daemon; every write transaction first
checks that ``chunks.db`` is still the file this connection opened, and refuses (EIO) otherwise.

``ChunkMap`` is the read-write map ``PackStore`` keeps; ``MapReader`` a read-only view for tools.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvchunkfs.format import idarrays
from kvchunkfs.format.index import Index
from kvchunkfs.store.layout import Layout

log = logging.getLogger(__name__)


_SQL_BATCH = 500
PAGE_ROWS = 1 << 14  # ``mapped_pages``: rows per page (~2.5 MiB as Python rows, 0.6 MiB as arrays)
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
UPSERT_END = "INSERT INTO packs (pack, end) VALUES (?, ?) ON CONFLICT (pack) DO UPDATE SET end = max(end, excluded.end)"


class ChunkMissing(LookupError):
    """A chunk an index names is not in the store."""


@dataclass(frozen=True)
class Location:
    pack: int
    offset: int
    length: int
    sum: bytes | None = None  # xxh3-64 of the chunk's bytes as written (None: a row that has none)


class ChunkMap:
    """The map's connection and every query of it. Thread-safe: each statement or transaction runs
    under ``_db_lock`` (after ``PackStore.lock`` in the lock order: docs/design.md, "Concurrency")."""

    def __init__(self, db_path: Path, durable: bool, on_disk: Callable[[], list[int]]) -> None:
        self.durable = durable
        self.db_path = db_path
        self.db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
        self._db_ident = _ident(self.db_path)  # the file this connection writes to
        self._db_lost: str | None = None
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        self._db_lock = threading.Lock()  # sqlite3 connection is shared between threads
        # Checkpoints go through a connection of their own: the WAL's and the map's fsyncs never
        # hold ``_db_lock``, so an open's lookups do not wait for them.
        self._ckpt_db: sqlite3.Connection | None = None
        self._ckpt_lock = threading.Lock()
        # (rows, bytes) of the map, counted once and then kept up to date by every write; None:
        # count again. Read without a lock (metrics), written under _db_lock.
        self._map_stats: tuple[int, int] | None = None
        self._migrate(on_disk)

    def _migrate(self, pack_ids: Callable[[], list[int]]) -> None:
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
        on_disk = pack_ids()
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
    def length_mismatch(index: Index, found: dict[bytes, Location], lo: int = 0, hi: int | None = None) -> str | None:
        """How ``index`` (its chunks ``lo`` to ``hi``) disagrees with the map (``found``: those chunks
        located) about a chunk's length, or None. Chunks the map lacks are not judged here (reading
        them fails with EIO)."""
        for i in range(lo, len(index) if hi is None else hi):
            cid = index.ids[i]
            loc = found.get(cid)
            if loc is not None and loc.length != index.length(i):
                return f"chunk {i} ({cid.hex()}) is {index.length(i)} bytes in the index, {loc.length} in the map"
        return None

    def chunks_in_pack(self, pack: int) -> list[tuple[bytes, int, int]]:
        """(id, offset, length) of the mapped chunks of one pack, in pack order."""
        with self._db_lock:
            q = "SELECT id, offset, length FROM chunks WHERE pack = ? ORDER BY offset"
            return self.db.execute(q, (pack,)).fetchall()

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

    def ids_with_keys(self, keys: Iterable[bytes]) -> list[bytes]:
        """Mapped ids that begin with one of ``keys`` (each shorter than an id), a batch of keys
        per hold of the map's lock."""
        keys = list(keys)
        out: list[bytes] = []
        for i in range(0, len(keys), _SQL_BATCH):
            with self._db_lock:
                for key in keys[i : i + _SQL_BATCH]:
                    pad = idarrays.ID_LEN - len(key)
                    rows = self.db.execute(
                        "SELECT id FROM chunks WHERE id >= ? AND id <= ?", (key + b"\0" * pad, key + b"\xff" * pad)
                    )
                    out += [cid for (cid,) in rows]
        return out

    def mapped_pages(self, rows: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every mapped chunk as (ids as ``idarrays.ID`` rows, lengths) pages of up to ``rows``, in
        id order, the map's lock held per page (a save waits for one page at most). A row added or
        dropped meanwhile may or may not be in a page; every row present throughout is, once."""
        rows = rows or PAGE_ROWS
        after = b""
        while True:
            with self._db_lock:
                page = self.db.execute(
                    "SELECT id, length FROM chunks WHERE id > ? ORDER BY id LIMIT ?", (after, rows)
                ).fetchall()
            if not page:
                return
            after = page[-1][0]
            page = [row for row in page if len(row[0]) == idarrays.ID_LEN]  # a map row is never anything else
            yield idarrays.from_list([cid for cid, _ in page]), np.array([n for _, n in page], np.int64)

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

    def forget_pack(self, pack: int) -> None:
        """Drop the committed end of a pack that is gone."""
        self._commit([("DELETE FROM packs WHERE pack = ?", [(pack,)])])

    def rows_outside(self, pack: int, size: int) -> list[bytes]:
        """Ids of the rows of ``pack`` that end past ``size`` bytes."""
        with self._db_lock:
            q = "SELECT id FROM chunks WHERE pack = ? AND offset + length > ?"
            return [cid for (cid,) in self.db.execute(q, (pack, size))]

    def mapped_end(self, pack: int) -> int:
        """The end of the last mapped chunk of ``pack`` (0: no row points into it)."""
        with self._db_lock:
            q = "SELECT coalesce(max(offset + length), 0) FROM chunks WHERE pack = ?"
            (end,) = self.db.execute(q, (pack,)).fetchone()
        return end

    def pack_state(self, pack: int) -> tuple[bool, bool]:
        """(some row points into ``pack``, the map knows it: table ``packs``)."""
        with self._db_lock:
            used = self.db.execute("SELECT 1 FROM chunks WHERE pack = ? LIMIT 1", (pack,)).fetchone()
            known = self.db.execute("SELECT 1 FROM packs WHERE pack = ?", (pack,)).fetchone()
        return used is not None, known is not None

    def _add_rows(self, rows: list[tuple[bytes, int, int, int, bytes]], pack: int, end: int) -> None:
        """New rows (none of their ids is mapped) and the pack's new committed end, in one transaction."""
        with self._db_lock:
            self._check_db()
            self.db.execute("BEGIN")
            try:
                sql = "INSERT OR REPLACE INTO chunks (id, pack, offset, length, sum) VALUES (?,?,?,?,?)"
                self.db.executemany(sql, rows)
                self.db.execute(UPSERT_END, (pack, end))
                self.db.execute("COMMIT")
            except sqlite3.Error:
                with contextlib.suppress(sqlite3.Error):
                    self.db.execute("ROLLBACK")
                raise
            self._count_rows(len(rows), sum(r[3] for r in rows))

    def checkpoint_map(self) -> None:
        """Copy the WAL into the map file as far as no reader holds it back (PASSIVE). The WAL is
        fsynced before and the map after (synchronous NORMAL on the checkpointing connection): every
        row committed so far is durable when this returns. EIO if the map file was replaced."""
        with self._ckpt_lock:
            self._check_db()
            try:
                if self._ckpt_db is None:
                    db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
                    db.execute("PRAGMA synchronous=NORMAL")
                    self._ckpt_db = db
                self._ckpt_db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error as e:
                raise os_error(e) from e

    def close_map(self) -> None:
        with self._ckpt_lock:
            if self._ckpt_db is not None:
                self._ckpt_db.close()
                self._ckpt_db = None
        with self._db_lock:
            self.db.close()


def _ident(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def os_error(e: sqlite3.Error) -> OSError:
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

    def meta(self, key: str) -> str | None:
        """A value of the map's ``meta`` table (None: not there, or no such table)."""
        try:
            row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        except sqlite3.Error:
            return None
        return row[0] if row else None

    def close(self) -> None:
        self.db.close()
