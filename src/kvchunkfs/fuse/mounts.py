"""The mount table: which FUSE mount a directory is on, and which daemon serves a kv-chunk-fs one.

A daemon mounts with the source ``kv-chunk-fs:STORE`` (``fsname``; the type is ``fuse.kv-chunk-fs``),
so ``findmnt``, ``mount`` and ``df`` show which store a mountpoint serves, and the store's lock file
holds the daemon's pid (``store.layout.lock_store``). A mount of an older daemon shows the source
``kv-chunk-fs`` alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvchunkfs.fuse.openers import unescape
from kvchunkfs.store.layout import lock_holder

FSNAME = "kv-chunk-fs"
FSTYPE = "fuse.kv-chunk-fs"


@dataclass(frozen=True)
class MountEntry:
    mountpoint: str
    fstype: str  # e.g. fuse.kv-chunk-fs, fuse.sshfs, fuse
    source: str  # e.g. kv-chunk-fs:/var/lib/kv-chunk-fs


def fsname(store: Path) -> str:
    """The ``fsname`` mount option naming ``store``: ``kv-chunk-fs:STORE``, the option parser's
    separators escaped; ``kv-chunk-fs`` alone for a path that is not printable ASCII (the options
    are ASCII)."""
    text = str(store)
    if not (text.isascii() and text.isprintable()):
        return FSNAME
    return FSNAME + ":" + text.replace("\\", "\\\\").replace(",", "\\,")


def fuse_mount_of(path: Path) -> MountEntry | None:
    """The FUSE mount ``path`` is on (the mount's root or a directory in it), or None. ``stat``s
    ``path``: call it after a dead mount was cleared."""
    st = os.stat(path)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 7 or fields[2] != device or "-" not in fields[6:]:
                continue
            fstype, source = (fields[fields.index("-", 6) + 1 :] + ["", ""])[:2]
            if fstype == "fuse" or fstype.startswith(("fuse.", "fuseblk")):
                found = MountEntry(unescape(fields[4]), fstype, unescape(source))  # the last is on top
    return found


def describe(entry: MountEntry, path: Path) -> str:
    """Why ``path`` is not a place for a new mount, naming what serves ``entry``."""
    where = f"{path} is already" if entry.mountpoint == str(path) else f"{path} is inside"
    if entry.fstype != FSTYPE:
        return f"{where} a {entry.fstype} mount ({entry.source}) at {entry.mountpoint}; unmount it first"
    store = entry.source.partition(":")[2]
    if not store:
        return f"{where} the kv-chunk-fs mount at {entry.mountpoint}; stop its daemon first"
    pid = lock_holder(Path(store))
    daemon = f"daemon pid {pid}, store {store}" if pid is not None else f"store {store}"
    stop = f"kill -TERM {pid}" if pid is not None else "fusermount3 -u"
    return (f"{where} the kv-chunk-fs mount at {entry.mountpoint} ({daemon}); stop that daemon first "
            f"(systemctl stop kv-chunk-fs, or {stop})")  # fmt: skip
