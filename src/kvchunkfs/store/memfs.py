"""The file system whole files live on: a private tmpfs, with transparent huge pages.

A tmpfs file is written and read page by page: with 4 KiB pages, a save of 30 MiB allocates,
zeroes and maps 7,680 of them, which costs more than writing the same bytes into ext4's page
cache. With huge pages (``huge=within_size``) the same write takes a fifth of the time and a
read a third. /dev/shm is mounted without them, so the daemon, when it runs as root, mounts a
tmpfs of its own on its whole-file directory:

- options ``mode=0700,huge=within_size,size=N,nosuid,nodev,noexec``, ``N`` what the memory tier
  may really hold (``wholefiles.open_whole_files``: its budget, never more than the room of the
  file system the directory is on when that is in memory); an earlier daemon's mount is resized;
- only over a directory that holds no staged save (a save not yet stored must stay visible);
  whatever else is there (hot copies: a cache) is deleted first;
- left mounted when the daemon exits only if the operator keeps the tier for a restart
  (``memory_tier_on_stop``); a reboot removes it. ``umount DIR`` frees its memory.

Elsewhere (not root, a directory on disk not chosen for a mount of its own, a kernel that refuses
the mount) the directory is used as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

IN_MEMORY = ("tmpfs", "ramfs")
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 2, 4, 8, 32
SOURCE = b"kv-chunk-fs-whole"
MNT_DETACH = 2


@dataclass(frozen=True)
class MountEntry:
    point: str
    fstype: str
    options: str  # the super block's options (mode, size, huge ...)


def mount_of(path: Path | str) -> MountEntry | None:
    """The mount holding ``path`` (/proc/self/mountinfo: the longest mount point above it)."""
    real = os.path.realpath(path)
    best: MountEntry | None = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                point = fields[4].replace("\\040", " ")
                sep = fields.index("-")
                entry = MountEntry(point, fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else "")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and (best is None or len(point) >= len(best.point)):
                    best = entry
    except (OSError, ValueError, IndexError):
        return None
    return best


def fs_type(path: Path | str) -> str:
    """The type of the file system ``path`` lives on; "" if unknown."""
    entry = mount_of(path)
    return entry.fstype if entry is not None else ""


def huge_tmpfs(root: Path, staged_dir: Path, size: int, huge: bool = True, any_parent: bool = False) -> bool:
    """Make ``root`` (an existing private directory) a tmpfs of ``size`` bytes (with huge pages
    if ``huge`` and the kernel has them) if it is not one yet and may be; an earlier daemon's is
    resized. ``any_parent``: mount even over a directory on disk (the daemon's own under /run).
    True if it is one now. Never raises: a refusal is logged and ``root`` is used as it is."""
    entry = mount_of(root)
    if entry is None:
        return False
    if entry.point == os.path.realpath(root):
        if entry.fstype != "tmpfs":
            return False
        try:  # ours, mounted by an earlier daemon: sized for this one
            _mount(root, f"size={size}", MS_REMOUNT)
        except OSError as e:
            log.info("the memory tier %s keeps its size (resizing it to %d MiB failed: %s)", root, size >> 20, e)
        return True
    why = _cannot_mount(root, staged_dir, entry, any_parent)
    if why:
        log.info("whole files in %s stay on %s pages: %s", root, entry.fstype, why)
        return False
    for child in os.scandir(root):  # hot copies and the boot mark: a cache, rebuilt on demand
        if child.is_dir(follow_symlinks=False):
            shutil.rmtree(child.path, ignore_errors=True)
        else:
            os.unlink(child.path)
    huge = huge and os.path.exists("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    try:
        _mount(root, f"mode=0700,{'huge=within_size,' if huge else ''}size={size}")
    except OSError as e:
        log.info("whole files in %s stay on %s pages: mounting a tmpfs failed: %s", root, entry.fstype, e)
        return False
    log.info("whole files in %s: a private tmpfs%s of %d MiB", root, " with huge pages" if huge else "", size >> 20)
    return True


def _cannot_mount(root: Path, staged_dir: Path, parent: MountEntry, any_parent: bool) -> str:
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if parent.fstype not in IN_MEMORY and not any_parent:
        return f"it is on {parent.fstype}, not in memory"
    try:
        if any(True for _ in os.scandir(staged_dir)):
            return "it holds staged saves not yet stored (next start)"
    except FileNotFoundError:
        pass
    return ""


def _mount(root: Path, options: str, extra: int = 0) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | extra
    if libc.mount(SOURCE, os.fsencode(root), b"tmpfs", flags, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def own_mount(root: Path) -> bool:
    """Whether ``root`` is a tmpfs of its own (mounted by a daemon)."""
    entry = mount_of(root)
    return entry is not None and entry.point == os.path.realpath(root) and entry.fstype == "tmpfs"


def unmount(root: Path) -> None:
    """Detach ``root``'s own tmpfs if it has one (a tier given back, a store being removed)."""
    entry = mount_of(root)
    if entry is None or entry.point != os.path.realpath(root):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.umount2(os.fsencode(root), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
