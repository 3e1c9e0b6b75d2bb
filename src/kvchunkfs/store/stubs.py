"""Stubs: one small file per snapshot under ``snapshots/``, content = caibx index.

The real size lives in the xattr ``user.kvcfs.size``, the file record (format/filerecord.py: the
checksum of the file's bytes and where its stored groups are) in ``user.kvcfs.file``; snapshot
metadata (created, use count, last use, labels) and any user xattrs live beside it. A stub is only
ever replaced whole: the new one is written complete under ``tmp/`` (index, size, record,
carried-over xattrs, mode, owner) and then renamed over the old path, so a reader sees the old or
the new snapshot, never a mix.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchunkfs.format import index as idx

XATTR_PREFIX = "user.kvcfs."
SIZE = "user.kvcfs.size"  # internal: never visible or writable through the mount
CREATED = "user.kvcfs.created"
USE_COUNT = "user.kvcfs.use_count"
LAST_USE = "user.kvcfs.last_use"
LABEL_PREFIX = "user.kvcfs.label."
BROKEN = "user.kvcfs.broken"  # set by fsck --repair on a snapshot that cannot be read
RECORD = "user.kvcfs.file"  # internal: the file record, written with the index it describes
# internal: a save not yet ingested, whose staged whole file (store/wholefiles.py) is the snapshot
# until the stub is replaced; the index beside it is the previous version (kept after a reboot)
STAGED = "user.kvcfs.staged"
INTERNAL = frozenset({SIZE, RECORD, STAGED})
# Metadata the filesystem maintains; users may read but not set these.
MANAGED = frozenset({SIZE, CREATED, USE_COUNT, LAST_USE, BROKEN, RECORD, STAGED})


class StubError(OSError):
    """A stub could not be read as a snapshot (bad index or size)."""


def read_index(path: Path | str | int) -> idx.Index:
    """The index of the stub at ``path`` (or open as fd ``path``); StubError if it is not one."""
    data, size = read_stub(path)
    return decode_stub(data, size, path)


def decode_stub(data: bytes, size: int | None, name: Path | str | int) -> idx.Index:
    """The index in a stub's bytes, checked against its size attribute; StubError naming ``name``."""
    try:
        index = idx.decode(data)
    except idx.IndexFormatError as e:
        raise StubError(f"{name}: {e}") from e
    if size is not None and size != index.size:
        raise StubError(f"{name}: size xattr {size} does not match index size {index.size}")
    return index


def open_stub(path: Path | str, dir_fd: int | None = None) -> int:
    """An fd of the regular file at ``path``: never through a final symlink, never blocking on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise StubError(f"{path}: {file_kind(mode)}, not a snapshot")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_stub(path: Path | str | int) -> tuple[bytes, int | None]:
    """(content, size xattr) of a stub, by path (see ``open_stub``) or from an open fd."""
    owned = not isinstance(path, int)
    fd = path if isinstance(path, int) else open_stub(path)
    try:
        # One read of the whole stub (a piece list joined would hold it twice: 80 MB for an index
        # of a million chunks); the loop only for a stub that grew meanwhile.
        chunks, offset = [], 0
        while piece := os.pread(fd, max(1 << 20, os.fstat(fd).st_size - offset + 1), offset):
            chunks.append(piece)
            offset += len(piece)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks), stub_size(fd)
    finally:
        if owned:
            os.close(fd)


def read_table(fd: int) -> Iterator[tuple[Any, Any]]:
    """The open stub's index entries a piece at a time (``index.read_table``): (end offsets, ids)
    arrays, never the whole index in memory."""
    return idx.read_table(lambda offset, size: os.pread(fd, size, offset), os.fstat(fd).st_size)


def hash_stub(fd: int) -> Any:
    """A SHA-256 of the content of the open stub ``fd``, read a piece at a time (none of it kept)."""
    h = hashlib.sha256()
    offset = 0
    while piece := os.pread(fd, 1 << 20, offset):
        h.update(piece)
        offset += len(piece)
    return h


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):  # fmt: skip
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else f"a file of type {stat.S_IFMT(mode):o}"


def stub_size(path: Path | str | int) -> int | None:
    try:
        if isinstance(path, int):
            return int(os.getxattr(path, SIZE))
        return int(os.getxattr(path, SIZE, follow_symlinks=False))
    except OSError:
        return None
    except ValueError:
        return None


@dataclass(frozen=True)
class Staged:
    """A stub's staged save: the staged file's name, its size, the boot it was closed in."""

    name: str
    size: int
    boot: str

    def encode(self) -> bytes:
        return json.dumps({"file": self.name, "size": self.size, "boot": self.boot}).encode()


def read_staged(path: Path | str | int) -> Staged | None:
    """The stub's staged save, or None; a value that is not one reads as None (and is logged by the
    caller's recovery, which clears it)."""
    try:
        raw = os.getxattr(path, STAGED) if isinstance(path, int) else os.getxattr(path, STAGED, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT):
            return None
        raise
    try:
        v = json.loads(raw)
        staged = Staged(str(v["file"]), int(v["size"]), str(v["boot"]))
    except (ValueError, KeyError, TypeError):
        return None
    return staged if staged.size >= 0 else None


