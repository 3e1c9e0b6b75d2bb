"""Whose close is a FUSE FLUSH? Looking at the opener's descriptor table in ``/proc``.

The kernel sends FLUSH whenever any copy of a file description is closed: the writer's own
``close()``, but also the close of a ``dup()``, a child's close-on-exec, a child's exit. ``flush``
gets no request context and the lock owner is the same for every copy in one process, so
the daemon asks the opener's descriptor table instead. The kernel removes a descriptor from the
table *before* it calls flush (``close_fd`` takes it out, then ``filp_close``; the same for
close-on-exec, ``dup2`` over it and exit), so at the FLUSH of the writer's own last close the
opener's table no longer holds the file; at a FLUSH from another copy it still does.

Everything here reads ``/proc`` (blocking, but no disk and no request to this mount): call it in a
worker thread. None of it sends a request to the mount: ``readlink`` is not used, ``fdinfo`` gives
the inode number and the mount id, and the opener's ``mountinfo`` gives the mount's device.
"""

from __future__ import annotations

import os
import re

_OCTAL = re.compile(r"\\([0-7]{3})")


def task_group(tid: int) -> int:
    """The thread group (process) of task ``tid``: FUSE names the calling thread, but a thread's
    descriptor table is its process's, and the thread may be gone by the time its file is closed."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return tid


def unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def mount_device(mountpoint: str, pid: int | str = "self") -> str | None:
    """``major:minor`` of the mount at ``mountpoint`` as ``pid`` sees it (the last one mounted there)."""
    found = None
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and unescape(fields[4]) == mountpoint:
                    found = fields[2]
    except OSError:
        return None
    return found


def _mount_devices(pid: int) -> dict[str, str]:
    """mount id -> ``major:minor`` for every mount ``pid`` sees."""
    with open(f"/proc/{pid}/mountinfo") as f:
        return {fields[0]: fields[2] for fields in (line.split() for line in f) if len(fields) > 2}


def _fdinfo(pid: int, fd: str) -> bytes:
    """The raw ``/proc/PID/fdinfo/FD`` (a few lines; read with plain syscalls: a table holds
    dozens of descriptors and this runs on each writer's close)."""
    f = os.open(f"/proc/{pid}/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(f, 4096)
    finally:
        os.close(f)


def _field(info: bytes, name: bytes) -> str:
    for line in info.splitlines():
        key, sep, value = line.partition(b":")
        if sep and key == name:
            return value.strip().decode()
    return ""


def holds_for_writing(pid: int, ino: int, device: str) -> bool:
    """Whether process ``pid`` still has a descriptor open for writing on inode ``ino`` of the
    mount with device ``device``. OSError if its table cannot be read (gone: ESRCH/ENOENT;
    another user's process and the daemon not root: EACCES)."""
    devices: dict[str, str] | None = None
    line = b"\nino:\t%d\n" % ino
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            info = _fdinfo(pid, fd)
        except FileNotFoundError:  # closed meanwhile
            continue
        if line not in info:  # most descriptors: another inode
            continue
        if int(_field(info, b"flags") or "0", 8) & os.O_ACCMODE == os.O_RDONLY:
            continue  # a reader of the same file: it cannot change it
        if devices is None:
            devices = _mount_devices(pid)
        if devices.get(_field(info, b"mnt_id")) == device:
            return True
    return False
