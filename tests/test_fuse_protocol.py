"""The FUSE wire format (fuse/protocol.py), the mount options (fuse/kernel.py) and the session's
request dispatch (fuse/session.py), in process: requests as the kernel lays them out are handed to
the session, whose replies are read back from a pipe standing in for /dev/fuse."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
from collections.abc import Iterator

import pytest
import trio

from kvchunkfs.fuse import api, kernel, protocol, splicing
from kvchunkfs.fuse.protocol import Op
from kvchunkfs.fuse.session import Session

MiB = 1 << 20
# What Linux 6.18 offers at INIT (protocol 7.45): every flag of fuse_init_in it sets there.
KERNEL_FLAGS = (
    protocol.ASYNC_READ | protocol.POSIX_LOCKS | protocol.ATOMIC_O_TRUNC | protocol.EXPORT_SUPPORT
    | protocol.BIG_WRITES | protocol.AUTO_INVAL_DATA | protocol.DO_READDIRPLUS | protocol.READDIRPLUS_AUTO
    | protocol.ASYNC_DIO | protocol.WRITEBACK_CACHE | protocol.PARALLEL_DIROPS | protocol.HANDLE_KILLPRIV
    | protocol.POSIX_ACL | protocol.MAX_PAGES | protocol.INIT_EXT | (1 << 10) | (1 << 17) | (1 << 23)
    | protocol.HANDLE_KILLPRIV_V2 | (1 << 29)
    | protocol.PASSTHROUGH | (1 << 32) | (1 << 35) | (1 << 38) | (1 << 39)
)  # fmt: skip
TODAY = (  # what libfuse 3.14 answered for pyfuse3 (its INIT reply dropped PARALLEL_DIROPS and HANDLE_KILLPRIV);
    # the session answers HANDLE_KILLPRIV_V2 too
    protocol.ASYNC_READ | protocol.ATOMIC_O_TRUNC | protocol.EXPORT_SUPPORT | protocol.BIG_WRITES
    | protocol.AUTO_INVAL_DATA | protocol.DO_READDIRPLUS | protocol.ASYNC_DIO | protocol.MAX_PAGES | protocol.INIT_EXT
)  # fmt: skip


def offer(minor: int = 45, flags: int = KERNEL_FLAGS) -> protocol.InitOffer:
    return protocol.InitOffer(7, minor, 128 << 10, flags)


def attrs(ino: int = 7, mode: int = stat.S_IFREG | 0o640, size: int = 12345) -> api.EntryAttributes:
    a = api.EntryAttributes()
    a.st_ino, a.st_mode, a.st_size, a.st_nlink, a.st_uid, a.st_gid = ino, mode, size, 1, 1000, 100
    a.st_blksize, a.st_blocks = 1 << 20, (size + 511) // 512
    a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns = 1_700_000_000_123_456_789, -1_500_000_000, 5
    a.entry_timeout, a.attr_timeout = 1.5, 0.25
    return a


# -- layouts ------------------------------------------------------------------------------------


def test_struct_sizes_are_the_kernels() -> None:
    sizes = {protocol.IN_HEADER: 40, protocol.OUT_HEADER: 16, protocol.ENTRY_OUT: 128, protocol.ATTR_OUT: 104,
             protocol.OPEN_OUT: 16, protocol.INIT_OUT: 64, protocol.STATFS_OUT: 80, protocol.SETATTR_IN: 88,
             protocol.WRITE_IN: 40, protocol.DIRENT: 24, protocol.BACKING_MAP: 16, protocol.CREATE_IN: 16}  # fmt: skip
    assert {s.format: s.size for s in sizes} == {s.format: n for s, n in sizes.items()}


def test_entry_out_carries_inode_timeouts_and_attributes() -> None:
    out = protocol.entry_out(attrs())
    nodeid, gen, ev, av, evn, avn = struct.unpack_from("=QQQQII", out)
    assert (nodeid, gen, ev, av, evn, avn) == (7, 0, 1, 0, 500_000_000, 250_000_000)
    ino, size, blocks, at, mt, ct, atn, mtn, ctn, mode, nlink, uid, gid, rdev, blksize, flags = struct.unpack_from(
        "=QQQqqqIIIIIIIIII", out, 40
    )
    assert (ino, size, blocks, mode, nlink, uid, gid, rdev, blksize, flags) == (
        7, 12345, 25, stat.S_IFREG | 0o640, 1, 1000, 100, 0, 1 << 20, 0)  # fmt: skip
    assert (at, atn) == (1_700_000_000, 123_456_789)
    assert (mt, mtn) == (-2, 500_000_000)  # before 1970: seconds down, nanoseconds up
    assert (ct, ctn) == (0, 5)


def test_attr_out_and_timeouts() -> None:
    out = protocol.attr_out(attrs())
    assert struct.unpack_from("=QII", out) == (0, 250_000_000, 0)
    assert out[16:] == protocol.entry_out(attrs())[40:]
    assert protocol.timeout(-1) == (0, 0) and protocol.timeout(300) == (300, 0)


def test_direntplus_is_an_entry_then_a_padded_dirent() -> None:
    d = protocol.direntplus(b"abc", attrs(9, stat.S_IFDIR | 0o755), 42)
    assert len(d) % 8 == 0 and len(d) == 128 + 24 + 8
    assert d[:128] == protocol.entry_out(attrs(9, stat.S_IFDIR | 0o755))
    assert struct.unpack_from("=QQII", d, 128) == (9, 42, 3, stat.S_IFDIR >> 12)
    assert d[152:155] == b"abc" and d[155:] == bytes(5)


def test_readdir_reply_fills_the_token_until_an_entry_does_not_fit() -> None:
    one = len(protocol.direntplus(b"name-0", attrs(), 1))
    token = api.ReaddirToken(2 * one + one // 2)
    assert api.readdir_reply(token, b"name-0", attrs(), 1)
    assert api.readdir_reply(token, b"name-1", attrs(), 2)
    assert not api.readdir_reply(token, b"name-2", attrs(), 3)
    assert len(token.buf) == 2 * one and token.size == one // 2


def test_notifications_have_unique_zero_and_the_code_as_error() -> None:
    n = protocol.notify_inval_entry(5, b"snap")
    assert struct.unpack_from("=IiQ", n) == (len(n), protocol.NOTIFY_INVAL_ENTRY, 0)
    assert struct.unpack_from("=QII", n, 16) == (5, 4, 0) and n[32:] == b"snap\0"
    m = protocol.notify_inval_inode(8, -1, 0)
    assert struct.unpack_from("=IiQQqq", m) == (40, protocol.NOTIFY_INVAL_INODE, 0, 8, -1, 0)


def test_decoding_names_and_forgets() -> None:
    assert protocol.cstrings(b"old\0new\0", 2) == [b"old", b"new"]
    with pytest.raises(ValueError):
        protocol.cstrings(b"unterminated", 1)
    body = struct.pack("=II", 3, 0) + struct.pack("=QQQQ", 10, 1, 11, 2)  # says 3, carries 2
    assert protocol.forgets(body) == [(10, 1), (11, 2)]
    assert protocol.error_reply(99, errno.ENOENT) == struct.pack("=IiQ", 16, -errno.ENOENT, 99)


# -- INIT ---------------------------------------------------------------------------------------


def init_reply(n: protocol.Negotiated) -> tuple[int, ...]:
    return protocol.INIT_OUT.unpack(n.reply)


def test_init_answers_todays_flags_plus_passthrough() -> None:
    n = protocol.negotiate(offer(), page_size=4096, max_write=MiB)
    major, minor, ra, flags, bg, cong, max_write, gran, pages, align, flags2, depth, _ = init_reply(n)
    assert (major, minor, ra, bg, cong, max_write, gran, pages, align) == (7, 40, 128 << 10, 0, 0, MiB, 1, 256, 0)
    assert flags | flags2 << 32 == TODAY | protocol.HANDLE_KILLPRIV_V2 | protocol.PASSTHROUGH
    assert flags2 == 1 << 5 and depth == protocol.MAX_STACK_DEPTH
    assert n.passthrough and "offers passthrough" in n.why


def test_init_without_passthrough_offered_or_allowed() -> None:
    old = protocol.negotiate(offer(38, KERNEL_FLAGS & ~protocol.PASSTHROUGH), page_size=4096)
    assert not old.passthrough and "does not offer" in old.why
    ours = TODAY | protocol.HANDLE_KILLPRIV_V2
    assert init_reply(old)[1] == 38 and init_reply(old)[3] == ours and init_reply(old)[10:12] == (0, 0)
    denied = protocol.negotiate(offer(), page_size=4096, no_passthrough="no CAP_SYS_ADMIN")
    assert not denied.passthrough and denied.why == "no CAP_SYS_ADMIN" and init_reply(denied)[10] == 0
    cached = protocol.negotiate(offer(), page_size=4096, writeback_cache=True)  # passthrough needs it off
    assert not cached.passthrough and "writeback" in cached.why
    assert init_reply(cached)[3] == ours | protocol.WRITEBACK_CACHE
    no_ext = protocol.negotiate(offer(flags=KERNEL_FLAGS & 0xFFFFFFFF & ~protocol.INIT_EXT), page_size=4096)
    assert not no_ext.passthrough and init_reply(no_ext)[3] == ours & ~protocol.INIT_EXT


def test_init_request_sizes_and_old_kernels() -> None:
    small = protocol.negotiate(offer(flags=KERNEL_FLAGS & ~protocol.MAX_PAGES), page_size=4096)
    assert (small.max_write, small.max_pages) == (128 << 10, 0)  # the kernel's 32 pages without MAX_PAGES
    with pytest.raises(ValueError):
        protocol.negotiate(offer(22), page_size=4096)
    with pytest.raises(ValueError):
        protocol.negotiate(protocol.InitOffer(6, 40, 0, 0), page_size=4096)


def test_parse_init_takes_flags2_only_with_init_ext() -> None:
    body = struct.pack("=IIIII", 7, 45, 1 << 17, protocol.INIT_EXT, 1 << 5) + bytes(44)
    assert protocol.parse_init(body) == protocol.InitOffer(7, 45, 1 << 17, protocol.INIT_EXT | protocol.PASSTHROUGH)
    body = struct.pack("=IIIII", 7, 45, 0, protocol.ASYNC_READ, 1 << 5)
    assert protocol.parse_init(body).flags == protocol.ASYNC_READ


# -- mount options ------------------------------------------------------------------------------


def test_mount_options_split_into_flags_kernel_options_and_names() -> None:
    o = kernel.MountOptions.parse({"default_permissions", "allow_other", "fsname=kv-chunk-fs", "subtype=kvcfs"})
    assert o.flags == kernel.MS_NOSUID | kernel.MS_NODEV  # libfuse's defaults
    assert sorted(o.kernel) == ["allow_other", "default_permissions"]
    assert (o.fsname, o.subtype) == ("kv-chunk-fs", "kvcfs")
    assert o.fusermount() == "rw,nosuid,nodev,allow_other,default_permissions,fsname=kv-chunk-fs,subtype=kvcfs"
    assert kernel.MountOptions.parse({"ro", "suid", "noatime"}).flags == kernel.MS_RDONLY | kernel.MS_NODEV | (
        kernel.MS_NOATIME
    )
    with pytest.raises(ValueError):
        kernel.MountOptions.parse({"nonsense"})


# -- the session's dispatch ---------------------------------------------------------------------


class Recorder(api.Operations):
    """Answers from fixed data and records what it was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.xattrs: dict[bytes, bytes] = {b"user.a": b"value"}

    async def lookup(self, parent_inode: int, name: bytes, ctx: api.RequestContext) -> api.EntryAttributes:
        self.calls.append(("lookup", parent_inode, name, ctx.uid, ctx.gid, ctx.pid))
        if name == b"boom":
            raise RuntimeError("a bug")
        return attrs()

    async def forget(self, inode_list) -> None:
        self.calls.append(("forget", list(inode_list)))

    async def setattr(self, inode, attr, fields, fh, ctx):
        self.calls.append(("setattr", inode, fields.update_size, attr.st_size, fields.update_mtime,
                           attr.st_mtime_ns, fields.update_mode, fh))  # fmt: skip
        return attrs()

    async def read(self, fh: int, off: int, size: int) -> memoryview:
        return memoryview(bytes(range(256)) * 8)[off : off + size]

    async def write(self, fh: int, off: int, buf: memoryview) -> int:
        self.calls.append(("write", fh, off, bytes(buf)))
        return len(buf)

    async def getxattr(self, inode: int, name: bytes, ctx: api.RequestContext) -> bytes:
        if name not in self.xattrs:
            raise api.FUSEError(errno.ENODATA)
        return self.xattrs[name]

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: api.RequestContext) -> None:
        self.xattrs[name] = value

    async def open(self, inode: int, flags: int, ctx: api.RequestContext) -> api.FileInfo:
        self.backing = os.open("/dev/null", os.O_RDONLY)
        return api.FileInfo(fh=33, backing_fd=self.backing)

    async def mkdir(self, parent_inode, name, mode, ctx):
        self.calls.append(("mkdir", name, oct(mode), ctx.umask))
        return attrs(mode=mode)


