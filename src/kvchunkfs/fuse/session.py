"""The FUSE front end: a mount's requests read from ``/dev/fuse`` and answered by an ``Operations``.

One trio thread does it all, as pyfuse3 did: the device descriptor is non-blocking, a pool of worker
tasks takes turns reading (one waits for the device at a time, ``wait_readable``), and each worker
handles the request it read to the end (the handler awaits as it likes; meanwhile other workers
read and handle others). When no worker is left waiting for the device, one more is started, up to
``max_tasks``; a worker finding ``min_tasks`` others waiting retires. Each worker reads
into a buffer of its own, allocated once; a reply is one ``write``/``writev`` of the header and the
payload (a read's bytes are never copied on the way); a read of a plain file in memory
(``Operations.read_plain``) is spliced from the file into the reply instead (fuse/splicing.py), its
bytes never entering the daemon. A write's bytes are handed on as a view of the buffer: the
filesystem copies them only where it keeps them.

**Modes.** At INIT the session negotiates passthrough where the kernel offers it (Linux 6.9+), the
daemon holds CAP_SYS_ADMIN and the writeback cache is off; otherwise it runs *served*. In both,
an open whose ``FileInfo`` names no backing file is served: its reads and writes come here. In
passthrough mode an open naming one is registered with the kernel (``FUSE_DEV_IOC_BACKING_OPEN``,
one backing id per inode shared by its opens, closed at the last RELEASE) and the kernel serves
its reads, writes and mmap from that file. Which file an open passes through to and when (the
kernel takes one file per inode at a time), and the set-id rule, are the bridge's
(fuse/rawbridge.py): the session reads, dispatches and answers requests, and registers and closes
the backing files the bridge names. The mode and why are logged at INIT (``why``).

``start`` mounts, ``run`` serves until the kernel ends the connection (unmounted) or
``terminate``; ``unmount`` detaches the mount while serving (the open files are served until closed,
then ``run`` returns); ``close`` ends it all.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from kvchunkfs.fuse import kernel, protocol, splicing
from kvchunkfs.fuse.api import (
    EntryAttributes,
    FUSEError,
    Operations,
    ReaddirToken,
    RequestContext,
    SetattrFields,
)
from kvchunkfs.fuse.protocol import Op
from kvchunkfs.fuse.rawbridge import Answer, RawBridge

log = logging.getLogger(__name__)

Handler = Callable[[int, int, int, int, int, memoryview], Awaitable[None]]  # unique nodeid uid gid pid body
_FH = protocol.FH_IN.unpack_from
_HEADER = protocol.IN_HEADER.unpack_from
_OUT = protocol.OUT_HEADER.pack
_OUT_SIZE = protocol.OUT_HEADER.size
_WRITE_IN = protocol.WRITE_IN.unpack_from
_READ_IN = protocol.READ_IN.unpack_from


def _errno_of(e: Exception) -> int:
    if isinstance(e, OSError) and e.errno:
        return e.errno
    return errno.EINVAL if isinstance(e, ValueError) else errno.EIO  # ValueError: a malformed request


class Session:
    """Serves ``ops`` on ``mountpoint`` (see the module's docstring)."""

    def __init__(self, ops: Operations, mountpoint: str, options: Iterable[str]) -> None:
        self.ops = ops
        self.mountpoint = os.path.abspath(mountpoint)
        self.options = set(options)
        self.fd = -1
        self.max_write = 1 << 20
        self._bufsize = self.max_write + protocol.BUFFER_HEADROOM
        self.passthrough = False  # negotiated at INIT
        self.why = "not initialized yet"  # the mode and why
        self.initialized = False
        self.requests = [0] * protocol.OPCODES  # requests read, by opcode
        self.backing_refused = 0  # opens that named a backing file the kernel refused: served
        self.bridge = RawBridge(ops, self)  # the opens' rules: backing files, set-id bits
        self._exiting = False
        self._gone = False  # the kernel ended the connection
        self._idle = 0
        self._tasks = 0
        self._min_tasks = 1
        self._max_tasks = 1
        self._read_lock = trio.Lock()
        self._splice_reads = False  # reads of plain files in memory: spliced (until that fails for good)
        self._reply_pipe: splicing.ReplyPipe | None = None
        self._nursery: trio.Nursery | None = None
        self._handlers = self._handler_table()

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Mount (OSError if that fails). The kernel's first request, INIT, is answered by ``run``."""
        options = self._splice_options()
        try:
            self.fd = kernel.mount(self.mountpoint, options)
        except BaseException:
            self._close_pipe()
            raise
        os.set_blocking(self.fd, False)
        self.ops.session = self

    def _splice_options(self) -> set[str]:
        """The mount options, with reads capped to what the reply pipe holds (``max_read``) where
        it cannot hold the largest (a pipe above ``/proc/sys/fs/pipe-max-size`` needs
        CAP_SYS_RESOURCE); the pipe made if the filesystem has reads to splice (``read_plain``)."""
        if type(self.ops).read_plain is Operations.read_plain:
            return self.options
        try:
            self._reply_pipe = splicing.ReplyPipe(self.max_write)
        except OSError as e:
            log.warning("FUSE: reads are not spliced: no pipe for replies (%s)", e.strerror)
            return self.options
        self._splice_reads = True
        largest = self._reply_pipe.largest()
        if largest >= self.max_write or any(o.startswith("max_read=") for o in self.options):
            return self.options
        log.info("FUSE: reads of at most %d KiB: the most a pipe holds in one reply", largest >> 10)
        return self.options | {f"max_read={largest}"}

    async def run(self, min_tasks: int = 1, max_tasks: int = 99) -> None:
        """Serve until the kernel ends the connection or ``terminate``; returns once every request
        read has been answered."""
        if self.fd < 0:
            raise RuntimeError("start() the session before run()")
        self._min_tasks, self._max_tasks = max(1, min_tasks), max(1, max_tasks)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._tasks = 1
            nursery.start_soon(self._worker)
        self._nursery = None

    def terminate(self) -> None:
        """Stop reading requests (on the trio thread); ``run`` returns once the ones read are answered."""
        self._exiting = True
        if self.fd >= 0:
            trio.lowlevel.notify_closing(self.fd)

    def unmount(self) -> None:
        """Detach the mount (blocking: from a worker thread while ``run`` serves). Files still open
        are served until closed; then the kernel ends the connection and ``run`` returns."""
        kernel.unmount(self.mountpoint)

    def close(self, unmount: bool = True) -> None:
        """Close the device (requests still waiting fail with ENOTCONN) and, unless the kernel ended
        the connection already, detach the mount."""
        if self.fd < 0:
            return
        gone = self._gone or kernel.connection_gone(self.fd)
        os.close(self.fd)  # first: a synchronous unmount would wait for this very daemon
        self.fd = -1
        self._close_pipe()
        self.ops.session = None
        if unmount and not gone:
            try:
                kernel.unmount(self.mountpoint)
            except OSError as e:
                log.warning("unmounting %s: %s", self.mountpoint, e)

    def _close_pipe(self) -> None:
        self._splice_reads = False
        if self._reply_pipe is not None:
            self._reply_pipe.close()
            self._reply_pipe = None

    # -- notifications (blocking: the kernel takes the directory's lock) --------------------

    def invalidate_entry(self, parent_inode: int, name: bytes) -> None:
        os.write(self.fd, protocol.notify_inval_entry(parent_inode, name))

    def invalidate_inode(self, inode: int, attr_only: bool = False) -> None:
        os.write(self.fd, protocol.notify_inval_inode(inode, -1 if attr_only else 0, 0))

    # -- the loop ---------------------------------------------------------------------------

    async def _worker(self) -> None:
        buf = bytearray(self._bufsize)
        view = memoryview(buf)
        try:
            while not self._exiting:
                if self._idle >= self._min_tasks and self._tasks > self._min_tasks:
                    break  # enough others wait for requests
                self._idle += 1
                try:
                    n = await self._receive(buf)
                finally:
                    self._idle -= 1
                if n <= 0:
                    break
                if self._idle == 0 and self._tasks < self._max_tasks and self._nursery is not None:
                    self._tasks += 1  # nobody left to read the next request: one more worker
                    self._nursery.start_soon(self._worker)
                await self._handle(view, n)
        finally:
            self._tasks -= 1

    async def _receive(self, buf: bytearray) -> int:
        """Read one request into ``buf``: its length, or 0 once the session ends."""
        async with self._read_lock:  # one task waits for the device at a time
            while not self._exiting:
                try:
                    return os.readv(self.fd, (buf,))
                except BlockingIOError:
                    try:
                        await trio.lowlevel.wait_readable(self.fd)
                    except trio.ClosedResourceError:  # terminate()
                        return 0
                except OSError as e:
                    if e.errno == errno.ENOENT:  # the request was interrupted before we read it
                        continue
                    if e.errno in (errno.ENODEV, errno.ECONNABORTED):  # unmounted, or aborted
                        log.debug("FUSE connection ended (%s)", errno.errorcode.get(e.errno))
                        self._gone = self._exiting = True
                        return 0
                    raise
            return 0

    async def _handle(self, view: memoryview, n: int) -> None:
        _, opcode, unique, nodeid, uid, gid, pid, _, _ = _HEADER(view)
        if opcode < protocol.OPCODES:
            self.requests[opcode] += 1
        handler = self._handlers.get(opcode)
        try:
            if handler is None:
                if opcode not in protocol.NO_REPLY:
                    self._send(protocol.error_reply(unique, errno.ENOSYS))
                return
            await handler(unique, nodeid, uid, gid, pid, view[protocol.HEADER_SIZE : n])
        except FUSEError as e:
            if opcode not in protocol.NO_REPLY:
                self._send(protocol.error_reply(unique, e.errno))
        except Exception as e:  # a bug, or bad input: this request fails, the session goes on
            name = Op(opcode).name if opcode in Op._value2member_map_ else str(opcode)
            log.error("%s failed: %s: %s", name, type(e).__name__, e, exc_info=not isinstance(e, OSError | ValueError))
            if opcode not in protocol.NO_REPLY:
                self._send(protocol.error_reply(unique, _errno_of(e)))

    def _send(self, data: Any) -> bool:
        """Write one reply; False if the kernel no longer waits for it."""
        try:
            os.write(self.fd, data)
            return True
        except OSError as e:
            return self._send_failed(e)

    def _sendv(self, parts: list[Any]) -> bool:
        try:
            os.writev(self.fd, parts)
            return True
        except OSError as e:
            return self._send_failed(e)

    def _send_failed(self, e: OSError) -> bool:
        if e.errno == errno.ENOENT:  # the request ended meanwhile (aborted, timed out)
            log.debug("reply dropped: the request is gone")
        elif e.errno in (errno.ENODEV, errno.ECONNABORTED, errno.EBADF):
            self._gone = True
        else:  # EINVAL: a malformed reply, a bug
            log.error("FUSE reply refused: %s", e)
        return False

    def _reply(self, unique: int, payload: bytes = b"") -> bool:
        return self._send(_OUT(_OUT_SIZE + len(payload), 0, unique) + payload)

    async def _reply_entry(self, unique: int, attrs: EntryAttributes) -> None:
        """An entry answer; if the kernel no longer waits for it, it never learned the inode."""
        self.bridge.seen(attrs)
        if not self._reply(unique, protocol.entry_out(attrs)) and attrs.st_ino:
            await self.ops.forget([(attrs.st_ino, 1)])

    def _handler_table(self) -> dict[int, Handler]:
        return {
            Op.INIT: self._init, Op.DESTROY: self._destroy, Op.INTERRUPT: self._interrupt,
            Op.LOOKUP: self._lookup, Op.FORGET: self._forget, Op.BATCH_FORGET: self._batch_forget,
            Op.GETATTR: self._getattr, Op.SETATTR: self._setattr, Op.READLINK: self._readlink,
            Op.SYMLINK: self._symlink, Op.MKNOD: self._mknod, Op.MKDIR: self._mkdir,
            Op.UNLINK: self._unlink, Op.RMDIR: self._rmdir, Op.RENAME: self._rename, Op.RENAME2: self._rename2,
            Op.LINK: self._link, Op.OPEN: self._open, Op.CREATE: self._create, Op.READ: self._read,
            Op.WRITE: self._write, Op.STATFS: self._statfs, Op.RELEASE: self._release, Op.FLUSH: self._flush,
            Op.FSYNC: self._fsync, Op.SETXATTR: self._setxattr, Op.GETXATTR: self._getxattr,
            Op.LISTXATTR: self._listxattr, Op.REMOVEXATTR: self._removexattr, Op.OPENDIR: self._opendir,
            Op.READDIRPLUS: self._readdirplus, Op.RELEASEDIR: self._releasedir, Op.FSYNCDIR: self._fsyncdir,
            Op.ACCESS: self._access,
        }  # fmt: skip

    # -- the handshake and requests without an inode ---------------------------------------

    async def _init(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        offer = protocol.parse_init(body)
        if offer.major > protocol.KERNEL_MAJOR:  # the kernel asks again with ours
            self._reply(unique, protocol.INIT_OUT.pack(protocol.KERNEL_MAJOR, protocol.KERNEL_MINOR, *[0] * 11))
            return
        if not self.ops.enable_passthrough:
            no_passthrough: str | None = "passthrough is turned off (fuse_passthrough = false)"
        else:
            no_passthrough = kernel.may_pass_through()
        try:
            negotiated = protocol.negotiate(
                offer,
                page_size=os.sysconf("SC_PAGE_SIZE"),
                max_write=self.max_write,
                writeback_cache=self.ops.enable_writeback_cache,
                export_support=self.ops.supports_dot_lookup,
                no_passthrough=no_passthrough,
            )
        except ValueError as e:
            log.error("cannot serve: %s", e)
            self._send(protocol.error_reply(unique, errno.EPROTO))
            self._exiting = True
            return
        self.passthrough, self.why = negotiated.passthrough, negotiated.why
        self.max_write = negotiated.max_write
        self.ops.init()
        self._reply(unique, negotiated.reply)
        self.initialized = True
        mode = "passthrough" if self.passthrough else "served"
        log.info("FUSE %d.%d, %s mode: %s", protocol.KERNEL_MAJOR, negotiated.minor, mode, self.why)

    async def _destroy(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        self._reply(unique)

    async def _interrupt(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        """Ignored (as libfuse does for a filesystem without interrupt handlers): the request runs
        to its end and is answered; the kernel waits for that answer."""

    async def _statfs(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        sv = await self.ops.statfs(RequestContext(uid, gid, pid))
        self._reply(unique, protocol.statfs_out(sv))

    # -- names and attributes ---------------------------------------------------------------

    async def _lookup(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        (name,) = protocol.cstrings(body, 1)
        await self._reply_entry(unique, await self.ops.lookup(nodeid, name, RequestContext(uid, gid, pid)))

    async def _forget(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        await self.ops.forget([(nodeid, protocol.FORGET_IN.unpack_from(body)[0])])

    async def _batch_forget(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        await self.ops.forget(protocol.forgets(body))

    async def _getattr(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        attrs = await self.ops.getattr(nodeid, RequestContext(uid, gid, pid))
        self.bridge.seen(attrs)
        self._reply(unique, protocol.attr_out(attrs))

    async def _setattr(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        (valid, _, fh, size, _, atime, mtime, ctime, atimensec, mtimensec, ctimensec, mode, _, s_uid, s_gid,
         _) = protocol.SETATTR_IN.unpack_from(body)  # fmt: skip
        attr = EntryAttributes()
        fields = SetattrFields()
        attr.st_size, attr.st_mode, attr.st_uid, attr.st_gid = size, mode, s_uid, s_gid
        attr.st_atime_ns = atime * 1_000_000_000 + atimensec
        attr.st_mtime_ns = mtime * 1_000_000_000 + mtimensec
        attr.st_ctime_ns = ctime * 1_000_000_000 + ctimensec
        if valid & (protocol.FATTR_ATIME_NOW | protocol.FATTR_MTIME_NOW):
            now = time.time_ns()
            if valid & protocol.FATTR_ATIME_NOW:
                attr.st_atime_ns = now
            if valid & protocol.FATTR_MTIME_NOW:
                attr.st_mtime_ns = now
        fields.update_atime = bool(valid & (protocol.FATTR_ATIME | protocol.FATTR_ATIME_NOW))
        fields.update_mtime = bool(valid & (protocol.FATTR_MTIME | protocol.FATTR_MTIME_NOW))
        fields.update_ctime = bool(valid & protocol.FATTR_CTIME)
        fields.update_mode = bool(valid & protocol.FATTR_MODE)
        fields.update_uid = bool(valid & protocol.FATTR_UID)
        fields.update_gid = bool(valid & protocol.FATTR_GID)
        fields.update_size = bool(valid & protocol.FATTR_SIZE)
        handle = fh if valid & protocol.FATTR_FH else None
        kill = bool(valid & protocol.FATTR_KILL_SUIDGID)
        out = await self.bridge.setattr(nodeid, attr, fields, handle, kill, RequestContext(uid, gid, pid))
        self._reply(unique, protocol.attr_out(out))

    async def _readlink(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        self._reply(unique, bytes(await self.ops.readlink(nodeid, RequestContext(uid, gid, pid))))

    async def _symlink(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        name, target = protocol.cstrings(body, 2)
        await self._reply_entry(unique, await self.ops.symlink(nodeid, name, target, RequestContext(uid, gid, pid)))

    async def _mknod(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        mode, rdev, umask, _ = protocol.MKNOD_IN.unpack_from(body)
        (name,) = protocol.cstrings(body[protocol.MKNOD_IN.size :], 1)
        ctx = RequestContext(uid, gid, pid, umask)
        await self._reply_entry(unique, await self.ops.mknod(nodeid, name, mode, rdev, ctx))

    async def _mkdir(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        mode, umask = protocol.MKDIR_IN.unpack_from(body)
        (name,) = protocol.cstrings(body[protocol.MKDIR_IN.size :], 1)
        mode = (mode & ~stat.S_IFMT(mode)) | stat.S_IFDIR  # the kernel sends the permission bits only
        ctx = RequestContext(uid, gid, pid, umask)
        await self._reply_entry(unique, await self.ops.mkdir(nodeid, name, mode, ctx))

    async def _unlink(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        (name,) = protocol.cstrings(body, 1)
        await self.ops.unlink(nodeid, name, RequestContext(uid, gid, pid))
        self._reply(unique)

    async def _rmdir(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        (name,) = protocol.cstrings(body, 1)
        await self.ops.rmdir(nodeid, name, RequestContext(uid, gid, pid))
        self._reply(unique)

    async def _rename(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        (newdir,) = protocol.RENAME_IN.unpack_from(body)
        old, new = protocol.cstrings(body[protocol.RENAME_IN.size :], 2)
        await self.ops.rename(nodeid, old, newdir, new, 0, RequestContext(uid, gid, pid))
        self._reply(unique)

    async def _rename2(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        newdir, flags, _ = protocol.RENAME2_IN.unpack_from(body)
        old, new = protocol.cstrings(body[protocol.RENAME2_IN.size :], 2)
        await self.ops.rename(nodeid, old, newdir, new, flags, RequestContext(uid, gid, pid))
        self._reply(unique)

    async def _link(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        (oldnodeid,) = protocol.LINK_IN.unpack_from(body)
        (name,) = protocol.cstrings(body[protocol.LINK_IN.size :], 1)
        await self._reply_entry(unique, await self.ops.link(oldnodeid, nodeid, name, RequestContext(uid, gid, pid)))

    # -- files ------------------------------------------------------------------------------

    async def _open(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        flags, open_flags = protocol.OPEN_IN.unpack_from(body)
        kill = bool(open_flags & protocol.OPEN_KILL_SUIDGID)
        async with self.bridge.open(nodeid, flags, kill, RequestContext(uid, gid, pid)) as answer:
            if not self._reply(unique, self._open_out(answer)):
                await self.bridge.unanswered(answer)

    async def _create(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        flags, mode, umask, _ = protocol.CREATE_IN.unpack_from(body)
        (name,) = protocol.cstrings(body[protocol.CREATE_IN.size :], 1)
        ctx = RequestContext(uid, gid, pid, umask)
        async with self.bridge.create(nodeid, name, mode, flags, ctx) as (answer, attrs):
            if not self._reply(unique, protocol.entry_out(attrs) + self._open_out(answer)):
                await self.bridge.unanswered(answer)  # as libfuse does: the kernel sends no RELEASE
                await self.ops.forget([(attrs.st_ino, 1)])

    @staticmethod
    def _open_out(answer: Answer) -> bytes:
        """An open's or create's answer: passed through to the backing id, or served as ``fi`` asks."""
        fi = answer.fi
        if answer.backing_id:
            return protocol.open_out(fi.fh, protocol.FOPEN_PASSTHROUGH, answer.backing_id)  # KEEP_CACHE fails it
        flags = 0
        if fi.direct_io:
            flags |= protocol.FOPEN_DIRECT_IO
        if fi.keep_cache:
            flags |= protocol.FOPEN_KEEP_CACHE
        if fi.nonseekable:
            flags |= protocol.FOPEN_NONSEEKABLE
        return protocol.open_out(fi.fh, flags, 0)

    def register_backing(self, fd: int) -> int:
        """The kernel's backing id for ``fd``, or 0 if it refuses the file (the open is served)."""
        if not self.passthrough:
            return 0
        try:
            return kernel.backing_open(self.fd, fd)
        except OSError as e:
            self._backing_refused(e)
            return 0

    def _backing_refused(self, e: OSError) -> None:
        self.backing_refused += 1
        if e.errno == errno.EPERM:  # the kernel dropped passthrough at INIT after all
            self.passthrough = False
            self.why = f"the kernel refused to register a backing file ({e.strerror}); every file is served"
            log.warning("FUSE: served mode from now on: %s", self.why)
        else:  # this file (its file system: ELOOP stacked too deep, EINVAL no read_iter/write_iter)
            log.warning("FUSE: backing file refused (%s); this open is served", e.strerror)

    async def close_backing(self, backing_id: int) -> None:
        """Close an inode's backing id once its last open is released (in a thread: it may be the
        backing file's last reference, whose close may wait for its disk). 0: none."""
        if not backing_id:
            return
        try:
            await trio.to_thread.run_sync(kernel.backing_close, self.fd, backing_id)
        except OSError as e:
            log.warning("FUSE: closing backing id %d: %s", backing_id, e)

    async def _read(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        fh, offset, size = _READ_IN(body)
        if self._splice_reads and self._read_spliced(unique, fh, offset, size):
            return
        data = await self.ops.read(fh, offset, size)
        n = data.nbytes if isinstance(data, memoryview) else len(data)
        self._sendv([_OUT(_OUT_SIZE + n, 0, unique), data])

    def _read_spliced(self, unique: int, fh: int, offset: int, size: int) -> bool:
        """Answer a read of a plain file in memory by splicing it (``splicing``); False if it is
        to be answered by ``ops.read``. On the event loop, without yielding: the pipe is shared."""
        plain = self.ops.read_plain(fh, offset, size)
        if plain is None:
            return False
        fd, n = plain
        if self._reply_pipe is None or not self._reply_pipe.fits(n):
            return False
        try:
            self._reply_pipe.reply(self.fd, _OUT(_OUT_SIZE + n, 0, unique), fd, offset, n)
        except splicing.Unspliced as e:
            if e.lasting:
                self._no_splice(str(e))
            else:
                log.debug("read answered without splice: %s", e)
            return False
        except OSError as e:
            self._send_failed(e)
        return True

    def _no_splice(self, why: str) -> None:
        """Reads are answered with ``ops.read`` from now on (said once)."""
        self._splice_reads = False
        log.warning("FUSE: reads are no longer spliced: %s", why)

    async def _write(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        fh, offset, size, write_flags, _, _ = _WRITE_IN(body)
        if write_flags & protocol.WRITE_KILL_SUIDGID:  # rare: a set-id file
            await self.bridge.kill_setid(nodeid, RequestContext(uid, gid, pid))
        start = protocol.WRITE_IN_SIZE
        written = await self.ops.write(fh, offset, body[start : start + size])  # copied only if kept
        self._send(_OUT(_OUT_SIZE + 8, 0, unique) + protocol.WRITE_OUT.pack(written, 0))

    async def _flush(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        await self.ops.flush(_FH(body)[0])
        self._reply(unique)

    async def _release(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        await self.bridge.release(nodeid, _FH(body)[0])
        self._reply(unique)

    async def _fsync(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        fh, flags = protocol.FSYNC_IN.unpack_from(body)
        await self.ops.fsync(fh, bool(flags & protocol.FSYNC_FDATASYNC))
        self._reply(unique)

    # -- directories ------------------------------------------------------------------------

    async def _opendir(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        fh = await self.ops.opendir(nodeid, RequestContext(uid, gid, pid))
        self._reply(unique, protocol.open_out(fh, 0))

    async def _readdirplus(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        fh, offset, size = _READ_IN(body)
        token = ReaddirToken(size, self.bridge.seen)
        await self.ops.readdir(fh, offset, token)
        self._reply(unique, bytes(token.buf))

    async def _releasedir(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        await self.ops.releasedir(_FH(body)[0])
        self._reply(unique)

    async def _fsyncdir(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        fh, flags = protocol.FSYNC_IN.unpack_from(body)
        await self.ops.fsyncdir(fh, bool(flags & protocol.FSYNC_FDATASYNC))
        self._reply(unique)

    async def _access(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        (mask,) = protocol.ACCESS_IN.unpack_from(body)
        allowed = await self.ops.access(nodeid, mask, RequestContext(uid, gid, pid))
        self._send(protocol.error_reply(unique, 0 if allowed else errno.EACCES))

    # -- extended attributes ----------------------------------------------------------------

    async def _setxattr(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        size, flags = protocol.SETXATTR_IN.unpack_from(body)
        rest = body[protocol.SETXATTR_IN.size :]
        (name,) = protocol.cstrings(rest, 1)
        value = bytes(rest[len(name) + 1 : len(name) + 1 + size])
        if flags & ~(protocol.XATTR_CREATE | protocol.XATTR_REPLACE):
            raise FUSEError(errno.EINVAL)
        ctx = RequestContext(uid, gid, pid)
        if flags & (protocol.XATTR_CREATE | protocol.XATTR_REPLACE):  # as pyfuse3: asked of getxattr
            try:
                await self.ops.getxattr(nodeid, name, ctx)
                exists = True
            except FUSEError as e:
                if e.errno != errno.ENODATA:
                    raise
                exists = False
            if flags & protocol.XATTR_CREATE and exists:
                raise FUSEError(errno.EEXIST)
            if flags & protocol.XATTR_REPLACE and not exists:
                raise FUSEError(errno.ENODATA)
        await self.ops.setxattr(nodeid, name, value, ctx)
        self._reply(unique)

    def _reply_sized(self, unique: int, size: int, value: bytes) -> None:
        """A getxattr/listxattr answer: the length if asked with size 0, else the bytes if they fit."""
        if size == 0:
            self._reply(unique, protocol.XATTR_SIZE_OUT.pack(len(value), 0))
        elif len(value) <= size:
            self._reply(unique, value)
        else:
            self._send(protocol.error_reply(unique, errno.ERANGE))

    async def _getxattr(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        (size,) = protocol.GETXATTR_IN.unpack_from(body)
        (name,) = protocol.cstrings(body[8:], 1)
        value = await self.ops.getxattr(nodeid, name, RequestContext(uid, gid, pid))
        self._reply_sized(unique, size, bytes(value))

    async def _listxattr(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        (size,) = protocol.GETXATTR_IN.unpack_from(body)
        names = await self.ops.listxattr(nodeid, RequestContext(uid, gid, pid))
        self._reply_sized(unique, size, b"".join(bytes(n) + b"\0" for n in names))

    async def _removexattr(self, unique: int, nodeid: int, uid: int, gid: int, pid: int, body: memoryview) -> None:
        (name,) = protocol.cstrings(body, 1)
        await self.ops.removexattr(nodeid, name, RequestContext(uid, gid, pid))
        self._reply(unique)
