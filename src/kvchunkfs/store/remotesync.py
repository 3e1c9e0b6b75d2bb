"""``remote.db``: what this host last put in (or fetched from) the bucket, per path, and what it
learned of the bucket's packs (a cache: the bucket is the truth).

Per path it records the sha256 of the index object and the stub's ctime then: at every mount the
upload queue compares it with ``snapshots/`` and queues again whatever differs, so the queue is
durable without a write on the save path (see store/remoteupload.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvchunkfs.store import remotepacks as rp

log = logging.getLogger(__name__)

DB_NAME = "remote.db"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS synced (
    rel TEXT PRIMARY KEY, sha BLOB NOT NULL, etag TEXT NOT NULL, ctime_ns INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- packed layout: what this host learned from the bucket's pack indexes (a cache: the bucket is the truth)
CREATE TABLE IF NOT EXISTS rchunk (cid BLOB PRIMARY KEY, pack BLOB NOT NULL, off INTEGER NOT NULL,
    len INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS rpack (pack BLOB PRIMARY KEY, seen REAL NOT NULL);  -- host clock at its last put/touch
CREATE TABLE IF NOT EXISTS ridx (name TEXT PRIMARY KEY);  -- pack indexes read
"""
_SQL_BATCH = 500


@dataclass
class Synced:
    sha: bytes
    etag: str
    ctime_ns: int


class SyncDb:
    """``remote.db``; one connection, used by the tier's threads only (never the FUSE thread)."""

    def __init__(self, path: Path, url: str) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        with contextlib.suppress(OSError):
            os.chmod(path, 0o600)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(_SCHEMA)
        row = self.db.execute("SELECT value FROM meta WHERE key = 'remote'").fetchone()
        if row is None or row[0] != url:  # another bucket: what this host synced is not in it
            for table in ("synced", "rchunk", "rpack", "ridx"):
                self.db.execute(f"DELETE FROM {table}")
            self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('remote', ?)", (url,))
        self.lock = threading.Lock()  # held across SQL only
        # rel -> ETag of every synced path, for the FUSE thread (which never takes ``lock``)
        self._etags: dict[str, str] = dict(self.db.execute("SELECT rel, etag FROM synced").fetchall())
        self._etag_lock = threading.Lock()  # leaf lock, dict operations only

    def etag(self, rel: str) -> str | None:
        with self._etag_lock:
            return self._etags.get(rel)

    def get(self, rel: str) -> Synced | None:
        with self.lock:
            row = self.db.execute("SELECT sha, etag, ctime_ns FROM synced WHERE rel = ?", (rel,)).fetchone()
        return Synced(*row) if row else None

    def put(self, rel: str, row: Synced) -> None:
        with self.lock:
            self.db.execute(
                "INSERT OR REPLACE INTO synced (rel, sha, etag, ctime_ns) VALUES (?, ?, ?, ?)",
                (rel, row.sha, row.etag, row.ctime_ns),
            )
        with self._etag_lock:
            self._etags[rel] = row.etag

    def delete(self, rel: str) -> None:
        with self.lock:
            self.db.execute("DELETE FROM synced WHERE rel = ?", (rel,))
        with self._etag_lock:
            self._etags.pop(rel, None)

    def all(self) -> dict[str, int]:
        """rel -> ctime_ns of every synced path."""
        with self.lock:
            return dict(self.db.execute("SELECT rel, ctime_ns FROM synced").fetchall())

    def rows(self) -> dict[str, Synced]:
        with self.lock:
            return {rel: Synced(sha, etag, ct) for rel, sha, etag, ct in self.db.execute("SELECT * FROM synced")}

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # -- the packed layout's cache ---------------------------------------------------------------

    def newest_packidx(self) -> str | None:
        with self.lock:
            row = self.db.execute("SELECT max(name) FROM ridx").fetchone()
        return row[0] if row else None

    def read_packidx(self, since: str = "") -> set[str]:
        """The pack indexes read, of those named from ``since`` on (names start with their time)."""
        with self.lock:
            return {r[0] for r in self.db.execute("SELECT name FROM ridx WHERE name >= ?", (since,))}

    def learned(self, name: str, packs: list[rp.PackDesc]) -> None:
        """What one pack index says (a chunk in several packs: the last one learned wins)."""
        rows = [(cid, d.pack, loc.offset, loc.length) for d in packs for cid, loc in d.locs()]
        with self.lock, self._transaction():
            self.db.executemany("INSERT OR REPLACE INTO rchunk (cid, pack, off, len) VALUES (?, ?, ?, ?)", rows)
            self.db.executemany("INSERT OR IGNORE INTO rpack (pack, seen) VALUES (?, 0)", [(d.pack,) for d in packs])
            self.db.execute("INSERT OR IGNORE INTO ridx (name) VALUES (?)", (name,))

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One transaction (the connection autocommits: each statement would be one, with its fsync)."""
        self.db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def locate(self, cids: list[bytes]) -> dict[bytes, tuple[rp.Loc, float]]:
        """chunk id -> (where in a pack, when this host last put or touched the pack)."""
        out = {}
        with self.lock:
            for i in range(0, len(cids), _SQL_BATCH):
                part = cids[i : i + _SQL_BATCH]
                q = ("SELECT c.cid, c.pack, c.off, c.len, p.seen FROM rchunk c JOIN rpack p ON p.pack = c.pack "
                     f"WHERE c.cid IN ({','.join('?' * len(part))})")  # fmt: skip
                for cid, pack, off, n, seen in self.db.execute(q, part):
                    out[cid] = (rp.Loc(pack, off, n), seen)
        return out

    def seen(self, packs: list[bytes], at: float) -> None:
        with self.lock, self._transaction():
            self.db.executemany("INSERT OR REPLACE INTO rpack (pack, seen) VALUES (?, ?)", [(p, at) for p in packs])

    def forget_pack(self, pack: bytes) -> None:
        """The bucket no longer has it (``gc --remote``): forget what it held."""
        with self.lock, self._transaction():
            self.db.execute("DELETE FROM rchunk WHERE pack = ?", (pack,))
            self.db.execute("DELETE FROM rpack WHERE pack = ?", (pack,))


def read_synced(root: Path) -> dict[str, bytes]:
    """rel -> sha256 of the index this host last put in or fetched from the bucket (``remote.db``
    of the store at ``root``, read-only; {} without one). A stub whose content has that hash is in
    the bucket whole (index last: the bucket never holds an index naming a missing chunk), so the
    chunks of it the local packs lack are evicted or not fetched yet, not lost (recovery, fsck)."""
    path = root / DB_NAME
    if not path.exists():
        return {}
    try:
        db = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
        try:
            return dict(db.execute("SELECT rel, sha FROM synced").fetchall())
        finally:
            db.close()
    except sqlite3.Error as e:
        log.warning("cannot read %s: %s", path, e)
        return {}