@pytest.fixture
def wire() -> Iterator[tuple[Session, Recorder, int]]:
    """A session whose device is a pipe's write end: its replies are read from the read end."""
    ops = Recorder()
    session = Session(ops, "/nonexistent", set())
    r, w = os.pipe()
    session.fd = w
    try:
        yield session, ops, r
    finally:
        os.close(r)
        os.close(w)


def request(op: int, body: bytes, nodeid: int = 1, unique: int = 77) -> memoryview:
    return memoryview(protocol.IN_HEADER.pack(40 + len(body), op, unique, nodeid, 1000, 100, 4242, 0, 0) + body)


def handle(session: Session, op: int, body: bytes, nodeid: int = 1, unique: int = 77) -> None:
    req = request(op, body, nodeid, unique)
    trio.run(session._handle, req, len(req))


def reply(r: int) -> tuple[int, int, bytes]:
    """(error, unique, payload) of the next reply."""
    head = os.read(r, 16)
    length, error, unique = protocol.OUT_HEADER.unpack(head)
    return error, unique, os.read(r, length - 16) if length > 16 else b""


def test_lookup_reaches_the_operations_and_is_answered_with_an_entry(wire) -> None:
    session, ops, r = wire
    handle(session, Op.LOOKUP, b"snap\0", nodeid=3)
    assert ops.calls == [("lookup", 3, b"snap", 1000, 100, 4242)]
    assert reply(r) == (0, 77, protocol.entry_out(attrs()))
    assert session.requests[Op.LOOKUP] == 1


