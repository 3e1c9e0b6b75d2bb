"""Chunk store: append-only pack files plus a SQLite map chunk id -> (pack, offset, length).

Write order for new chunks (see docs/design.md): chunk bytes are appended to the open pack first,
then the map rows are committed. A crash between the two leaves unreferenced bytes at a pack's
tail, which recovery truncates. A map row therefore never points at bytes that were not written.

Pins protect chunks that open files use but no stub names yet (a save in progress, a file that
was unlinked while open). Garbage collection treats pinned ids as live; the existence check and
the pin of a save happen under ``lock``, the same lock GC holds while it deletes map rows, so a
chunk found in the store cannot vanish before the stub that names it is renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import stat
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PACK_SUFFIX = ".pack"
_SQL_BATCH = 500
_IOV_MAX = 512  # writev takes at most IOV_MAX (1024) buffers


class ChunkMissing(LookupError):
    """A chunk an index names is not in the store."""


class ChunkCorrupt(ValueError):
    """Chunk bytes read from a pack do not hash to their id."""


@dataclass(frozen=True)
class Location:
    pack: int
    offset: int
    length: int


@dataclass
class StoreCounters:
    """Monotonic counters for metrics and tests (bytes and reads that reached disk)."""

    chunks_written: int = 0
    bytes_written: int = 0
    chunks_deduped: int = 0
    bytes_deduped: int = 0
    pack_reads: int = 0
    pack_bytes_read: int = 0


class _PackFd:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.retired = False


class PackStore:
    def __init__(self, root: Path, pack_size: int = 64 << 20, durable: bool = False) -> None:
        self.root = root
        self.packs_dir = root / "packs"
        self.packs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _make_private(root, self.packs_dir)  # every snapshot's bytes: the daemon's user only
        self.pack_size = pack_size
        self.durable = durable
        self.lock = threading.RLock()  # map writes, pack appends, pins, GC sweep
        self._fd_lock = threading.Lock()
        self._fds: dict[int, _PackFd] = {}
        self.db = sqlite3.connect(root / "chunks.db", check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        self.db.executescript(
            """
            CREATE TABLE IF NOT EXISTS chunks (
                id BLOB PRIMARY KEY, pack INTEGER NOT NULL, offset INTEGER NOT NULL, length INTEGER NOT NULL
            ) WITHOUT ROWID;
            CREATE INDEX IF NOT EXISTS chunks_by_pack ON chunks (pack, offset);
            CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            """
        )
        self._db_lock = threading.Lock()  # sqlite3 connection is shared between threads
        self._pack_id: int | None = None  # pack currently appended to
        self._pack_fd = -1
        self._pack_end = 0
        self._unsynced: set[int] = set()  # packs written since the last sync()
        self.pins: dict[object, set[bytes]] = {}
        self.counters = StoreCounters()

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
                q = f"SELECT id, pack, offset, length FROM chunks WHERE id IN ({','.join('?' * len(part))})"
                for cid, pack, off, length in self.db.execute(q, part):
                    found[cid] = Location(pack, off, length)
        return found

    def locate(self, cid: bytes) -> Location:
        loc = self.locate_many([cid]).get(cid)
        if loc is None:
            raise ChunkMissing(cid.hex())
        return loc

    def pack_ids(self) -> list[int]:
        numbers = (pack_number(p) for p in self.packs_dir.glob("*" + PACK_SUFFIX))
        return sorted(n for n in numbers if n >= 0)

    def chunks_in_pack(self, pack: int) -> list[tuple[bytes, int, int]]:
        """(id, offset, length) of the mapped chunks of one pack, in pack order."""
        with self._db_lock:
            q = "SELECT id, offset, length FROM chunks WHERE pack = ? ORDER BY offset"
            return self.db.execute(q, (pack,)).fetchall()

    def pack_path(self, pack: int) -> Path:
        return self.packs_dir / f"{pack:08d}{PACK_SUFFIX}"

    def stats(self) -> tuple[int, int]:
        """(chunk count, stored chunk bytes) according to the map."""
        with self._db_lock:
            n, total = self.db.execute("SELECT count(*), coalesce(sum(length), 0) FROM chunks").fetchone()
        return n, total

    # -- maintenance: GC, recovery, fsck ----------------------------------------------------

    def chunk_lengths(self) -> dict[bytes, int]:
        """Every mapped chunk id with its length."""
        with self._db_lock:
            return dict(self.db.execute("SELECT id, length FROM chunks"))

    def pack_usage(self) -> dict[int, tuple[int, int, int]]:
        """pack -> (mapped chunks, mapped bytes, end of its last mapped chunk)."""
        q = "SELECT pack, count(*), sum(length), max(offset + length) FROM chunks GROUP BY pack"
        with self._db_lock:
            return {pack: (n, total, end) for pack, n, total, end in self.db.execute(q)}

    def _write_many(self, sql: str, params: Sequence[tuple], durable: bool = False) -> int:
        """Run ``sql`` for every tuple in one transaction; returns the rows changed.

        ``durable``: the commit itself is fsynced (WAL + synchronous=FULL), whatever the setting.
        """
        with self._db_lock:
            if durable and not self.durable:
                self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("BEGIN")
            try:
                changed = 0
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

    def delete_chunks(self, ids: Iterable[bytes]) -> int:
        """Drop map rows (GC's sweep: call under ``lock``); the pack bytes become dead space."""
        return self._write_many("DELETE FROM chunks WHERE id = ?", [(cid,) for cid in ids])

    def move_chunks(self, old_pack: int, moves: Sequence[tuple[bytes, int, int]]) -> int:
        """Point rows at copies (id, new pack, new offset), each only if it is still in ``old_pack``.

        Durable even with durability=close: the old pack is deleted next, and a power failure must
        not bring back rows that point into it.
        """
        sql = "UPDATE chunks SET pack = ?, offset = ? WHERE id = ? AND pack = ?"
        with self.lock:
            return self._write_many(sql, [(pack, off, cid, old_pack) for cid, pack, off in moves], durable=True)

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
        """Delete a pack no row points into (never the open one); False if it is still in use."""
        with self.lock:
            with self._db_lock:
                used = self.db.execute("SELECT 1 FROM chunks WHERE pack = ? LIMIT 1", (pack,)).fetchone()
            if pack == self._pack_id or used:
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.pack_path(pack))
        self.retire_pack(pack)
        return True

    # -- writing ----------------------------------------------------------------------------

    def add_chunks(self, chunks: Sequence[tuple[bytes, bytes | memoryview]], owner: object) -> int:
        """Store the chunks the store lacks and pin all of them for ``owner``.

        Returns the number of new bytes written. Raises OSError (e.g. ENOSPC) with nothing
        committed for the failing batch; chunks already in the store are still pinned.
        """
        with self.lock:
            pinned = self.pins.setdefault(owner, set())
            pinned.update(cid for cid, _ in chunks)
            try:
                present = self.locate_many(cid for cid, _ in chunks)
            except sqlite3.Error as e:  # callers (the chunker thread) handle OSError only
                raise _os_error(e) from e
            new: dict[bytes, bytes | memoryview] = {}
            for cid, data in chunks:
                if cid in present or cid in new:
                    self.counters.chunks_deduped += 1
                    self.counters.bytes_deduped += len(data)
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
            if self._pack_id is not None and self._pack_end + len(items[i][1]) > self.pack_size:
                self._close_pack()
            room = self.pack_size - (self._pack_end if self._pack_id is not None else 0)
            group: dict[bytes, bytes | memoryview] = {}
            size = 0
            while i < len(items) and (not group or size + len(items[i][1]) <= room):
                group[items[i][0]] = items[i][1]
                size += len(items[i][1])
                i += 1
            self._append(group)

    def _append(self, new: dict[bytes, bytes | memoryview]) -> None:
        fd, pack, start = self._open_pack()
        datas = list(new.values())
        total = sum(len(d) for d in datas)
        rows = []
        off = start
        for cid, data in new.items():
            rows.append((cid, pack, off, len(data)))
            off += len(data)
        try:
            for i in range(0, len(datas), _IOV_MAX):
                _write_all(fd, datas[i : i + _IOV_MAX])
            if self.durable:
                os.fsync(fd)
            self._insert_rows(rows)
        except (OSError, sqlite3.Error) as e:
            # Nothing of this batch is in the map; cut the partial bytes so the pack stays exact and
            # the next batch is written at _pack_end again (a full disk can fail the map commit too).
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
                os.lseek(fd, start, os.SEEK_SET)
            if isinstance(e, sqlite3.Error):
                raise _os_error(e) from e
            raise
        self._pack_end = off
        self._unsynced.add(pack)
        self.counters.chunks_written += len(rows)
        self.counters.bytes_written += total
        if self._pack_end >= self.pack_size:
            self._close_pack()

    def _insert_rows(self, rows: list[tuple[bytes, int, int, int]]) -> None:
        with self._db_lock:
            self.db.execute("BEGIN")
            try:
                self.db.executemany("INSERT OR REPLACE INTO chunks (id, pack, offset, length) VALUES (?,?,?,?)", rows)
                self.db.execute("COMMIT")
            except sqlite3.Error:
                with contextlib.suppress(sqlite3.Error):
                    self.db.execute("ROLLBACK")
                raise

    def _open_pack(self) -> tuple[int, int, int]:
        if self._pack_id is None:
            pack, fd = self.create_pack()
            self._pack_id, self._pack_fd, self._pack_end = pack, fd, 0
        return self._pack_fd, self._pack_id, self._pack_end

    def create_pack(self) -> tuple[int, int]:
        """A new empty pack (number, write fd) under a number never used before in this store.

        Numbers of deleted packs are not reused: a reader that located a chunk in a pack GC
        deleted must get FileNotFoundError and look again, not read another pack's bytes.
        """
        with self.lock:
            ids = self.pack_ids()
            try:
                last = max(int(self.get_meta("last_pack") or 0), ids[-1] if ids else 0)
                self.set_meta("last_pack", str(last + 1))
            except sqlite3.Error as e:
                raise _os_error(e) from e
            fd = os.open(self.pack_path(last + 1), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            return last + 1, fd

    def _close_pack(self) -> None:
        if self._pack_id is not None:
            os.close(self._pack_fd)
            self._pack_id, self._pack_fd, self._pack_end = None, -1, 0

    @property
    def open_pack(self) -> int | None:
        """The pack new chunks go to; GC never touches it."""
        return self._pack_id

    def sync(self) -> None:
        """Make every chunk written so far durable (pack data, then the map)."""
        with self.lock:
            for pack in sorted(self._unsynced):
                with contextlib.suppress(FileNotFoundError), self.pack_fd(pack) as fd:
                    os.fsync(fd)
            self._unsynced.clear()
            with self._db_lock:
                self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            _fsync_dir(self.packs_dir)

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

    # -- reading ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def pack_fd(self, pack: int) -> Iterator[int]:
        """A read fd for ``pack`` that stays valid even if GC deletes the pack meanwhile."""
        with self._fd_lock:
            entry = self._fds.get(pack)
            if entry is None:
                entry = _PackFd(os.open(self.pack_path(pack), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
                self._fds[pack] = entry
            entry.users += 1
        try:
            yield entry.fd
        finally:
            with self._fd_lock:
                entry.users -= 1
                if entry.retired and entry.users == 0:
                    os.close(entry.fd)

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
        self.counters.pack_reads += 1
        self.counters.pack_bytes_read += length
        return data

    def close(self) -> None:
        with self.lock:
            self._close_pack()
        with self._fd_lock:
            for entry in self._fds.values():
                os.close(entry.fd)
            self._fds.clear()
        with self._db_lock:
            self.db.close()


def _write_all(fd: int, datas: list[bytes | memoryview]) -> None:
    written = os.writev(fd, datas)
    total = sum(len(d) for d in datas)
    if written < total:  # short write (rare on regular files): finish from a joined copy, or raise
        rest = memoryview(b"".join(datas))
        while written < total:
            written += os.write(fd, rest[written:])


def _os_error(e: sqlite3.Error) -> OSError:
    """A chunk-map failure as the OSError callers handle (a full disk stays ENOSPC)."""
    full = "full" in str(e).lower()
    return OSError(errno.ENOSPC if full else errno.EIO, f"chunk map: {e}")


def pack_number(path: Path) -> int:
    """The number of a pack file, or -1 for a file in packs/ that is not one (named in the log, left alone)."""
    stem = path.name[: -len(PACK_SUFFIX)]
    if stem.isascii() and stem.isdigit() and len(stem) <= 18:
        return int(stem)
    log.warning("%s is not a pack file; ignored", path)
    return -1


def _make_private(root: Path, packs_dir: Path) -> None:
    """Packs and the map readable by the daemon's user only, also in a store made before this rule.

    The map is created 0600 before SQLite opens it: SQLite gives its -wal and -shm files the mode
    of the database file.
    """
    db = root / "chunks.db"
    os.close(os.open(db, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    restrict(packs_dir, 0o700)
    for path in (db, root / "chunks.db-wal", root / "chunks.db-shm", *packs_dir.glob("*" + PACK_SUFFIX)):
        restrict(path, 0o600)


def restrict(path: Path, allowed: int) -> None:
    """Clear the mode bits of ``path`` outside ``allowed``, never through a symlink; a missing path is fine."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as e:
        log.warning("cannot restrict the permissions of %s: %s", path, e)
        return
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & ~allowed:
            os.fchmod(fd, mode & allowed)
            log.info("%s was mode %o; now %o", path, mode, mode & allowed)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
