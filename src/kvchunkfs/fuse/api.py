"""What a FUSE filesystem implements and answers with: the ``Operations`` base class and its types.

The front end (fuse/session.py) turns each kernel request into one call of an ``Operations``
method and its return value into the reply. The names and signatures follow pyfuse3's (handlers are
trio coroutines; an error is ``raise FUSEError(errno)``), so a filesystem written against that API
runs here unchanged, with one addition: an open or create may name a **backing file**
(``FileInfo.backing_fd``), whose reads, writes and mmap the kernel then serves itself (passthrough).

Pure: no I/O here; the session attaches itself to the ``Operations`` it serves (``session``).
"""

from __future__ import annotations

import errno
import stat
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvchunkfs.fuse import protocol

ROOT_INODE = 1
RENAME_NOREPLACE = 1  # renameat2(2) flags, as the kernel passes them on
RENAME_EXCHANGE = 2
RENAME_WHITEOUT = 4
default_options = frozenset({"default_permissions"})  # mount options: the kernel checks permissions


class FUSEError(Exception):
    """Raised by a handler: the request is answered with ``errno``."""

    def __init__(self, errno_: int) -> None:
        super().__init__(errno_)
        self.errno = errno_

    def __str__(self) -> str:
        return f"FUSEError({errno.errorcode.get(self.errno, self.errno)})"


class RequestContext:
    """Who made the request: the calling thread's ids and, for creates, its umask."""

    __slots__ = ("uid", "gid", "pid", "umask")

    def __init__(self, uid: int = 0, gid: int = 0, pid: int = 0, umask: int = 0) -> None:
        self.uid, self.gid, self.pid, self.umask = uid, gid, pid, umask


class EntryAttributes:
    """An inode's attributes and how long the kernel may cache them and its name (seconds)."""

    __slots__ = (
        "st_ino", "generation", "entry_timeout", "attr_timeout", "st_mode", "st_nlink", "st_uid", "st_gid",
        "st_rdev", "st_size", "st_blksize", "st_blocks", "st_atime_ns", "st_mtime_ns", "st_ctime_ns",
    )  # fmt: skip

    def __init__(self) -> None:  # pyfuse3's defaults
        self.st_ino = 0
        self.generation = 0
        self.entry_timeout: float = 300
        self.attr_timeout: float = 300
        self.st_mode = stat.S_IFREG
        self.st_nlink = 1
        self.st_uid = 0
        self.st_gid = 0
        self.st_rdev = 0
        self.st_size = 0
        self.st_blksize = 4096
        self.st_blocks = 0
        self.st_atime_ns = 0
        self.st_mtime_ns = 0
        self.st_ctime_ns = 0


class SetattrFields:
    """Which attributes a ``setattr`` changes (the new values are in its ``EntryAttributes``)."""

    __slots__ = ("update_atime", "update_mtime", "update_ctime", "update_mode", "update_uid", "update_gid",
                 "update_size")  # fmt: skip

    def __init__(self) -> None:
        self.update_atime = self.update_mtime = self.update_ctime = False
        self.update_mode = self.update_uid = self.update_gid = self.update_size = False


class StatvfsData:
    """A ``statfs`` answer (statvfs(3) fields)."""

    __slots__ = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail",
                 "f_namemax")  # fmt: skip

    def __init__(self) -> None:
        self.f_bsize = self.f_frsize = self.f_blocks = self.f_bfree = self.f_bavail = 0
        self.f_files = self.f_ffree = self.f_favail = self.f_namemax = 0


class FileInfo:
    """An ``open``/``create`` answer.

    ``backing_fd``: an open descriptor of a file whose bytes this open's reads, writes and mmap
    are (passthrough). The session takes it over (it closes it once the open is answered). Where
    the mount runs in served mode, or the kernel refuses that file, the open is served as usual:
    the filesystem must still answer its reads and writes. One backing file per inode while it is
    open: a later open of an inode already open through passthrough waits for those opens to end
    if it names another file (``Operations.writes_in_place``).
    """

    __slots__ = ("fh", "direct_io", "keep_cache", "nonseekable", "backing_fd")

    def __init__(
        self,
        fh: int = 0,
        direct_io: bool = False,
        keep_cache: bool = True,
        nonseekable: bool = False,
        backing_fd: int | None = None,
    ) -> None:
        self.fh = fh
        self.direct_io = direct_io
        self.keep_cache = keep_cache
        self.nonseekable = nonseekable
        self.backing_fd = backing_fd


class ReaddirToken:
    """A ``readdir`` reply being filled by ``readdir_reply``: at most ``size`` bytes of entries;
    ``seen`` is told each entry's attributes (the session's view of what the kernel knows)."""

    __slots__ = ("buf", "size", "seen")

    def __init__(self, size: int, seen: Callable[[EntryAttributes], None] | None = None) -> None:
        self.buf = bytearray()
        self.size = size
        self.seen = seen


def readdir_reply(token: ReaddirToken, name: bytes, attr: EntryAttributes, next_id: int) -> bool:
    """Add one entry (name, attributes, the ``start_id`` that continues after it) to a listing;
    False if it does not fit (the kernel asks again from there). Each entry added counts as a
    lookup of its inode (``forget`` takes it back)."""
    entry = protocol.direntplus(name, attr, next_id)
    if len(entry) > token.size:
        return False
    token.buf += entry
    token.size -= len(entry)
    if token.seen is not None:
        token.seen(attr)
    return True