def test_failures_are_errnos_and_the_session_goes_on(wire) -> None:
    session, ops, r = wire
    handle(session, Op.LOOKUP, b"boom\0")  # an exception that is not a FUSEError: EIO and a log line
    assert reply(r)[0] == -errno.EIO
    handle(session, Op.LOOKUP, b"no terminator")  # a malformed request: EINVAL
    assert reply(r)[0] == -errno.EINVAL
    handle(session, Op.SYMLINK, b"a\0b\0")  # not implemented: ENOSYS
    assert reply(r)[0] == -errno.ENOSYS
    handle(session, 9999, b"")  # unknown opcode
    assert reply(r)[0] == -errno.ENOSYS
    handle(session, Op.INTERRUPT, struct.pack("=Q", 5))  # no reply: the next one read is the getattr's
    handle(session, Op.GETATTR, bytes(16))
    assert reply(r)[0] == -errno.ENOSYS


def test_forgets_setattr_and_mkdir_are_decoded(wire) -> None:
    session, ops, r = wire
    handle(session, Op.FORGET, struct.pack("=Q", 3), nodeid=12)
    handle(session, Op.BATCH_FORGET, struct.pack("=IIQQQQ", 2, 0, 5, 1, 6, 2))
    valid = protocol.FATTR_SIZE | protocol.FATTR_MTIME | protocol.FATTR_FH
    handle(session, Op.SETATTR, protocol.SETATTR_IN.pack(valid, 0, 9, 4096, 0, 0, 1_000, 0, 0, 7, 0, 0, 0, 0, 0, 0))
    assert reply(r)[0] == 0
    handle(session, Op.MKDIR, struct.pack("=II", 0o755, 0o022) + b"dir\0")
    assert reply(r)[0] == 0
    assert ops.calls == [("forget", [(12, 3)]), ("forget", [(5, 1), (6, 2)]),
                         ("setattr", 1, True, 4096, True, 1_000_000_000_007, False, 9),
                         ("mkdir", b"dir", oct(stat.S_IFDIR | 0o755), 0o022)]  # fmt: skip


