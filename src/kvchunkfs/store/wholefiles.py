"""Whole copies of snapshots as plain files: staged saves and the hot tier.

```
WHOLE/                 default /dev/shm/kv-chunk-fs-UID/STORE-KEY: memory, survives a daemon
                       restart, not a reboot; as root, a tmpfs of its own with huge pages (memfs)
  boot_id              the boot the files below were written in
  staged/              a save's bytes as the client wrote them (passed through), until ingested;
                       copies of an open file being rewritten
  hot/SUM-SIZE         a verified whole copy of a stored snapshot (file checksum, size): a cache
  hot/*.part           a copy being put back
```

A staged file named by a stub (``stubs.STAGED``) *is* that snapshot until ingestion has stored its
chunks and replaced the stub; no eviction touches it. Hot copies are content-addressed by the file
record's checksum, so a save, rename or unlink never makes one stale: an entry no stub names any
more is simply never opened again and ages out. After a reboot nothing here is trusted (a file
not fsynced may hold torn bytes): everything is deleted, and stubs naming a staged file keep their
previous version (``boot_id``).

Only this module spells these names. The directory and its parent must be the daemon's own, mode
0700: another local user can neither read a snapshot here nor swap a file under the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from kvchunkfs.store import memfs

log = logging.getLogger(__name__)

BOOT_ID = "/proc/sys/kernel/random/boot_id"
BOOT_ID_ENV = "KVCFS_BOOT_ID_FILE"  # tests: a file standing in for the kernel's boot id (a simulated reboot)
SHM = Path("/dev/shm")
PART = ".part"
STAGED_PREFIX = "s-"


class WholeFilesError(OSError):
    pass


def boot_id() -> str:
    path = os.environ.get(BOOT_ID_ENV) or BOOT_ID
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def default_dir(store: Path) -> Path:
    """Under /dev/shm, one directory per user and store (the store's real path, hashed)."""
    key = hashlib.sha256(os.fsencode(os.path.realpath(store))).hexdigest()[:16]
    return SHM / f"kv-chunk-fs-{os.geteuid()}" / key


def _private_dir(path: Path, create_parents: bool) -> None:
    """``path`` exists as a directory of ours, mode 0700, not a symlink; else WholeFilesError."""
    if create_parents:
        parent = path.parent
        with contextlib.suppress(FileExistsError):
            os.mkdir(parent, 0o700)
        _check_private(parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    _check_private(path)


def _check_private(path: Path) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise WholeFilesError(
            errno.EPERM,
            f"{path} must be a directory owned by uid {os.geteuid()} with mode 0700 "
            f"(it is uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); another user could read or swap "
            "snapshots there",
        )


@dataclass
class HotStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    put_backs: int = 0
    adopted: int = 0


def open_whole_files(store: Path, configured: Path | None, budget: int, huge_pages: bool = True) -> WholeFiles:
    """The store's whole-file directory: ``configured``, else under /dev/shm (else, with no
    /dev/shm, ``STORE/whole``: saves then write whole files to the store's disk, logged); with
    ``huge_pages``, a tmpfs of its own with huge pages where it can be (``memfs``). The hot
    tier's budget is capped at half the directory's file system: staged saves need room too."""
    if configured is not None:
        root, parents = configured, False
    elif SHM.is_dir():
        root, parents = default_dir(store), True
    else:
        root, parents = store / "whole", False
        log.warning("no /dev/shm: staged saves and whole copies go to %s, on the store's disk", root)
    whole = WholeFiles(root, budget, create_parents=parents, huge_pages=huge_pages)
    sv = os.statvfs(root)
    cap = sv.f_blocks * sv.f_frsize // 2
    if whole.budget > cap:
        log.info("hot_tier_size %d MiB is more than half of %s's file system: %d MiB", budget >> 20, root, cap >> 20)
        whole.budget = cap
        whole.evict()
    return whole


class WholeFiles:
    """The staged files and the hot tier of one store (thread-safe: the lock guards only the
    in-memory table, never I/O)."""

    def __init__(self, root: Path, budget: int, create_parents: bool = True, huge_pages: bool = False) -> None:
        self.root = root
        self.budget = budget  # bytes of hot copies kept (0: none outlives its last close)
        self.staged_dir = root / "staged"
        self.hot_dir = root / "hot"
        self.stats = HotStats()
        self._lock = threading.Lock()
        self._hot: OrderedDict[str, int] = OrderedDict()  # key -> size, least recently used first
        self._hot_bytes = 0
        _private_dir(root, create_parents)
        # Before anything is made inside: a new mount hides what the directory held.
        self.own_tmpfs = huge_pages and memfs.huge_tmpfs(root, self.staged_dir)
        for d in (self.staged_dir, self.hot_dir):
            _private_dir(d, False)
        self.boot = boot_id()
        self.rebooted = self._check_boot()
        self.in_memory = memfs.fs_type(root) in memfs.IN_MEMORY  # a read or write here never waits for a disk
        self._load_hot()

    # -- start ------------------------------------------------------------------------------

    def _check_boot(self) -> bool:
        """After a reboot (or with no boot id on record: the directory is new, as after a reboot
        empties /dev/shm) every file here is deleted: one not fsynced may hold torn bytes. True then:
        stubs may name staged saves that are gone (the mount clears them)."""
        now = self.boot
        mark = self.root / "boot_id"
        try:
            was = mark.read_text().strip()
        except FileNotFoundError:
            was = None
        wiped = False
        if was != now:
            for d in (self.staged_dir, self.hot_dir):
                for entry in os.scandir(d):
                    wiped = True
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
            if wiped:
                log.warning("whole files in %s are from another boot: deleted (untrusted after a power cut)", self.root)
            tmp = self.root / f"boot_id.{uuid.uuid4().hex}"
            tmp.write_text(now + "\n")
            os.rename(tmp, mark)
        return was != now

    def _load_hot(self) -> None:
        """The hot copies a previous daemon kept, least recently used first (by atime, which
        ``hot_open`` bumps); parts of interrupted put-backs are deleted."""
        found = []
        for entry in os.scandir(self.hot_dir):
            if entry.name.endswith(PART) or not entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                continue
            st = entry.stat(follow_symlinks=False)
            found.append((st.st_atime_ns, entry.name, st.st_size))
        for _, name, size in sorted(found):
            self._hot[name] = size
            self._hot_bytes += size
        self.evict()

    # -- staged files -----------------------------------------------------------------------

    def new_staged(self) -> tuple[Path, int]:
        """A new empty staged file, open read-write (0600)."""
        path = self.staged_dir / f"{STAGED_PREFIX}{uuid.uuid4().hex}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        return path, fd

    def staged_path(self, name: str) -> Path:
        """The staged file a stub names; ValueError for a name that is not one of ours."""
        if not name.startswith(STAGED_PREFIX) or "/" in name or name in (".", ".."):
            raise ValueError(f"not a staged file name: {name!r}")
        return self.staged_dir / name

    def open_staged(self, name: str) -> int:
        return os.open(self.staged_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def staged_names(self) -> list[str]:
        return [e.name for e in os.scandir(self.staged_dir) if e.name.startswith(STAGED_PREFIX)]

    def staged_bytes(self) -> tuple[int, int]:
        """(files, bytes) under staged/ (stats: what ingestion has still to store, and open copies)."""
        n = total = 0
        for e in os.scandir(self.staged_dir):
            with contextlib.suppress(FileNotFoundError):
                total += e.stat(follow_symlinks=False).st_size
                n += 1
        return n, total

    def drop_staged(self, path: Path | str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    # -- the hot tier -----------------------------------------------------------------------

    @staticmethod
    def key(file_sum: bytes, size: int) -> str:
        return f"{file_sum.hex()}-{size}"

    def hot_open(self, key: str) -> int | None:
        """A read-only fd of the hot copy ``key``, or None (a miss)."""
        with self._lock:
            known = key in self._hot
            if known:
                self._hot.move_to_end(key)
        fd = None
        if known:
            try:
                fd = os.open(self.hot_dir / key, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                os.utime(fd, ns=(_now_ns(), os.fstat(fd).st_mtime_ns))  # the order survives a restart
            except FileNotFoundError:
                self._forget(key)
                fd = None
        with self._lock:
            if fd is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        return fd

    def new_part(self) -> tuple[Path, int]:
        """A file to put a snapshot back into (``hot_commit`` names it, or ``drop_staged``)."""
        path = self.hot_dir / f"{uuid.uuid4().hex}{PART}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        return path, fd

    def hot_commit(self, path: Path, key: str, size: int, put_back: bool = True) -> None:
        """``path`` (a verified whole copy: a put-back part, or an ingested staged file) becomes the
        hot copy ``key``; with a budget of 0 it is unlinked (open fds keep it readable)."""
        if put_back:
            with self._lock:
                self.stats.put_backs += 1  # kept or not: the restore was put back
        if self.budget <= 0 or size > self.budget:
            self.drop_staged(path)
            return
        os.rename(path, self.hot_dir / key)
        with self._lock:
            old = self._hot.pop(key, None)
            self._hot_bytes += size - (old or 0)
            self._hot[key] = size
            if not put_back:
                self.stats.adopted += 1
        self.evict()

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._hot.pop(key, None)
            if size is not None:
                self._hot_bytes -= size

    def evict(self, need: int = 0) -> int:
        """Delete least recently used hot copies until they fit the budget, less ``need`` bytes;
        the bytes freed. An open copy stays readable through its fds (unlinked, not truncated)."""
        freed = 0
        while True:
            with self._lock:
                if not self._hot or self._hot_bytes + need <= self.budget:
                    return freed
                key, size = self._hot.popitem(last=False)
                self._hot_bytes -= size
                self.stats.evictions += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.hot_dir / key)
            freed += size

    def clear_hot(self) -> None:
        with self._lock:
            keys = list(self._hot)
            self._hot.clear()
            self._hot_bytes = 0
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.hot_dir / key)

    def hot_usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._hot), self._hot_bytes

    def free_bytes(self) -> int:
        sv = os.statvfs(self.root)
        return sv.f_bavail * sv.f_frsize

    def make_room(self, need: int) -> int:
        """Evict least recently used hot copies until ``need`` bytes are free here (or none is
        left); the bytes free then. A copy still open stays readable, and frees its room later."""
        free = self.free_bytes()
        if free < need:
            with self._lock:
                hot = self._hot_bytes
            self.evict(self.budget - hot + need - free)
            free = self.free_bytes()
        return free

    def reserve(self, need: int) -> None:
        """Before a copy of ``need`` bytes of data is made here: room for it, hot copies evicted
        first; else ENOSPC (nothing written)."""
        free = self.make_room(need)
        if free < need:
            raise WholeFilesError(errno.ENOSPC, f"a copy of {need >> 20} MiB does not fit in {self.root}: "
                                  f"{free >> 20} MiB free")  # fmt: skip

    def remove_all(self) -> None:
        """Delete the directory, its own tmpfs unmounted (tests, a store being removed)."""
        memfs.unmount(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


def _now_ns() -> int:
    return time.time_ns()
