"""The FUSE kernel protocol (``/dev/fuse``): message layouts, opcodes, flags and the INIT handshake.

Pure: bytes in, bytes out; the session (fuse/session.py) reads requests and writes replies. Every
request starts with ``fuse_in_header`` (40 bytes), every reply with ``fuse_out_header`` (16 bytes:
total length, negative errno or 0, the request's ``unique``). A notification is a reply with
``unique`` 0 and the notification code in the error field. Layouts are those of the kernel's
``include/uapi/linux/fuse.h``, in the machine's byte order.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from enum import IntEnum
from struct import Struct
from typing import Protocol

KERNEL_MAJOR = 7
# The protocol version we speak: 7.40 added passthrough. The kernel uses the smaller of its own
# and ours; everything it added after 7.40 is behind INIT flags we do not set, or new opcodes we
# answer with ENOSYS.
KERNEL_MINOR = 40
OLDEST_MINOR = 23  # Linux 3.15: READDIRPLUS, RENAME2, the 64-byte fuse_init_out
ROOT_ID = 1

# -- opcodes ------------------------------------------------------------------------------------


class Op(IntEnum):
    LOOKUP = 1
    FORGET = 2  # no reply
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36  # no reply
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41
    BATCH_FORGET = 42  # no reply
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SETUPMAPPING = 48
    REMOVEMAPPING = 49
    SYNCFS = 50
    TMPFILE = 51
    STATX = 52
    COPY_FILE_RANGE_64 = 53


OPCODES = 64  # requests are counted for opcodes below this
NO_REPLY = frozenset({Op.FORGET, Op.BATCH_FORGET, Op.INTERRUPT})  # the kernel waits for no answer

# notification codes (the error field of a reply with unique 0)
NOTIFY_INVAL_INODE, NOTIFY_INVAL_ENTRY = 2, 3

# -- INIT flags (bits 32..63 travel in flags2, which counts only with INIT_EXT) -----------------
ASYNC_READ = 1 << 0
POSIX_LOCKS = 1 << 1
ATOMIC_O_TRUNC = 1 << 3
EXPORT_SUPPORT = 1 << 4
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
PARALLEL_DIROPS = 1 << 18
HANDLE_KILLPRIV = 1 << 19
POSIX_ACL = 1 << 20
MAX_PAGES = 1 << 22
HANDLE_KILLPRIV_V2 = 1 << 28
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37

# open reply flags (fuse_open_out.open_flags)
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_PASSTHROUGH = 1 << 7  # combines only with DIRECT_IO (which overrides it) and NOFLUSH

# setattr valid bits
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE, FATTR_ATIME, FATTR_MTIME, FATTR_FH = (1 << i for i in range(7))
FATTR_ATIME_NOW, FATTR_MTIME_NOW, FATTR_CTIME, FATTR_KILL_SUIDGID = 1 << 7, 1 << 8, 1 << 10, 1 << 11
# With HANDLE_KILLPRIV_V2 the kernel asks the filesystem to drop set-id bits: a write's, a truncate's
# (by a caller without CAP_FSETID), a chown's (FATTR_KILL_SUIDGID), an O_TRUNC open's.
WRITE_KILL_SUIDGID = 1 << 2  # fuse_write_in.write_flags
OPEN_KILL_SUIDGID = 1 << 0  # fuse_open_in.open_flags, fuse_create_in.open_flags
FSYNC_FDATASYNC = 1
XATTR_CREATE, XATTR_REPLACE = 1, 2

# /dev/fuse ioctls
DEV_IOC_CLONE = 0x8004E500
DEV_IOC_BACKING_OPEN = 0x4010E501  # struct fuse_backing_map in, the backing id as the return value
DEV_IOC_BACKING_CLOSE = 0x4004E502  # u32 backing id
MAX_STACK_DEPTH = 2  # a backing file may live on one stacked file system (overlayfs), not on another FUSE

# -- layouts ------------------------------------------------------------------------------------
IN_HEADER = Struct("=IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT_HEADER = Struct("=IiQ")  # len, error, unique
_ATTR = "QQQqqqIIIIIIIIII"  # ino size blocks atime mtime ctime (a|m|c)timensec mode nlink uid gid rdev blksize flags
ENTRY_OUT = Struct("=QQQQII" + _ATTR)  # nodeid generation entry_valid attr_valid (entry|attr)_valid_nsec attr
ATTR_OUT = Struct("=QII" + _ATTR)  # attr_valid attr_valid_nsec dummy attr
OPEN_OUT = Struct("=QIi")  # fh open_flags backing_id
WRITE_OUT = Struct("=II")  # size padding
XATTR_SIZE_OUT = Struct("=II")  # size padding (getxattr/listxattr with size 0)
STATFS_OUT = Struct("=QQQQQIIII24x")  # blocks bfree bavail files ffree bsize namelen frsize padding spare
INIT_IN = Struct("=IIII")  # major minor max_readahead flags (then flags2 with INIT_EXT)
FLAGS2 = Struct("=I")
INIT_OUT = Struct("=IIIIHHIIHHIIH22x")  # ... max_pages map_alignment flags2 max_stack_depth request_timeout
DIRENT = Struct("=QQII")  # ino off namelen type, then the name, padded to 8
GETATTR_IN = Struct("=IIQ")  # getattr_flags dummy fh
SETATTR_IN = Struct("=IIQQQqqqIIIIIIII")  # valid pad fh size lock_owner a/m/ctime a/m/ctimensec mode - uid gid -
OPEN_IN = Struct("=II")  # flags open_flags (OPENDIR too)
CREATE_IN = Struct("=IIII")  # flags mode umask open_flags
MKNOD_IN = Struct("=IIII")  # mode rdev umask padding
MKDIR_IN = Struct("=II")  # mode umask
RENAME_IN = Struct("=Q")  # newdir
RENAME2_IN = Struct("=QII")  # newdir flags padding
LINK_IN = Struct("=Q")  # oldnodeid
READ_IN = Struct("=QQI")  # fh offset size (then read_flags lock_owner flags padding: 40 bytes)
WRITE_IN = Struct("=QQII8xII")  # fh offset size write_flags lock_owner flags padding
WRITE_IN_SIZE = WRITE_IN.size
RELEASE_IN = Struct("=QII")  # fh flags release_flags (then lock_owner)
FH_IN = Struct("=Q")  # the fh that FLUSH, FSYNC, RELEASE... begin with
FSYNC_IN = Struct("=QI")  # fh fsync_flags
SETXATTR_IN = Struct("=II")  # size flags (the 8-byte form: SETXATTR_EXT is not negotiated)
GETXATTR_IN = Struct("=I")  # size (LISTXATTR too)
ACCESS_IN = Struct("=I")  # mask
FORGET_IN = Struct("=Q")  # nlookup
BATCH_FORGET_IN = Struct("=I")  # count (then dummy, then count fuse_forget_one)
FORGET_ONE = Struct("=QQ")  # nodeid nlookup
NOTIFY_INVAL_ENTRY_OUT = Struct("=QII")  # parent namelen flags
NOTIFY_INVAL_INODE_OUT = Struct("=Qqq")  # ino off len
BACKING_MAP = Struct("=iIQ")  # fd flags padding

HEADER_SIZE = IN_HEADER.size
BUFFER_HEADROOM = 4096  # room for a request's headers beside the largest write (as libfuse)


class Attributes(Protocol):
    """What is encoded of an inode (``api.EntryAttributes``)."""

    st_ino: int
    generation: int
    entry_timeout: float
    attr_timeout: float
    st_mode: int
    st_nlink: int
    st_uid: int
    st_gid: int
    st_rdev: int
    st_size: int
    st_blksize: int
    st_blocks: int
    st_atime_ns: int
    st_mtime_ns: int
    st_ctime_ns: int


class Statvfs(Protocol):
    f_bsize: int
    f_frsize: int
    f_blocks: int
    f_bfree: int
    f_bavail: int
    f_files: int
    f_ffree: int
    f_namemax: int


# -- encoding -----------------------------------------------------------------------------------


def timeout(seconds: float) -> tuple[int, int]:
    """A cache timeout as (seconds, nanoseconds); negative is none."""
    if seconds <= 0:
        return 0, 0
    whole = int(seconds)
    return whole, min(int((seconds - whole) * 1e9), 999_999_999)


def _attr(a: Attributes) -> tuple[int, ...]:
    asec, ansec = divmod(a.st_atime_ns, 1_000_000_000)
    msec, mnsec = divmod(a.st_mtime_ns, 1_000_000_000)
    csec, cnsec = divmod(a.st_ctime_ns, 1_000_000_000)
    return (a.st_ino, a.st_size, a.st_blocks, asec, msec, csec, ansec, mnsec, cnsec, a.st_mode, a.st_nlink,
            a.st_uid, a.st_gid, a.st_rdev & 0xFFFFFFFF, a.st_blksize, 0)  # fmt: skip


def entry_out(a: Attributes) -> bytes:
    """``fuse_entry_out``: the inode, its generation, the name's and attributes' timeouts, the attributes."""
    es, ens = timeout(a.entry_timeout)
    ats, atns = timeout(a.attr_timeout)
    return ENTRY_OUT.pack(a.st_ino, a.generation, es, ats, ens, atns, *_attr(a))


def attr_out(a: Attributes) -> bytes:
    ats, atns = timeout(a.attr_timeout)
    return ATTR_OUT.pack(ats, atns, 0, *_attr(a))


def open_out(fh: int, open_flags: int, backing_id: int = 0) -> bytes:
    return OPEN_OUT.pack(fh, open_flags, backing_id)


def statfs_out(s: Statvfs) -> bytes:
    return STATFS_OUT.pack(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree, s.f_bsize, s.f_namemax,
                           s.f_frsize, 0)  # fmt: skip


def direntplus(name: bytes, a: Attributes, next_offset: int) -> bytes:
    """One ``fuse_direntplus``: the entry (as a lookup answers it), then the dirent, padded to 8."""
    head = entry_out(a) + DIRENT.pack(a.st_ino, next_offset, len(name), stat.S_IFMT(a.st_mode) >> 12)
    return head + name + bytes(-len(name) % 8)


def reply_header(payload: int, unique: int, error: int = 0) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size + payload, -error, unique)


def error_reply(unique: int, errno_: int) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size, -errno_, unique)


def notify_inval_entry(parent: int, name: bytes) -> bytes:
    body = NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0) + name + b"\0"
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_ENTRY, 0) + body


def notify_inval_inode(ino: int, offset: int, length: int) -> bytes:
    body = NOTIFY_INVAL_INODE_OUT.pack(ino, offset, length)
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_INODE, 0) + body


# -- decoding -----------------------------------------------------------------------------------


def cstrings(body: memoryview | bytes, count: int) -> list[bytes]:
    """The first ``count`` NUL-terminated strings of ``body``; ValueError if one is unterminated."""
    data = bytes(body)
    out, start = [], 0
    for _ in range(count):
        end = data.index(b"\0", start)
        out.append(data[start:end])
        start = end + 1
    return out


def forgets(body: memoryview | bytes) -> list[tuple[int, int]]:
    """BATCH_FORGET's (inode, nlookup) pairs."""
    (count,) = BATCH_FORGET_IN.unpack_from(body)
    count = min(count, (len(body) - 8) // FORGET_ONE.size)
    return [FORGET_ONE.unpack_from(body, 8 + i * FORGET_ONE.size) for i in range(count)]


# -- INIT ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InitOffer:
    """What the kernel's INIT says: its protocol version, read-ahead and the flags it supports."""

    major: int
    minor: int
    max_readahead: int
    flags: int  # flags | flags2 << 32 (flags2 only with INIT_EXT)


def parse_init(body: memoryview | bytes) -> InitOffer:
    major, minor, max_readahead, flags = INIT_IN.unpack_from(body)
    if flags & INIT_EXT and len(body) >= INIT_IN.size + FLAGS2.size:
        flags |= FLAGS2.unpack_from(body, INIT_IN.size)[0] << 32
    return InitOffer(major, minor, max_readahead, flags)


@dataclass(frozen=True)
class Negotiated:
    """Our INIT answer and what it means for the session."""

    minor: int
    flags: int
    max_write: int
    max_pages: int
    passthrough: bool
    why: str  # the mode and why: logged at mount, shown by `kv-chunk-fs stats`
    reply: bytes  # fuse_init_out


def negotiate(
    offer: InitOffer,
    *,
    page_size: int,
    max_write: int = 1 << 20,
    writeback_cache: bool = False,
    export_support: bool = True,
    no_passthrough: str | None = None,
) -> Negotiated:
    """Answer the kernel's INIT. The flags are those libfuse 3.14 sent for pyfuse3 (so the kernel
    behaves as it did under pyfuse3): asynchronous and big reads and writes, atomic O_TRUNC,
    lookups of "." and "..", page-cache invalidation on a changed mtime or size, READDIRPLUS
    always, asynchronous direct I/O, 1 MiB requests, and the writeback cache if asked for. One
    more, ``HANDLE_KILLPRIV_V2``: the filesystem drops set-id bits where the kernel tells it to
    (the session does), so the kernel stops asking for ``security.capability`` before every
    write. Passthrough is added where the kernel offers it, unless ``no_passthrough`` says why not.

    ValueError if the kernel's protocol is not one we speak."""
    if offer.major != KERNEL_MAJOR or offer.minor < OLDEST_MINOR:
        raise ValueError(f"kernel FUSE protocol {offer.major}.{offer.minor}; need {KERNEL_MAJOR}.{OLDEST_MINOR}+")
    want = ASYNC_READ | ATOMIC_O_TRUNC | BIG_WRITES | AUTO_INVAL_DATA | DO_READDIRPLUS | ASYNC_DIO | MAX_PAGES
    want |= HANDLE_KILLPRIV_V2
    if export_support:
        want |= EXPORT_SUPPORT
    if writeback_cache:
        want |= WRITEBACK_CACHE
    flags = (want & offer.flags) | BIG_WRITES  # libfuse always sets it (max_write supersedes it)
    if offer.flags & MAX_PAGES:
        max_pages = min(256, (max_write + page_size - 1) // page_size)
        max_write = min(max_write, max_pages * page_size)
    else:
        max_pages, max_write = 0, min(max_write, 32 * page_size)  # the kernel's old limit per request
    passthrough, why = _passthrough(offer, flags, no_passthrough)
    if offer.flags & INIT_EXT:
        flags |= INIT_EXT
    if passthrough:
        flags |= PASSTHROUGH
    minor = min(offer.minor, KERNEL_MINOR)
    reply = INIT_OUT.pack(KERNEL_MAJOR, minor, offer.max_readahead, flags & 0xFFFFFFFF, 0, 0, max_write, 1,
                          max_pages, 0, flags >> 32, MAX_STACK_DEPTH if passthrough else 0, 0)  # fmt: skip
    return Negotiated(minor, flags, max_write, max_pages, passthrough, why, reply)


def _passthrough(offer: InitOffer, flags: int, no_passthrough: str | None) -> tuple[bool, str]:
    if no_passthrough is not None:
        return False, no_passthrough
    if flags & WRITEBACK_CACHE:
        return False, "the writeback cache is on (the kernel passes through only without it)"
    if not offer.flags & INIT_EXT or not offer.flags & PASSTHROUGH:
        return False, f"the kernel (FUSE {offer.major}.{offer.minor}) does not offer passthrough (Linux 6.9+)"
    return True, f"the kernel (FUSE {offer.major}.{offer.minor}) offers passthrough"
