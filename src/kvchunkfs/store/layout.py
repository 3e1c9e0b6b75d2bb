"""Where everything lives in a store directory, and the small file-system helpers every layer shares.

```
STORE/
  snapshots/      the mount's tree: one stub per file, real directories for directories
  packs/          00000001.pack ...: chunks back to back
  chunks.db       the chunk map (SQLite, WAL)
  tmp/            complete new stubs waiting for their rename; the API socket's staging dir
  staging/        plain copies of files written out of order
  lock            flock held by the one process working on the store
  api.sock        the daemon's HTTP API
```

Only this module spells these names; everything else asks a ``Layout``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACK_SUFFIX = ".pack"
DB_NAME = "chunks.db"
LOCK_NAME = "lock"
SOCKET_NAME = "api.sock"


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
        """Numbers of the pack files on disk, ascending."""
        if not self.packs.is_dir():
            return []
        ids = []
        for p in self.packs.glob("*" + PACK_SUFFIX):
            stem = p.name[: -len(PACK_SUFFIX)]
            if stem.isdigit():
                ids.append(int(stem))
        return sorted(ids)

    def create_dirs(self) -> None:
        for d in (self.snapshots, self.packs, self.tmp, self.staging):
            d.mkdir(parents=True, exist_ok=True)


def walk_stubs(snapshots: Path) -> Iterator[Path]:
    """Every regular file under ``snapshots`` in sorted order (no symlinks, FIFOs or devices).

    A directory that cannot be listed raises: an incomplete walk would make chunks look unused.
    """
    if not snapshots.is_dir():  # an empty walk would make every chunk garbage
        raise FileNotFoundError(errno.ENOENT, "the snapshots directory is missing", str(snapshots))

    def fail(e: OSError) -> None:
        if not isinstance(e, FileNotFoundError):  # a directory removed during the walk
            raise e

    for dirpath, dirnames, files in os.walk(snapshots, onerror=fail):
        dirnames.sort()
        for name in sorted(files):
            path = Path(dirpath, name)
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):
                    yield path
            except FileNotFoundError:  # removed meanwhile
                continue


def file_size(path: Path) -> int:
    """Size of ``path``, 0 if it does not exist."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def fsync_path(path: os.PathLike[str] | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: os.PathLike[str] | str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the store lock -------------------------------------------------------------------------------


class StoreLocked(RuntimeError):
    """Another process (a mounted daemon or an offline tool) holds the store."""


def lock_store(root: Path) -> int:
    """Take the store's lock for this process; returns the fd to keep open (closing it unlocks)."""
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
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
    """The lock's fd, or None if a daemon (or another tool) holds the store."""
    try:
        return lock_store(root)
    except StoreLocked:
        return None