def test_read_and_write_carry_their_bytes(wire) -> None:
    session, ops, r = wire
    handle(session, Op.READ, struct.pack("=QQIIQII", 1, 100, 50, 0, 0, 0, 0))
    assert reply(r) == (0, 77, (bytes(range(256)) * 8)[100:150])
    payload = os.urandom(1000)
    handle(session, Op.WRITE, protocol.WRITE_IN.pack(4, 8192, len(payload), 0, 0, 0) + payload)
    assert reply(r) == (0, 77, struct.pack("=II", 1000, 0))
    assert ops.calls == [("write", 4, 8192, payload)]


def test_xattr_sizes_and_flags(wire) -> None:
    session, ops, r = wire
    handle(session, Op.GETXATTR, struct.pack("=II", 0, 0) + b"user.a\0")  # size 0: how long it is
    assert reply(r)[2] == struct.pack("=II", 5, 0)
    handle(session, Op.GETXATTR, struct.pack("=II", 3, 0) + b"user.a\0")  # too small a buffer
    assert reply(r)[0] == -errno.ERANGE
    handle(session, Op.GETXATTR, struct.pack("=II", 64, 0) + b"user.a\0")
    assert reply(r)[2] == b"value"
    handle(session, Op.SETXATTR, struct.pack("=II", 1, protocol.XATTR_CREATE) + b"user.a\0x")
    assert reply(r)[0] == -errno.EEXIST
    handle(session, Op.SETXATTR, struct.pack("=II", 1, protocol.XATTR_REPLACE) + b"user.b\0x")
    assert reply(r)[0] == -errno.ENODATA
    handle(session, Op.SETXATTR, struct.pack("=II", 2, protocol.XATTR_CREATE) + b"user.b\0xy")
    assert reply(r)[0] == 0 and ops.xattrs[b"user.b"] == b"xy"


