#!/usr/bin/env python3
"""A pass-through FUSE filesystem that forgets what was not made durable when it is "cut".

The model (after LazyFS, which keeps written data in its own cache until fsync): every change goes
through to the backing directory at once (so reads are plain), and is also recorded with what it
replaced, until it is made durable. When the filesystem is unmounted (the "power cut": the test
kills the process using it, then unmounts), the changes that were not made durable are undone:

* **file data** (writes, truncates): durable only after an ``fsync``/``fdatasync`` of that file or
  a sync of everything (below). At the cut, each file keeps a random prefix of its writes since its
  last sync (the page cache may have written some of them back), the rest are undone;
* **metadata** (create, mknod, mkdir, link, unlink, rmdir, rename, xattrs, mode): journaled in
  order, as ext4 and XFS do. Any ``fsync``/``fdatasync``/``fsyncdir`` commits all of it (a journal
  commit is sequential). At the cut, a random prefix of the changes since the last commit survives.
  An unlinked or replaced file is kept aside (``BACKING/.grave``) until its removal is committed.

Data and metadata are independent: a rename can survive while the data of the file it renamed does
not (what a real disk does when nobody fsynced). ``setxattr(ROOT, "user.powerfs.sync")`` makes
everything durable (time passed and the page cache was written back).

Usage: ``powerfs.py BACKING MOUNTPOINT SEED``; serves until unmounted, then cuts and exits.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # run as a program by the tests

from kvchunkfs.fuse import api as fuse  # noqa: E402
from kvchunkfs.fuse.session import Session  # noqa: E402

log = logging.getLogger("powerfs")
SYNC_XATTR = b"user.powerfs.sync"


@dataclass
class Undo:
    """What one write or truncate replaced: the size before and the bytes at ``offset``."""

    offset: int
    old: bytes
    old_size: int


@dataclass
class Pending:
    """A file's data changes since its last sync, through an fd of its own (valid after unlink)."""

    fd: int
    undo: list[Undo] = field(default_factory=list)