def set_staged(path: Path | str, staged: Staged | None) -> None:
    """Name a staged save on the stub (one xattr write: atomic), or clear it (None)."""
    if staged is not None:
        os.setxattr(path, STAGED, staged.encode(), follow_symlinks=False)
        return
    with contextlib.suppress(OSError):
        os.removexattr(path, STAGED, follow_symlinks=False)


def refresh_metadata(tmp: Path, like: Path) -> None:
    """Give the new stub ``tmp`` the metadata ``like`` has now: mode, owner, times and user xattrs
    (not the internal ones, which describe ``like``'s own content). A staged save's new stub is
    written long after its close; what changed on the snapshot meanwhile (a chmod, a label, a
    touch) must not be undone by its install."""
    st = os.lstat(like)
    # fsck's mark is about the old content, not this one
    attrs = {k: v for k, v in user_xattrs(like).items() if k not in INTERNAL and k != BROKEN}
    for name in os.listxattr(tmp, follow_symlinks=False):
        if name.startswith("user.") and name not in INTERNAL and name not in attrs:
            os.removexattr(tmp, name, follow_symlinks=False)
    for name, value in attrs.items():
        os.setxattr(tmp, name, value, follow_symlinks=False)
    os.chmod(tmp, st.st_mode & 0o7777, follow_symlinks=False)
    if (st.st_uid, st.st_gid) != (os.lstat(tmp).st_uid, os.lstat(tmp).st_gid):
        os.chown(tmp, st.st_uid, st.st_gid, follow_symlinks=False)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def read_record(path: Path | str | int) -> bytes | None:
    """The stub's file record as stored (None: it has none, e.g. saved before records existed)."""
    try:
        if isinstance(path, int):
            return os.getxattr(path, RECORD)
        return os.getxattr(path, RECORD, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP):
            return None
        raise


def user_xattrs(path: Path | str) -> dict[str, bytes]:
    """All user.* xattrs of a stub, internal ones included."""
    out = {}
    for name in os.listxattr(path, follow_symlinks=False):
        if name.startswith("user."):
            with contextlib.suppress(OSError):
                out[name] = os.getxattr(path, name, follow_symlinks=False)
    return out


def prepare(
    tmp_dir: Path,
    index: idx.Index,
    like: Path | None,
    mode: int = 0o644,
    fsync: bool = False,
    record: bytes | None = None,
) -> Path:
    """Write a complete new stub under ``tmp_dir``; the caller renames it into place.

    Mode, owner and user xattrs are copied from ``like`` (the stub being replaced) when it
    exists, so a rewrite keeps the snapshot's created date, use count and labels. The file record
    is ``record`` (None: none), never the replaced stub's: it describes the index beside it.
    """
    tmp, fd = new_tmp(tmp_dir, mode)
    try:
        os.write(fd, idx.encode(index))
        finish(fd, index.size, like, record, fsync)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return tmp


def new_tmp(tmp_dir: Path, mode: int = 0o644) -> tuple[Path, int]:
    """A new empty file under ``tmp_dir`` for a stub (``prepare``), open for reading and writing."""
    tmp = tmp_dir / f"stub-{uuid.uuid4().hex}"
    return tmp, os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode & 0o7777)