def test_a_backing_file_in_served_mode_is_closed_and_the_open_served(wire) -> None:
    session, ops, r = wire
    handle(session, Op.OPEN, struct.pack("=II", os.O_RDONLY, 0), nodeid=5)
    error, _, out = reply(r)
    assert error == 0 and protocol.OPEN_OUT.unpack(out) == (33, protocol.FOPEN_KEEP_CACHE, 0)
    with pytest.raises(OSError):  # the session took the descriptor over and closed it
        os.fstat(ops.backing)


class Modes(api.Operations):
    """One file whose mode the session may change (set-id bits dropped)."""

    def __init__(self, mode: int) -> None:
        self.mode = mode
        self.writes = 0

    async def getattr(self, inode: int, ctx: api.RequestContext) -> api.EntryAttributes:
        return attrs(inode, stat.S_IFREG | self.mode)

    async def setattr(self, inode, attr, fields, fh, ctx):
        if fields.update_mode:
            self.mode = stat.S_IMODE(attr.st_mode)
        return attrs(inode, stat.S_IFREG | self.mode)

    async def write(self, fh: int, off: int, buf: memoryview) -> int:
        self.writes += 1
        return len(buf)

    async def open(self, inode: int, flags: int, ctx: api.RequestContext) -> api.FileInfo:
        return api.FileInfo(fh=1)


def session_on_pipe(ops: api.Operations) -> tuple[Session, int, int]:
    session = Session(ops, "/nonexistent", set())
    r, w = os.pipe()
    session.fd = w
    return session, r, w


@pytest.mark.parametrize(
    ("mode", "after"), [(0o6755, 0o755), (0o6745, 0o2745), (0o4700, 0o700), (0o755, 0o755)], ids=oct
)
def test_set_id_bits_are_dropped_where_the_kernel_asks(mode: int, after: int) -> None:
    """HANDLE_KILLPRIV_V2: set-user-ID goes, set-group-ID only with group execute (as the VFS)."""
    for op, body in (
        (Op.WRITE, protocol.WRITE_IN.pack(1, 0, 1, protocol.WRITE_KILL_SUIDGID, 0, 0) + b"x"),
        (Op.SETATTR, protocol.SETATTR_IN.pack(protocol.FATTR_UID | protocol.FATTR_KILL_SUIDGID, *[0] * 15)),
        (Op.OPEN, struct.pack("=II", os.O_WRONLY | os.O_TRUNC, protocol.OPEN_KILL_SUIDGID)),
    ):
        ops = Modes(mode)
        session, r, w = session_on_pipe(ops)
        try:
            handle(session, Op.GETATTR, bytes(16), nodeid=7)  # the kernel learns the mode
            assert reply(r)[0] == 0
            handle(session, op, body, nodeid=7)
            assert ops.mode == after, (protocol.Op(op).name, oct(ops.mode))
            first = reply(r)
            if after != mode and op != Op.SETATTR:  # the kernel is told to drop the old mode it caches
                assert first[:2] == (protocol.NOTIFY_INVAL_INODE, 0), first
                first = reply(r)
            assert first[0] == 0
        finally:
            os.close(r)
            os.close(w)