class PowerFS(fuse.Operations):
    def __init__(self, backing: str, seed: int) -> None:
        super().__init__()
        self.root = os.path.join(backing, "root")
        self.grave = os.path.join(backing, ".grave")
        os.makedirs(self.root, exist_ok=True)
        os.makedirs(self.grave, exist_ok=True)
        self.rng = random.Random(seed)
        self.root_ino = os.lstat(self.root).st_ino
        self.paths: dict[int, str] = {fuse.ROOT_INODE: self.root}
        self.data: dict[int, Pending] = {}  # by backing inode number
        self.meta: list[tuple[Any, ...]] = []  # undo records, oldest first
        self.buried = 0
        self.stats = {"writes": 0, "syncs": 0, "commits": 0}

    # -- inodes -----------------------------------------------------------------------------

    def _ino(self, st_ino: int) -> int:
        return fuse.ROOT_INODE if st_ino == self.root_ino else st_ino

    def _path(self, ino: int) -> str:
        try:
            return self.paths[ino]
        except KeyError:
            raise fuse.FUSEError(errno.ENOENT) from None

    def _child(self, parent: int, name: bytes) -> str:
        return os.path.join(self._path(parent), os.fsdecode(name))

    def _attrs(self, path: str, fd: int | None = None) -> fuse.EntryAttributes:
        try:
            st = os.fstat(fd) if fd is not None else os.lstat(path)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        ino = self._ino(st.st_ino)
        if fd is None:
            self.paths[ino] = path
        a = fuse.EntryAttributes()
        for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size", "st_atime_ns",
                     "st_mtime_ns", "st_ctime_ns"):  # fmt: skip
            setattr(a, name, getattr(st, name))
        a.st_ino = ino
        a.st_blksize = 4096
        a.st_blocks = st.st_blocks
        a.entry_timeout = 0  # every change goes through here; the cut changes the backing files
        a.attr_timeout = 0
        return a

    # -- the journal ------------------------------------------------------------------------

    def _bury(self, path: str) -> str:
        """Move ``path`` aside (an unlink, a replaced target) until its removal is committed."""
        self.buried += 1
        aside = os.path.join(self.grave, str(self.buried))
        os.rename(path, aside)
        return aside

    def _data_change(self, st_ino: int, fd: int, offset: int, length: int) -> None:
        """Remember what a write of ``length`` bytes at ``offset`` (or a truncate to ``offset``,
        ``length`` -1) is about to replace."""
        pending = self.data.get(st_ino)
        if pending is None:
            pending = self.data[st_ino] = Pending(os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC))
        size = os.fstat(fd).st_size
        if length < 0:  # truncate to offset
            old = os.pread(fd, size - offset, offset) if offset < size else b""
        else:
            old = os.pread(fd, min(length, max(0, size - offset)), offset) if offset < size else b""
        pending.undo.append(Undo(offset, old, size))

    def _commit_meta(self) -> None:
        self.meta.clear()
        shutil.rmtree(self.grave)
        os.mkdir(self.grave)
        self.stats["commits"] += 1

    def _sync_file(self, st_ino: int) -> None:
        pending = self.data.pop(st_ino, None)
        if pending is not None:
            os.close(pending.fd)
        self.stats["syncs"] += 1

    def sync_all(self) -> None:
        for st_ino in list(self.data):
            self._sync_file(st_ino)
        self._commit_meta()

    def cut(self) -> str:
        """Undo what was not durable: a random prefix of each file's writes and of the metadata survives."""
        lost_writes = 0
        for pending in self.data.values():
            keep = self.rng.randint(0, len(pending.undo))
            for u in reversed(pending.undo[keep:]):
                os.ftruncate(pending.fd, u.old_size)
                os.pwrite(pending.fd, u.old, u.offset)
                lost_writes += 1
            os.close(pending.fd)
        self.data.clear()
        keep = self.rng.randint(0, len(self.meta))
        lost_meta = len(self.meta) - keep
        for record in reversed(self.meta[keep:]):
            kind = record[0]
            if kind == "moved":
                os.rename(record[2], record[1])
            elif kind == "replaced":
                os.rename(record[2], record[1])
                os.rename(record[3], record[2])
            elif kind == "created":
                path = record[1]
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    os.rmdir(path)
                else:
                    os.unlink(path)
            elif kind == "xattr":
                _, path, name, old = record
                if old is None:
                    os.removexattr(path, name, follow_symlinks=False)
                else:
                    os.setxattr(path, name, old, follow_symlinks=False)
            elif kind == "chmod":
                os.chmod(record[1], record[2])
        self.meta.clear()
        shutil.rmtree(self.grave)
        return f"cut: {lost_writes} writes and {lost_meta} metadata changes undone; {self.stats}"

    # -- lookups ----------------------------------------------------------------------------

    async def lookup(self, parent_inode: int, name: bytes, ctx: fuse.RequestContext) -> fuse.EntryAttributes:
        if name == b"..":
            return self._attrs(os.path.dirname(self._path(parent_inode)))
        return self._attrs(self._child(parent_inode, name))

    async def getattr(self, inode: int, ctx: fuse.RequestContext | None = None) -> fuse.EntryAttributes:
        return self._attrs(self._path(inode))

    async def setattr(
        self,
        inode: int,
        attr: fuse.EntryAttributes,
        fields: fuse.SetattrFields,
        fh: int | None,
        ctx: fuse.RequestContext,
    ) -> fuse.EntryAttributes:
        path = self._path(inode)
        try:
            if fields.update_size:
                fd = fh if fh is not None else os.open(path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    self._data_change(os.fstat(fd).st_ino, fd, attr.st_size, -1)
                    os.ftruncate(fd, attr.st_size)
                finally:
                    if fh is None:
                        os.close(fd)
            if fields.update_mode:
                self.meta.append(("chmod", path, stat.S_IMODE(os.lstat(path).st_mode)))
                os.chmod(path, stat.S_IMODE(attr.st_mode))
            if fields.update_uid or fields.update_gid:
                os.chown(
                    path,
                    attr.st_uid if fields.update_uid else -1,
                    attr.st_gid if fields.update_gid else -1,
                    follow_symlinks=False,
                )
            if fields.update_atime or fields.update_mtime:
                st = os.lstat(path)
                os.utime(
                    path,
                    ns=(
                        attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                        attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns,
                    ),
                    follow_symlinks=False,
                )
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        return self._attrs(path)

    async def statfs(self, ctx: fuse.RequestContext) -> fuse.StatvfsData:
        sv = os.statvfs(self.root)
        out = fuse.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail",
                     "f_namemax"):  # fmt: skip
            setattr(out, name, getattr(sv, name))
        return out

    # -- directories ------------------------------------------------------------------------

    async def opendir(self, inode: int, ctx: fuse.RequestContext) -> int:
        self._path(inode)
        return inode

    async def readdir(self, fh: int, start_id: int, token: fuse.ReaddirToken) -> None:
        path = self._path(fh)
        try:
            names = sorted(os.listdir(path))
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        for i, name in enumerate(names[start_id:], start_id):
            try:
                attrs = self._attrs(os.path.join(path, name))
            except fuse.FUSEError:
                continue
            if not fuse.readdir_reply(token, os.fsencode(name), attrs, i + 1):
                return

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        self._commit_meta()

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: fuse.RequestContext) -> fuse.EntryAttributes:
        path = self._child(parent_inode, name)
        try:
            os.mkdir(path, mode)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        self.meta.append(("created", path))
        return self._attrs(path)

    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: fuse.RequestContext
    ) -> fuse.EntryAttributes:
        path = self._child(parent_inode, name)
        try:
            os.mknod(path, mode, rdev)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        self.meta.append(("created", path))
        return self._attrs(path)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: fuse.RequestContext) -> None:
        path = self._child(parent_inode, name)
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise fuse.FUSEError(errno.ENOTDIR)
            if os.listdir(path):
                raise fuse.FUSEError(errno.ENOTEMPTY)
            self.meta.append(("moved", path, self._bury(path)))
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    async def unlink(self, parent_inode: int, name: bytes, ctx: fuse.RequestContext) -> None:
        path = self._child(parent_inode, name)
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                raise fuse.FUSEError(errno.EISDIR)
            st_ino = os.lstat(path).st_ino
            self.meta.append(("moved", path, self._bury(path)))
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        self._forget_path(st_ino, path)

    def _forget_path(self, st_ino: int, path: str) -> None:
        ino = self._ino(st_ino)
        if self.paths.get(ino) == path:
            del self.paths[ino]

    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: fuse.RequestContext,
    ) -> None:
        old, new = self._child(parent_inode_old, name_old), self._child(parent_inode_new, name_new)
        if flags & ~fuse.RENAME_NOREPLACE:
            raise fuse.FUSEError(errno.EINVAL)
        aside = None
        try:
            st = os.lstat(old)
            if os.path.lexists(new):
                if flags & fuse.RENAME_NOREPLACE:
                    raise fuse.FUSEError(errno.EEXIST)
                if os.path.samefile(old, new):
                    return
                target = os.lstat(new)
                if stat.S_ISDIR(target.st_mode) and os.listdir(new):
                    raise fuse.FUSEError(errno.ENOTEMPTY)
                if stat.S_ISDIR(target.st_mode) != stat.S_ISDIR(st.st_mode):
                    raise fuse.FUSEError(errno.EISDIR if stat.S_ISDIR(target.st_mode) else errno.ENOTDIR)
                aside = self._bury(new)
                self._forget_path(target.st_ino, new)
            try:
                os.rename(old, new)
            except OSError:
                if aside is not None:
                    os.rename(aside, new)
                raise
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        # One record: a rename over a name is atomic, a cut keeps both halves or neither.
        self.meta.append(("moved", old, new) if aside is None else ("replaced", old, new, aside))
        self._forget_path(st.st_ino, old)
        if stat.S_ISDIR(st.st_mode):  # paths below it moved too
            prefix = old + "/"
            for ino, p in list(self.paths.items()):
                if p.startswith(prefix):
                    self.paths[ino] = new + p[len(old) :]
        self.paths[self._ino(st.st_ino)] = new

    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: fuse.RequestContext
    ) -> fuse.EntryAttributes:
        src, path = self._path(inode), self._child(new_parent_inode, new_name)
        try:
            os.link(src, path, follow_symlinks=False)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        self.meta.append(("created", path))
        return self._attrs(path)

    # -- files ------------------------------------------------------------------------------

    def _open(self, path: str, flags: int) -> int:
        trunc = flags & os.O_TRUNC
        # Read-write whatever the caller asked (the kernel checked it): a write must read what it
        # replaces. Writes come with their offsets, so no O_APPEND.
        flags &= ~(os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_TRUNC | os.O_APPEND | os.O_ACCMODE)
        fd = os.open(path, flags | os.O_RDWR | os.O_CLOEXEC)
        if trunc:
            self._data_change(os.fstat(fd).st_ino, fd, 0, -1)
            os.ftruncate(fd, 0)
        return fd

    async def open(self, inode: int, flags: int, ctx: fuse.RequestContext) -> fuse.FileInfo:
        try:
            return fuse.FileInfo(fh=self._open(self._path(inode), flags))
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: fuse.RequestContext
    ) -> tuple[fuse.FileInfo, fuse.EntryAttributes]:
        path = self._child(parent_inode, name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, mode)
            self.meta.append(("created", path))
        except FileExistsError:
            if flags & os.O_EXCL:
                raise fuse.FUSEError(errno.EEXIST) from None
            fd = self._open(path, flags)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        return fuse.FileInfo(fh=fd), self._attrs(path)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return os.pread(fh, size, off)

    async def write(self, fh: int, off: int, buf: memoryview) -> int:
        self._data_change(os.fstat(fh).st_ino, fh, off, len(buf))
        self.stats["writes"] += 1
        return os.pwrite(fh, buf, off)

    async def fsync(self, fh: int, datasync: bool) -> None:
        self._sync_file(os.fstat(fh).st_ino)
        self._commit_meta()  # a journal commit takes every metadata change before it

    async def release(self, fh: int) -> None:
        os.close(fh)

    # -- extended attributes ----------------------------------------------------------------

    async def getxattr(self, inode: int, name: bytes, ctx: fuse.RequestContext) -> bytes:
        try:
            return os.getxattr(self._path(inode), name, follow_symlinks=False)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    async def listxattr(self, inode: int, ctx: fuse.RequestContext) -> list[bytes]:
        try:
            return [os.fsencode(n) for n in os.listxattr(self._path(inode), follow_symlinks=False)]
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    def _old_xattr(self, path: str, name: bytes) -> bytes | None:
        try:
            return os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            return None

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: fuse.RequestContext) -> None:
        if inode == fuse.ROOT_INODE and name == SYNC_XATTR:
            self.sync_all()
            return
        path = self._path(inode)
        old = self._old_xattr(path, name)
        try:
            os.setxattr(path, name, value, follow_symlinks=False)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        self.meta.append(("xattr", path, name, old))

    async def removexattr(self, inode: int, name: bytes, ctx: fuse.RequestContext) -> None:
        path = self._path(inode)
        old = self._old_xattr(path, name)
        try:
            os.removexattr(path, name, follow_symlinks=False)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        self.meta.append(("xattr", path, name, old))


def main() -> None:
    backing, mountpoint, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    logging.basicConfig(level=logging.INFO, format="powerfs: %(message)s")
    fs = PowerFS(backing, seed)
    session = Session(fs, mountpoint, {"fsname=powerfs", "default_permissions", "allow_other"})
    session.start()
    print("powerfs: mounted", flush=True)
    try:
        trio.run(session.run)
    finally:
        session.close(unmount=True)
        log.info(fs.cut())


if __name__ == "__main__":
    main()