def finish(fd: int, size: int, like: Path | None, record: bytes | None, fsync: bool = False) -> None:
    """Give the new stub ``fd`` (its index written) its size, record and ``like``'s metadata (``prepare``)."""
    attrs: dict[str, bytes] = {}
    st = None
    if like is not None:
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(like)
            attrs = user_xattrs(like)
    attrs.setdefault(CREATED, str(time.time()).encode())
    attrs[SIZE] = str(size).encode()
    attrs.pop(RECORD, None)
    attrs.pop(STAGED, None)  # the new stub is the ingested content itself
    if record is not None:  # first: labels must not take the room it needs
        os.setxattr(fd, RECORD, record)
    for name, value in attrs.items():
        os.setxattr(fd, name, value)
    if st is not None:
        os.fchmod(fd, st.st_mode & 0o7777)
        if (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
            os.fchown(fd, st.st_uid, st.st_gid)
    if fsync:
        os.fsync(fd)


def create_empty(
    tmp_dir: Path, path: Path, index: idx.Index, mode: int, uid: int, gid: int, fsync: bool = False
) -> None:
    """Create a new empty snapshot at ``path`` (fails with EEXIST if it exists); ``fsync``: its
    content is durable before the name exists (the caller fsyncs the directory after)."""
    tmp = prepare(tmp_dir, index, None, mode, fsync=fsync)
    try:
        os.chown(tmp, uid, gid, follow_symlinks=False)
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


# -- walking the snapshots directory ----------------------------------------------------------------

_KEEP_FD_AT = 2048  # bytes of relative path after which a directory's fd is kept as a new base


@dataclass
class Entry:
    """One entry below ``snapshots/`` met by ``walk``; valid until the walk moves on.

    Exactly one of: a regular file (``kind == "file"``: ``open``/``read`` it), an entry that could
    not be handled (``error``: a directory that cannot be listed, a file that cannot be looked at),
    or one that is skipped (``skipped``: a symlink, FIFO, socket or device is never a snapshot).
    """

    rel: str  # relative to snapshots/, "/"-separated
    kind: str = "file"
    error: OSError | None = None
    skipped: str | None = None
    ctime_ns: int = 0  # of a file met by ``walk`` (renames, saves and xattr changes move it on)
    _dir_fd: int | None = None  # None: _sub is a path of its own
    _sub: str = ""  # path relative to _dir_fd

    def open(self) -> int:
        """An fd of the stub (see ``open_stub``); the caller closes it."""
        return open_stub(self._sub, dir_fd=self._dir_fd)

    def read(self) -> tuple[bytes, int | None]:
        """(content, size xattr); OSError (FileNotFoundError if it went away meanwhile)."""
        fd = self.open()
        try:
            return read_stub(fd)
        finally:
            os.close(fd)

    def problem(self) -> str:
        """Why this entry is not read, for reports."""
        if self.error is not None:
            return f"{self.rel}: cannot be read ({self.error.strerror or self.error})"
        return f"{self.rel}: {self.skipped}; skipped"


def entry_at(path: Path, rel: str) -> Entry:
    """The entry of one file looked up by its path (GC reading a stub a rename created)."""
    return Entry(rel, _sub=str(path))


def walk(snapshots: Path) -> Iterator[Entry]:
    """Every entry below ``snapshots`` that is not a directory, in sorted order, depth first.

    Built for a tree other users shape through the mount: no symlink is followed, no FIFO is opened
    for a blocking read, paths are resolved relative to directory fds (so a store path longer than
    PATH_MAX is still reached), and the walk is iterative with a few fds however deep the tree is.
    A missing ``snapshots`` raises (an empty walk would make every chunk garbage).
    """
    root = os.open(snapshots, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    # Frames: (base fd, path of this directory relative to it, rel, names left, fd this frame owns).
    stack: list[tuple[int, str, str, Iterator[str], int]] = []
    try:
        stack.append((root, "", "", iter(sorted(os.listdir(root))), root))
        while stack:
            base, sub, rel, names, own = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
                if own >= 0:
                    os.close(own)
                continue
            child_sub = f"{sub}/{name}" if sub else name
            child_rel = f"{rel}/{name}" if rel else name
            try:
                st = os.stat(child_sub, dir_fd=base, follow_symlinks=False)
            except FileNotFoundError:  # removed meanwhile
                continue
            except OSError as e:
                yield Entry(child_rel, "error", error=e)
                continue
            mode = st.st_mode
            if stat.S_ISREG(mode):
                yield Entry(child_rel, ctime_ns=st.st_ctime_ns, _dir_fd=base, _sub=child_sub)
            elif not stat.S_ISDIR(mode):
                yield Entry(child_rel, "other", skipped=f"{file_kind(mode)}, not a snapshot")
            else:
                frame = _enter(base, child_sub, child_rel)
                if isinstance(frame, Entry):
                    yield frame
                elif frame is not None:
                    stack.append(frame)
    finally:
        for _, _, _, _, own in stack:
            if own >= 0:
                os.close(own)


def _enter(base: int, sub: str, rel: str) -> tuple[int, str, str, Iterator[str], int] | Entry | None:
    """A frame for the directory ``sub`` (relative to ``base``), an error entry, or None if it is gone."""
    try:
        fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base)
    except FileNotFoundError:
        return None
    except OSError as e:  # e.g. replaced by a symlink meanwhile (ELOOP, ENOTDIR)
        return Entry(rel, "error", error=e)
    try:
        names = iter(sorted(os.listdir(fd)))
    except OSError as e:
        os.close(fd)
        return Entry(rel, "error", error=e)
    if len(sub) < _KEEP_FD_AT:  # children stay reachable from base within PATH_MAX
        os.close(fd)
        return base, sub, rel, names, -1
    return fd, "", rel, names, fd