def test_a_write_without_the_flag_or_to_an_inode_not_set_id_changes_no_mode() -> None:
    ops = Modes(0o6755)
    session, r, w = session_on_pipe(ops)
    try:
        handle(session, Op.GETATTR, bytes(16), nodeid=7)
        reply(r)
        handle(session, Op.WRITE, protocol.WRITE_IN.pack(1, 0, 1, 0, 0, 0) + b"x", nodeid=7)  # root: CAP_FSETID
        assert reply(r)[0] == 0 and ops.mode == 0o6755
        handle(session, Op.WRITE, protocol.WRITE_IN.pack(1, 0, 1, protocol.WRITE_KILL_SUIDGID, 0, 0) + b"x", nodeid=8)
        assert reply(r)[0] == 0 and ops.mode == 0o6755  # inode 8: the kernel was never told it is set-id
    finally:
        os.close(r)
        os.close(w)


class PlainReads(api.Operations):
    """A file whose reads may be spliced from ``fd`` (``read_plain``); ``read`` answers otherwise."""

    def __init__(self, fd: int, data: bytes) -> None:
        self.fd, self.data = fd, data
        self.plain_asked = 0
        self.reads = 0

    def read_plain(self, fh: int, off: int, size: int) -> tuple[int, int] | None:
        self.plain_asked += 1
        return self.fd, max(0, min(size, len(self.data) - off))

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.reads += 1
        return self.data[off : off + size]


def splicing_session(ops: api.Operations) -> tuple[Session, set[str], int, int]:
    """A session as ``start`` makes it (its reply pipe, its mount options), replying into a pipe."""
    session = Session(ops, "/nonexistent", set())
    options = session._splice_options()
    r, w = os.pipe2(os.O_CLOEXEC)
    fcntl.fcntl(w, splicing.F_SETPIPE_SZ, 1 << 20)
    session.fd = w
    return session, options, r, w


def read_in(offset: int, size: int) -> bytes:
    return protocol.READ_IN.pack(1, offset, size) + bytes(24)


def test_a_read_of_a_plain_file_is_spliced_whole() -> None:
    data = os.urandom(300_000)
    fd = os.memfd_create("plain")
    os.write(fd, data)
    ops = PlainReads(fd, data)
    session, options, r, w = splicing_session(ops)
    try:
        largest = session._reply_pipe.largest() if session._reply_pipe else 0
        # Reads are capped to what the pipe holds only if it cannot hold the largest.
        assert (f"max_read={largest}" in options) == (largest < session.max_write)
        for off, size in ((0, 131072), (4000, 65536), (len(data) - 100, 4096), (len(data), 4096)):
            handle(session, Op.READ, read_in(off, size))
            assert reply(r) == (0, 77, data[off : off + size])
        assert ops.reads == 0 and ops.plain_asked == 4
    finally:
        session._close_pipe()
        for x in (fd, r, w):
            os.close(x)


def test_a_file_that_refuses_splicing_is_read_as_before(tmp_path, caplog) -> None:
    """A file system that cannot splice (a directory stands in): the read is answered by ``read``,
    and so are the next ones, without asking for the plain file again; said once."""
    data = os.urandom(10_000)
    d = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    ops = PlainReads(d, data)
    session, _, r, w = splicing_session(ops)
    try:
        for _ in range(2):
            handle(session, Op.READ, read_in(100, 5000))
            assert reply(r) == (0, 77, data[100:5100])
        assert ops.reads == 2 and ops.plain_asked == 1
        assert caplog.text.count("reads are no longer spliced") == 1
    finally:
        session._close_pipe()
        for x in (d, r, w):
            os.close(x)
