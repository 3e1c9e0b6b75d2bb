"""Stubs: one small file per snapshot under ``snapshots/``, content = caibx index.

The real size lives in the xattr ``user.kvcfs.size``; snapshot metadata (created, use count, last
use, labels) and any user xattrs live beside it. A stub is only ever replaced whole: the new one
is written complete under ``tmp/`` (index, size, carried-over xattrs, mode, owner) and then renamed
over the old path, so a reader sees the old or the new snapshot, never a mix.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path

from kvchunkfs.format import index as idx

XATTR_PREFIX = "user.kvcfs."
SIZE = "user.kvcfs.size"  # internal: never visible or writable through the mount
CREATED = "user.kvcfs.created"
USE_COUNT = "user.kvcfs.use_count"
LAST_USE = "user.kvcfs.last_use"
LABEL_PREFIX = "user.kvcfs.label."
BROKEN = "user.kvcfs.broken"  # set by fsck --repair on a snapshot that cannot be read
INTERNAL = frozenset({SIZE})
# Metadata the filesystem maintains; users may read but not set these.
MANAGED = frozenset({SIZE, CREATED, USE_COUNT, LAST_USE, BROKEN})


class StubError(OSError):
    """A stub could not be read as a snapshot (bad index or size)."""


def read_index(path: Path | str) -> idx.Index:
    with open(path, "rb") as f:
        data = f.read()
    try:
        index = idx.decode(data)
    except idx.IndexFormatError as e:
        raise StubError(f"{path}: {e}") from e
    size = stub_size(path)
    if size is not None and size != index.size:
        raise StubError(f"{path}: size xattr {size} does not match index size {index.size}")
    return index


def stub_size(path: Path | str) -> int | None:
    try:
        return int(os.getxattr(path, SIZE, follow_symlinks=False))
    except OSError:
        return None
    except ValueError:
        return None


def user_xattrs(path: Path | str) -> dict[str, bytes]:
    """All user.* xattrs of a stub, internal ones included."""
    out = {}
    for name in os.listxattr(path, follow_symlinks=False):
        if name.startswith("user."):
            with contextlib.suppress(OSError):
                out[name] = os.getxattr(path, name, follow_symlinks=False)
    return out


def prepare(
    tmp_dir: Path, index: idx.Index, like: Path | None, mode: int = 0o644, fsync: bool = False
) -> Path:
    """Write a complete new stub under ``tmp_dir``; the caller renames it into place.

    Mode, owner and user xattrs are copied from ``like`` (the stub being replaced) when it
    exists, so a rewrite keeps the snapshot's created date, use count and labels.
    """
    tmp = tmp_dir / f"stub-{uuid.uuid4().hex}"
    data = idx.encode(index)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode & 0o7777)
    try:
        os.write(fd, data)
        attrs: dict[str, bytes] = {}
        st = None
        if like is not None:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(like)
                attrs = user_xattrs(like)
        attrs.setdefault(CREATED, str(time.time()).encode())
        attrs[SIZE] = str(index.size).encode()
        for name, value in attrs.items():
            os.setxattr(fd, name, value)
        if st is not None:
            os.fchmod(fd, st.st_mode & 0o7777)
            if (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
                os.fchown(fd, st.st_uid, st.st_gid)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return tmp


def create_empty(tmp_dir: Path, path: Path, index: idx.Index, mode: int, uid: int, gid: int) -> None:
    """Create a new empty snapshot at ``path`` (fails with EEXIST if it exists)."""
    tmp = prepare(tmp_dir, index, None, mode)
    try:
        os.chown(tmp, uid, gid)
        os.link(tmp, path)  # atomic create-if-absent, unlike rename
    finally:
        os.unlink(tmp)


def is_user_settable(name: str) -> bool:
    """Under user.kvcfs.* only labels may be set through the mount."""
    return name.startswith(LABEL_PREFIX) and len(name) > len(LABEL_PREFIX)


# Carried from the replaced snapshot when the proxy renames NAME.tmp over NAME.
_CARRIED = (CREATED, USE_COUNT, LAST_USE)


def carry_metadata(old: Path | str, new: Path | str) -> None:
    """Give ``new`` the created date, use count and labels of ``old`` (which it is replacing).

    Labels already set on ``new`` win over the old ones.
    """
    old_attrs = user_xattrs(old)
    new_names = set(os.listxattr(new, follow_symlinks=False))
    for name, value in old_attrs.items():
        if name in _CARRIED or (name.startswith(LABEL_PREFIX) and name not in new_names):
            os.setxattr(new, name, value, follow_symlinks=False)


def note_use(path: Path | str) -> None:
    """Count a restore: bump use_count and set last_use."""
    try:
        count = int(os.getxattr(path, USE_COUNT, follow_symlinks=False))
    except (OSError, ValueError):
        count = 0
    with contextlib.suppress(OSError):
        os.setxattr(path, USE_COUNT, str(count + 1).encode(), follow_symlinks=False)
        os.setxattr(path, LAST_USE, str(time.time()).encode(), follow_symlinks=False)
