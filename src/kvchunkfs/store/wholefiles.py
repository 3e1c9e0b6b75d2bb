"""Whole copies of snapshots as plain files: staged saves and the hot tier.

```
WHOLE/                 default /run/kv-chunk-fs/STORE-KEY as root, a tmpfs of its own (memfs),
                       else under $XDG_RUNTIME_DIR (tierdir): memory, not kept across a reboot
  owner.json           the store it belongs to, and whether a stopped daemon keeps it (tierdir)
  boot_id              the boot the files below were written in
  staged/              a save's bytes as the client wrote them (passed through), until ingested;
                       copies of an open file being rewritten
  hot/SUM-SIZE         a verified whole copy of a stored snapshot (file checksum, size): a cache
  hot/*.part           a copy being put back
```

A staged file named by a stub (``stubs.STAGED``) *is* that snapshot until ingestion has stored its
chunks and replaced the stub; no eviction touches it. Hot copies are content-addressed by the file
record's checksum, so a save, rename or unlink never makes one stale. A copy whose name (the
snapshot it was last opened or stored as) was saved over, renamed or deleted since is checked at
the next eviction: if that name holds another version now, the copy goes first.

**Budget.** Staged saves and hot copies together stay within ``tier_size`` (by default a quarter
of the machine's memory or of the daemon's cgroup limit: ``membudget``): hot copies are evicted,
least recently used first, to leave room for what is staged. While the machine is short of
memory (``short``, set by ``pressure.PressureWatcher``) the tier does not grow: no copy is
kept, and saves are stored as they close instead of staged. After a reboot nothing here is trusted (a file
not fsynced may hold torn bytes): everything is deleted, and stubs naming a staged file keep their
previous version (``boot_id``).

Only this module spells these names. The directory and its parent must be the daemon's own, mode
0700: another local user can neither read a snapshot here nor swap a file under the daemon
(``tierdir`` chooses a directory no other user can create first).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvchunkfs.format import filerecord
from kvchunkfs.store import membudget, memfs, stubs, tierdir

log = logging.getLogger(__name__)

BOOT_ID = "/proc/sys/kernel/random/boot_id"
BOOT_ID_ENV = "KVCFS_BOOT_ID_FILE"  # tests: a file standing in for the kernel's boot id (a simulated reboot)
PART = ".part"
STAGED_PREFIX = "s-"


WholeFilesError = tierdir.TierDirError


def boot_id() -> str:
    path = os.environ.get(BOOT_ID_ENV) or BOOT_ID
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _private_dir(path: Path, create_parents: bool) -> None:
    """``path`` exists as a directory of ours, mode 0700, not a symlink; else WholeFilesError."""
    if create_parents:
        tierdir.private_dir(path.parent)
    tierdir.private_dir(path)


@dataclass
class HotStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    put_backs: int = 0
    adopted: int = 0
    superseded: int = 0  # evicted first: the name it was last opened as holds another version
    pressure_episodes: int = 0  # times the machine became short of memory
    pressure_evictions: int = 0  # copies evicted because of it
    pressure_evicted_bytes: int = 0
    saves_inline: int = 0  # saves stored at their close instead of staged, memory being short
    pressure_reaction_us: int = 0  # the last episode: from finding memory short to the first eviction done


def check_dir(store: Path, configured: Path | None) -> None:
    """Before a mount does anything: the configured whole-file directory, if it exists, is private
    (an empty one of ours is made so), else an OSError saying how to fix it."""
    if configured is not None and os.path.lexists(configured):
        tierdir.check_private(configured, fix_empty=True)


def open_whole_files(
    store: Path,
    configured: Path | None,
    budget: int,
    huge_pages: bool = True,
    tier_size: int = 0,
    keep_on_stop: bool = False,
) -> WholeFiles:
    """The store's whole-file directory: ``configured``, else ``tierdir.tier_dir``; as root a
    tmpfs of its own (with huge pages if ``huge_pages``: ``memfs``). ``tier_size``: staged saves
    and hot copies together (0: a quarter of the machine's memory or cgroup limit); ``budget``:
    hot copies at most (-1: no bound of their own). The tmpfs is sized twice the tier (saves
    being written come on top of what is staged), never beyond the room of its parent file
    system when that is in memory, nor half the machine's memory otherwise."""
    machine = membudget.machine_memory(membudget.own_cgroup())
    tier = tier_size or machine // membudget.TIER_SHARE
    if configured is not None:
        root, parents, any_parent = configured, False, False
    else:
        root, any_parent = tierdir.tier_dir(store)
        parents = False
    _private_dir(root, parents)
    parent = os.statvfs(root)
    if memfs.fs_type(root) in memfs.IN_MEMORY and not memfs.own_mount(root):
        room = parent.f_bavail * parent.f_frsize + tierdir.held_bytes(root)
    else:
        room = machine // 2
    fs_size = max(64 << 20, min(2 * tier, room))
    whole = WholeFiles(root, budget if budget >= 0 else tier, create_parents=False,
                       huge_pages=huge_pages, tier_size=tier, fs_size=fs_size,
                       any_parent=any_parent)  # fmt: skip
    sv = os.statvfs(root)
    cap = sv.f_blocks * sv.f_frsize // 2 if not whole.own_tmpfs else sv.f_blocks * sv.f_frsize
    if whole.tier_size > cap:
        log.info("the memory tier's %d MiB are more than %s's file system allows: %d MiB",
                 whole.tier_size >> 20, root, cap >> 20)  # fmt: skip
        whole.tier_size = cap
    whole.budget = min(whole.budget, whole.tier_size)
    whole.evict()
    tierdir.write_owner(root, store, keep_on_stop)
    whole.keep_on_stop = keep_on_stop
    log.info("memory tier %s: staged saves and hot copies up to %d MiB (hot copies up to %d MiB) of %d MiB "
             "this machine may use; %s when the daemon stops", root, whole.tier_size >> 20, whole.budget >> 20,
             machine >> 20, "kept" if keep_on_stop else "freed")  # fmt: skip
    return whole


class WholeFiles:
    """The staged files and the hot tier of one store (thread-safe: the lock guards only the
    in-memory table, never I/O)."""

    def __init__(
        self,
        root: Path,
        budget: int,
        create_parents: bool = True,
        huge_pages: bool = False,
        tier_size: int = 0,
        fs_size: int = 0,
        any_parent: bool = False,
    ) -> None:
        self.root = root
        self.budget = budget  # bytes of hot copies kept (0: none outlives its last close)
        self.tier_size = tier_size or (1 << 62)  # staged saves and hot copies together
        self.keep_on_stop = False
        self.short = False  # the machine is short of memory: the tier does not grow (pressure.py)
        self.stub_path: Callable[[str], Path] | None = None  # a snapshot's stub, to check names
        self._names: dict[str, str] = {}  # snapshot -> the hot copy it was last opened or stored as
        self._suspects: set[str] = set()  # snapshots changed since (saved over, renamed, deleted)
        self.staged_dir = root / "staged"
        self.hot_dir = root / "hot"
        self.stats = HotStats()
        self._lock = threading.Lock()
        self._hot: OrderedDict[str, int] = OrderedDict()  # key -> size, least recently used first
        self._hot_bytes = 0
        _private_dir(root, create_parents)
        # Before anything is made inside: a new mount hides what the directory held.
        size = fs_size or self.tier_size
        own = huge_pages or any_parent
        self.own_tmpfs = own and memfs.huge_tmpfs(root, self.staged_dir, size, huge_pages, any_parent)
        self.fs_size = os.statvfs(root).f_blocks * os.statvfs(root).f_frsize
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

    def hot_open(self, key: str, rel: str | None = None) -> int | None:
        """A read-only fd of the hot copy ``key`` (opened as the snapshot ``rel``), or None (a miss)."""
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
                self._name(rel, key)
        return fd

    def new_part(self) -> tuple[Path, int]:
        """A file to put a snapshot back into (``hot_commit`` names it, or ``drop_staged``)."""
        path = self.hot_dir / f"{uuid.uuid4().hex}{PART}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        return path, fd

    def hot_commit(
        self, path: Path, key: str, size: int, put_back: bool = True, rel: str | None = None, warm: bool = False
    ) -> None:
        """``path`` (a verified whole copy of the snapshot ``rel``: a put-back part, or an ingested
        staged file) becomes the hot copy ``key``; with a budget of 0, or memory short, it is
        unlinked (open fds keep it readable). ``warm``: the warm-up's copy (not counted as a
        restore's put-back): dropped if a client's is there already, else first in line for eviction
        (the warm-up puts copies back most likely first: the last one is the least likely)."""
        if put_back and not warm:
            with self._lock:
                self.stats.put_backs += 1  # kept or not: the restore was put back
        if self.budget <= 0 or size > self.budget or self.short or (warm and self.hot_has(key)):
            self.drop_staged(path)
            return
        os.rename(path, self.hot_dir / key)
        with self._lock:
            old = self._hot.pop(key, None)
            self._hot_bytes += size - (old or 0)
            self._hot[key] = size
            if warm:
                self._hot.move_to_end(key, last=False)
            if not put_back:
                self.stats.adopted += 1
            self._name(rel, key)
        self.evict()

    def hot_has(self, key: str) -> bool:
        """Whether the hot tier holds the copy ``key`` (not counted as a hit or a miss)."""
        with self._lock:
            return key in self._hot

    def _name(self, rel: str | None, key: str) -> None:
        """``rel`` holds the version ``key`` now (under the lock): the copy of the version it held
        before goes first, unless another snapshot was opened as it."""
        if rel is None:
            return
        old = self._names.get(rel)
        self._names[rel] = key
        self._suspects.discard(rel)
        if old is not None and old != key:
            self._demote(old)

    def _demote(self, key: str) -> None:
        if key in self._hot and key not in self._names.values():
            self._hot.move_to_end(key, last=False)
            self.stats.superseded += 1

    def changed(self, *rels: str) -> None:
        """A repository watcher: ``rels`` were saved over, renamed, deleted or touched; their copies
        are checked at the next eviction (never blocks)."""
        with self._lock:
            self._suspects.update(r for r in rels if r in self._names)

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._hot.pop(key, None)
            if size is not None:
                self._hot_bytes -= size

    def _superseded(self) -> None:
        """Copies whose snapshot holds another version now (or is gone) move to the front of the
        eviction order: a copy no stub names goes before any copy one does."""
        with self._lock:
            suspects, self._suspects = self._suspects, set()
            names = {rel: self._names[rel] for rel in suspects if rel in self._names}
        if not names or self.stub_path is None:
            return
        gone: list[str] = []
        for rel, key in names.items():
            if self._current_key(rel) != key:
                gone.append(rel)
        with self._lock:
            for rel in gone:
                self._demote(self._names.pop(rel, ""))

    def _current_key(self, rel: str) -> str | None:
        """The hot key of the version ``rel`` holds now (None: none known, or it is gone)."""
        assert self.stub_path is not None
        path = self.stub_path(rel)
        try:
            if stubs.read_staged(path) is not None:
                return None  # a newer save, staged: not this copy
            size = stubs.stub_size(path)
            raw = stubs.read_record(path)
            if raw is None or size is None:
                return self._names.get(rel)  # no record to tell by: kept in its place
            return self.key(filerecord.decode(raw, size).file_sum, size)
        except (OSError, ValueError):
            return None

    def staged_total(self) -> int:
        return self.staged_bytes()[1]

    def evict(self, need: int = 0) -> int:
        """Delete hot copies, those no snapshot names first, then least recently used, until they
        fit the budget and, with what is staged, the tier, less ``need`` bytes; the bytes freed.
        An open copy stays readable through its fds (unlinked, not truncated)."""
        self._superseded()
        limit = min(self.budget, self.tier_size - self.staged_total()) - need
        return self._evict_to(limit)

    def _evict_to(self, limit: int, pressure: bool = False) -> int:
        freed = 0
        while True:
            with self._lock:
                if not self._hot or self._hot_bytes <= limit:
                    return freed
                key, size = self._hot.popitem(last=False)
                self._hot_bytes -= size
                self.stats.evictions += 1
                if pressure:
                    self.stats.pressure_evictions += 1
                    self.stats.pressure_evicted_bytes += size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.hot_dir / key)
            freed += size

    def shrink(self, nbytes: int) -> int:
        """Memory is short: evict at least ``nbytes`` of hot copies (unnamed ones first, then least
        recently used); the bytes freed."""
        self._superseded()
        with self._lock:
            limit = self._hot_bytes - max(1, nbytes)
        return self._evict_to(limit, pressure=True)

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

    def room(self) -> int:
        """Bytes the tier may still take for a new whole file (0 while memory is short): what its
        budget leaves beside what is staged, within its file system's free room."""
        if self.short:
            return 0
        sv = os.statvfs(self.root)
        return max(0, min(sv.f_bavail * sv.f_frsize, self.tier_size - self.staged_total()))

    def free_bytes(self) -> int:
        return self.room()

    def fs_free(self) -> int:
        """Bytes the directory's file system has free now (what a write to it can still take)."""
        sv = os.statvfs(self.root)
        return sv.f_bavail * sv.f_frsize

    def tier_stats(self) -> dict[str, int]:
        """What the tier holds now and its limits (stats, API, metrics)."""
        files, hot = self.hot_usage()
        staged_files, staged = self.staged_bytes()
        st = self.stats
        return {
            "tier_size": self.tier_size,
            "tier_fs_size": self.fs_size,
            "staged_files": staged_files,
            "staged_bytes": staged,
            "memory_short": int(self.short),
            "pressure_episodes": st.pressure_episodes,
            "pressure_evictions": st.pressure_evictions,
            "pressure_evicted_bytes": st.pressure_evicted_bytes,
            "saves_inline": st.saves_inline,
            "pressure_reaction_us": st.pressure_reaction_us,
            "hot_superseded": st.superseded,
        }

    def stop(self) -> None:
        """The daemon stops cleanly: the tier is kept for the next daemon if the operator chose so,
        else its hot copies are deleted and, with no staged save left, its tmpfs unmounted and
        the directory removed. Logs what it leaves and how to free it."""
        if self.keep_on_stop:
            held = tierdir.held_bytes(self.root)
            log.info("the memory tier %s keeps %d MiB for the next daemon (memory_tier_on_stop = keep); "
                     "`kv-chunk-fs free-memory-tiers --all` or `umount %s` frees it", self.root, held >> 20,
                     self.root)  # fmt: skip
            return
        self.clear_hot()
        n, staged = self.staged_bytes()
        if n:
            log.warning("the memory tier %s keeps %d staged saves (%d MiB) not yet stored: the next daemon "
                        "stores them", self.root, n, staged >> 20)  # fmt: skip
            return
        tierdir.free(self.root)
        log.info("the memory tier %s is freed", self.root)

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
        if free < need and self.short:  # memory short: the budget is 0, the file system decides
            free = self.fs_free()
        if free < need:
            raise WholeFilesError(errno.ENOSPC, f"a copy of {need >> 20} MiB does not fit in {self.root}: "
                                  f"{free >> 20} MiB free")  # fmt: skip

    def remove_all(self) -> None:
        """Delete the directory, its own tmpfs unmounted (tests, a store being removed)."""
        memfs.unmount(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


def _now_ns() -> int:
    return time.time_ns()