class Serving(Protocol):
    """What the serving session offers a filesystem: its mode, and notifications to the kernel."""

    passthrough: bool  # negotiated: opens may name a backing file
    why: str  # the mode and why (logged at INIT)

    def invalidate_entry(self, parent_inode: int, name: bytes) -> None: ...

    def invalidate_inode(self, inode: int, attr_only: bool = False) -> None: ...


class Operations:
    """The handlers a filesystem implements; each answers ENOSYS unless overridden.

    Inodes and file handles are the filesystem's integers (``ROOT_INODE`` is the root). Handlers run
    on the session's trio thread, many at once (each awaits as it likes); they must not block it.
    """

    supports_dot_lookup = True  # the kernel may look up "." and ".." (NFS export)
    enable_writeback_cache = False  # the kernel caches writes (no passthrough then)
    enable_passthrough = True  # negotiate passthrough where the kernel and the process allow it
    enable_acl = False
    session: Serving | None = None  # set by the session serving it

    def init(self) -> None:
        """Called once the kernel's INIT is answered, on the session's thread."""

    def invalidate_entry(self, parent_inode: int, name: bytes) -> None:
        """Make the kernel forget ``name`` in ``parent_inode`` (blocking: call it in a worker thread,
        never while a request on that directory waits for this thread). No-op without a session;
        OSError if the kernel does not know the name."""
        if self.session is not None:
            self.session.invalidate_entry(parent_inode, name)

    def invalidate_inode(self, inode: int, attr_only: bool = False) -> None:
        """Make the kernel forget an inode's cached attributes (and pages unless ``attr_only``);
        blocking, as ``invalidate_entry``."""
        if self.session is not None:
            self.session.invalidate_inode(inode, attr_only)

    async def lookup(self, parent_inode: int, name: bytes, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        pass

    async def getattr(self, inode: int, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def setattr(
        self, inode: int, attr: EntryAttributes, fields: SetattrFields, fh: int | None, ctx: RequestContext
    ) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def readlink(self, inode: int, ctx: RequestContext) -> bytes:
        raise FUSEError(errno.ENOSYS)

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def unlink(self, parent_inode: int, name: bytes, ctx: RequestContext) -> None:
        raise FUSEError(errno.ENOSYS)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: RequestContext) -> None:
        raise FUSEError(errno.ENOSYS)

    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: RequestContext,
    ) -> None:
        raise FUSEError(errno.ENOSYS)

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def open(self, inode: int, flags: int, ctx: RequestContext) -> FileInfo:
        raise FUSEError(errno.ENOSYS)

    def writes_in_place(self, inode: int) -> bool:
        """Whether an open of ``inode`` for writing now would pass through to the file its open
        files use (passthrough). False: it needs a file of its own, and the bridge lets the
        earlier opens of the inode end first (fuse/rawbridge.py, fuse/backing.py). Called on the event loop."""
        return True

    async def read(self, fh: int, off: int, size: int) -> Any:  # bytes or any contiguous buffer
        raise FUSEError(errno.ENOSYS)

    def read_plain(self, fh: int, off: int, size: int) -> tuple[int, int] | None:
        """Where a read's bytes lie in a plain file in memory, for the kernel to copy them from it
        (splice): the file's descriptor and how many of the ``size`` bytes at ``off`` it has; None
        to answer with ``read``. Called on the event loop: must not block."""
        return None

    async def write(self, fh: int, off: int, buf: memoryview) -> int:
        """``buf`` is a view of the session's request buffer, valid until this returns: a
        filesystem that keeps the bytes copies them."""
        raise FUSEError(errno.ENOSYS)

    async def flush(self, fh: int) -> None:
        raise FUSEError(errno.ENOSYS)

    async def release(self, fh: int) -> None:
        raise FUSEError(errno.ENOSYS)

    async def fsync(self, fh: int, datasync: bool) -> None:
        raise FUSEError(errno.ENOSYS)

    async def opendir(self, inode: int, ctx: RequestContext) -> int:
        raise FUSEError(errno.ENOSYS)

    async def readdir(self, fh: int, start_id: int, token: ReaddirToken) -> None:
        raise FUSEError(errno.ENOSYS)

    async def releasedir(self, fh: int) -> None:
        raise FUSEError(errno.ENOSYS)

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        raise FUSEError(errno.ENOSYS)

    async def statfs(self, ctx: RequestContext) -> StatvfsData:
        raise FUSEError(errno.ENOSYS)

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: RequestContext) -> None:
        raise FUSEError(errno.ENOSYS)

    async def getxattr(self, inode: int, name: bytes, ctx: RequestContext) -> bytes:
        raise FUSEError(errno.ENOSYS)

    async def listxattr(self, inode: int, ctx: RequestContext) -> Sequence[bytes]:
        raise FUSEError(errno.ENOSYS)

    async def removexattr(self, inode: int, name: bytes, ctx: RequestContext) -> None:
        raise FUSEError(errno.ENOSYS)

    async def access(self, inode: int, mode: int, ctx: RequestContext) -> bool:
        raise FUSEError(errno.ENOSYS)

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: RequestContext
    ) -> tuple[FileInfo, EntryAttributes]:
        raise FUSEError(errno.ENOSYS)
