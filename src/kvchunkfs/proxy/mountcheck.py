"""Whether the proxy's ``--mount`` is a live kv-chunk-fs mount, read from the mount table."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvchunkfs.service.apiclient import socket_path


@dataclass
class MountCheck:
    """What the proxy found at its ``--mount`` when it started."""

    mounted: bool  # a live kv-chunk-fs mount
    level: int  # logging level of ``line``
    line: str


def check_mount(mount: Path, store: Path | None, timeout: float = 10.0) -> MountCheck:
    """The working case is a kv-chunk-fs mount whose daemon answers on ``store``'s socket. A
    directory that is not such a mount yet is a warning, not an error: the proxy serves anyway,
    its saves skipped until the daemon mounts it (a directory that does not exist is the command's
    error)."""
    from kvchunkfs.service.apiclient import DaemonClient

    problem = mount_problem(mount)
    if problem is not None:
        return MountCheck(False, logging.WARNING, f"saves are skipped until {mount} is a kv-chunk-fs mount: {problem}")
    if store is None:
        return MountCheck(True, logging.INFO, f"{mount} is a kv-chunk-fs mount")
    try:
        n = int(DaemonClient(store, timeout).json("GET", "/stats")["snapshots"])
    except TimeoutError:
        return MountCheck(True, logging.INFO, f"{mount} is a kv-chunk-fs mount (its daemon is still reading its "
                          f"catalog: the snapshot count is not known yet)")  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as e:
        return MountCheck(
            True,
            logging.WARNING,
            f"{mount} is a kv-chunk-fs mount, but no daemon answers on "
            f"{socket_path(store)} ({e}): no restores from the store (is --store the mount's store?)",
        )
    return MountCheck(True, logging.INFO, f"{mount} is a kv-chunk-fs mount with {n} snapshot{'' if n == 1 else 's'}")


class NotMounted(Exception):
    """The save directory is not on a live kv-chunk-fs mount."""


FSTYPE = "fuse.kv-chunk-fs"  # what /proc/self/mountinfo calls the daemon's mounts (fsname and subtype)


def mount_problem(directory: Path) -> str | None:
    """None if ``directory`` is on a live kv-chunk-fs mount, else why not. Existing is not enough: with
    the daemon stopped, the bare mountpoint is a directory on the root disk. The directory's device
    must be a kv-chunk-fs mount in ``/proc/self/mountinfo`` (the mountpoint itself or a directory in
    it), and it must answer (a killed daemon's mount fails with ENOTCONN)."""
    try:
        dev = os.stat(directory).st_dev
        os.statvfs(directory)
        with open("/proc/self/mountinfo") as f:
            table = f.read()
    except OSError as e:
        return f"{directory}: {e.strerror or e}"
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    for line in table.splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == wanted and "-" in fields:
            fstype = fields[fields.index("-") + 1 :][:1]
            if fstype == [FSTYPE]:
                return None
            return f"{directory} is on a {fstype[0] if fstype else 'unknown'} filesystem, not a kv-chunk-fs mount"
    return f"{directory}: its device {wanted} is not in /proc/self/mountinfo"


@dataclass(frozen=True)
class MountRoot:
    """A live kv-chunk-fs mount whose root is the proxy's ``--mount``."""

    mountpoint: Path
    store: Path | None  # from its source, ``kv-chunk-fs:STORE`` (None: an older daemon's ``kv-chunk-fs``)


def find_mount_root(directory: Path) -> MountRoot | str:
    """``directory`` as the root of a live kv-chunk-fs mount, with its store; else why not, in one line
    (missing, not a directory, a plain directory, another filesystem's mount, a directory inside a
    kv-chunk-fs mount instead of its root, a mount whose daemon is gone)."""
    try:
        path = Path(os.path.realpath(directory))
        st = os.stat(path)
    except OSError as e:
        return f"--mount {directory}: {e.strerror or e}"
    if not os.path.isdir(path):
        return f"--mount {directory} is not a directory"
    try:
        os.statvfs(path)
        with open("/proc/self/mountinfo") as f:
            table = f.read()
    except OSError as e:
        return f"--mount {directory}: {e.strerror or e} (a kv-chunk-fs mount whose daemon is gone?)"
    wanted = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    entry = None
    for line in table.splitlines():
        fields = line.split()
        if len(fields) > 6 and fields[2] == wanted and "-" in fields[6:]:
            tail = fields[fields.index("-", 6) + 1 :]
            entry = (_unescape(fields[4]), (tail + [""])[0], _unescape((tail + ["", ""])[1]))  # the last is on top
    if entry is None:
        return f"--mount {directory}: its device {wanted} is not in /proc/self/mountinfo"
    mountpoint, fstype, source = entry
    if fstype != FSTYPE:
        if mountpoint == str(path):
            return f"--mount {directory} is a {fstype} mount ({source}), not a kv-chunk-fs mount"
        return (f"--mount {directory} is a plain directory (on {fstype} at {mountpoint}), not a kv-chunk-fs mount: "
                f"run `kv-chunk-fs mount {directory}` first (llama-server's --slot-save-path)")  # fmt: skip
    if mountpoint != str(path):
        return (f"--mount {directory} is inside the kv-chunk-fs mount at {mountpoint}: give the mount's root, "
                "llama-server's --slot-save-path")  # fmt: skip
    store = source.partition(":")[2]
    return MountRoot(path, Path(store.replace("\\,", ",").replace("\\\\", "\\")) if store else None)


def _unescape(field: str) -> str:
    """A mountinfo field: spaces, tabs, newlines and backslashes are octal escapes there."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
