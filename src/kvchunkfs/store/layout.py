"""Where everything lives in a store directory, and the small file-system helpers every layer shares.

```
STORE/
  snapshots/      the mount's tree: one stub per file, real directories for directories
  packs/          00000001.pack ...: chunks back to back
  chunks.db       the chunk map (SQLite, WAL)
  tmp/            complete new stubs waiting for their rename; the API socket's staging dir
  staging/        saves written while the memory tier is short; put-backs too big for it (unlinked)
  prev/           durability=close: the version a save replaced, until the new one is durable
  lost+found/     stubs recovery set aside after a crash (unreadable, or naming chunks that are gone)
  lock            flock held by the one process working on the store
  api.sock        the daemon's HTTP API
```

Only this module spells these names; everything else asks a ``Layout``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

PACK_SUFFIX = ".pack"
DB_NAME = "chunks.db"
LOCK_NAME = "lock"
SOCKET_NAME = "api.sock"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def snapshots(self) -> Path:
        return self.root / "snapshots"

    @property
    def packs(self) -> Path:
        return self.root / "packs"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def staging(self) -> Path:
        return self.root / "staging"

    @property
    def prev(self) -> Path:
        return self.root / "prev"

    @property
    def lost_found(self) -> Path:
        return self.root / "lost+found"

    @property
    def db(self) -> Path:
        return self.root / DB_NAME

    @property
    def lock(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def socket(self) -> Path:
        return self.root / SOCKET_NAME

    def exists(self) -> bool:
        """A store has been created here (its chunk map exists)."""
        return self.db.exists()

    def is_store(self) -> bool:
        """A store, even one whose chunk map is lost (its packs remain)."""
        return self.db.exists() or self.packs.is_dir()

    def snapshot(self, rel: str) -> Path:
        """The stub of ``rel`` (a path relative to ``snapshots/``; "" is the directory itself)."""
        return self.snapshots / rel if rel else self.snapshots

    def pack_path(self, pack: int) -> Path:
        return self.packs / f"{pack:08d}{PACK_SUFFIX}"

    def pack_ids(self) -> list[int]:
        """Numbers of the pack files on disk, ascending (other files in packs/ are named and skipped)."""
        if not self.packs.is_dir():
            return []
        numbers = (pack_number(p) for p in self.packs.glob("*" + PACK_SUFFIX))
        return sorted(n for n in numbers if n >= 0)

    def create_dirs(self) -> None:
        """The store's directories, private to the daemon's user (docs/design.md, "Threat model").

        Other users reach snapshots only through the mount; ``snapshots/`` keeps its mode, which
        the mount shows as its root's. A store made before this rule is tightened here.
        """
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        restrict(self.root, 0o700)
        self.snapshots.mkdir(mode=0o777, exist_ok=True)
        for d in (self.packs, self.tmp, self.staging, self.prev):
            d.mkdir(mode=0o700, exist_ok=True)
            restrict(d, 0o700)

    def make_private(self) -> None:
        """Packs and the map readable by the daemon's user only, also in a store made before this rule.

        The map is created 0600 before SQLite opens it: SQLite gives its -wal and -shm files the mode
        of the database file.
        """
        os.close(os.open(self.db, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        wal, shm = self.root / (DB_NAME + "-wal"), self.root / (DB_NAME + "-shm")
        for path in (self.db, wal, shm, self.lock, *self.packs.glob("*" + PACK_SUFFIX)):
            restrict(path, 0o600)


def loose_chunk_name(cid: bytes) -> str:
    """A chunk's name in a loose casync/desync store (``export-store``, the shared tier's bucket):
    ``<first 4 hex>/<64 hex>``."""
    name = cid.hex()
    return f"{name[:4]}/{name}"


def pack_number(path: Path) -> int:
    """The number of a pack file, or -1 for a file in packs/ that is not one (named in the log, left alone)."""
    stem = path.name[: -len(PACK_SUFFIX)]
    if stem.isascii() and stem.isdigit() and len(stem) <= 18:
        return int(stem)
    log.warning("%s is not a pack file; ignored", path)
    return -1


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


def file_size(path: Path) -> int:
    """Size of ``path`` (not through a symlink), 0 if it does not exist."""
    try:
        return path.lstat().st_size
    except FileNotFoundError:
        return 0


def fsync_path(path: os.PathLike[str] | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: os.PathLike[str] | str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the store lock -------------------------------------------------------------------------------


class StoreLocked(RuntimeError):
    """Another process (a mounted daemon or an offline tool) holds the store."""


def lock_store(root: Path) -> int:
    """Take the store's lock for this process; returns the fd to keep open (closing it unlocks)."""
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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


def lock_holder(root: Path) -> int | None:
    """The pid the store's lock file names if that process still runs (the daemon serving it, or an
    offline tool); None if unknown. Only reads: taking the lock to test it could fail a daemon
    starting at that moment."""
    try:
        with open(root / LOCK_NAME, "rb") as f:
            pid = int(f.read(32).strip() or b"0")
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and Path(f"/proc/{pid}").exists() else None


def try_lock_store(root: Path) -> int | None:
    """The lock's fd, or None if a daemon (or another tool) holds the store."""
    try:
        return lock_store(root)
    except StoreLocked:
        return None
