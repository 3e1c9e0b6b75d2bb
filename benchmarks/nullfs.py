"""A do-nothing FUSE filesystem on kv-chunk-fs's front end: the floor of FUSE for the benchmark.

One flat directory. Writes are accepted and dropped (only the file size is kept); reads answer with
slices of one preallocated buffer. With ``--keep-data`` the bytes written are kept in memory and
read back (a copy per write: the floor for restores that must parse what they read, e.g.
llama-server's; saves are measured without it). Everything else about the mount is kv-chunk-fs's own: the mount
options, the process tuning, the trio loop with its task counts and signal handling, the bdi tuning
(read_ahead_kb, max_bytes), keep_cache on open, the attribute timeouts and st_blksize. So the time a
save or restore takes here is what the front end and the kernel cost before any store does work.

    python3 benchmarks/nullfs.py [--kernel-readahead-kb 4096] [--writeback-cache] [--keep-data] MOUNTPOINT
    python3 benchmarks/nullfs.py --backing DIR MOUNTPOINT   # DIR's files, pread from disk per request
    python3 benchmarks/nullfs.py --backing DIR --passthrough MOUNTPOINT  # DIR's files, by the kernel

``--backing`` is the floor of a restore from disk: each read request is one ``pread`` of the file
on the FUSE thread, nothing cached by the daemon. With ``--passthrough`` the opens name the file on
disk as their backing file and creates make one in DIR: the kernel reads and writes it itself, no
READ or WRITE reaches the daemon (where it runs passthrough: Linux 6.9+, root; the log says).

Serves until SIGINT/SIGTERM or ``fusermount3 -u MOUNTPOINT``; always unmounts.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import stat
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kvchunkfs.fuse import api as fuse  # noqa: E402
from kvchunkfs.fuse import daemon  # noqa: E402
from kvchunkfs.fuse.operations import ATTR_TIMEOUT  # noqa: E402
from kvchunkfs.fuse.protocol import Op  # noqa: E402
from kvchunkfs.fuse.session import Session  # noqa: E402

BLKSIZE = 1 << 20  # kv-chunk-fs's st_blksize: clients size their stdio buffers by it
STATS_XATTR = b"user.nullfs.stats"  # on the root: stats() as JSON


@dataclass(eq=False)
class File:
    ino: int
    mode: int
    uid: int
    gid: int
    size: int = 0
    mtime_ns: int = field(default_factory=time.time_ns)
    nlookup: int = 0
    opens: int = 0
    linked: bool = True
    dirty: bool = False
    data: bytearray | None = None  # --keep-data: the file's bytes
    backing: int | None = None  # --backing: an open descriptor of the file on disk
    path: Path | None = None  # --backing: the file on disk


class NullOperations(fuse.Operations):
    def __init__(
        self, writeback_cache: bool, keep_data: bool = False, backing: Path | None = None, passthrough: bool = False
    ) -> None:
        super().__init__()
        self.enable_writeback_cache = writeback_cache
        self.pass_files = passthrough  # opens name their file on disk (the mount negotiates it as kv-chunk-fs)
        self.keep_data = keep_data
        self.backing_dir = backing
        self.by_name: dict[bytes, File] = {}
        self.files: dict[int, File] = {}  # by inode; the file handle is the inode too
        self._next_ino = fuse.ROOT_INODE + 1
        self._buf = memoryview(b"")  # read replies are slices of this: no work per read
        self.served_reads = self.served_writes = 0  # READ and WRITE requests that reached the daemon
        self.front: Session | None = None  # the session serving it (its request counts, its mode)
        if backing is not None:
            self._add_backing(backing)

    def _add_backing(self, backing: Path) -> None:
        """Serve the regular files of ``backing`` (opened now, read with ``pread`` per request)."""
        for p in sorted(backing.iterdir()):
            st = p.stat()
            if not stat.S_ISREG(st.st_mode):
                continue
            f = File(self._next_ino, st.st_mode, st.st_uid, st.st_gid, size=st.st_size)
            f.backing = os.open(p, os.O_RDONLY)
            f.path = p
            self._next_ino += 1
            self.files[f.ino] = self.by_name[os.fsencode(p.name)] = f

    # -- helpers ----------------------------------------------------------------------------

    def _file(self, ino: int) -> File:
        f = self.files.get(ino)
        if f is None:
            raise fuse.FUSEError(errno.ENOENT)
        return f

    def _check_parent(self, ino: int) -> None:
        if ino != fuse.ROOT_INODE:
            raise fuse.FUSEError(errno.ENOTDIR)

    def _maybe_drop(self, f: File) -> None:
        if not f.linked and f.nlookup <= 0 and f.opens == 0:
            self.files.pop(f.ino, None)

    def _unlink_name(self, name: bytes) -> None:
        f = self.by_name.pop(name, None)
        if f is not None:
            f.linked = False
            self._maybe_drop(f)

    def _root_attrs(self) -> fuse.EntryAttributes:
        a = self._base_attrs(fuse.ROOT_INODE)
        a.st_mode = stat.S_IFDIR | 0o755
        a.st_nlink = 2
        return a

    def _attrs(self, ino: int) -> fuse.EntryAttributes:
        if ino == fuse.ROOT_INODE:
            return self._root_attrs()
        f = self._file(ino)
        if self.pass_files and f.path is not None:  # the kernel wrote it: the file on disk knows its size
            f.size = os.stat(f.path).st_size
        a = self._base_attrs(ino)
        a.st_mode, a.st_uid, a.st_gid = f.mode, f.uid, f.gid
        a.st_nlink = 1
        a.st_size = f.size
        a.st_blocks = (f.size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = f.mtime_ns
        return a

    def _base_attrs(self, ino: int) -> fuse.EntryAttributes:
        a = fuse.EntryAttributes()
        a.st_ino = ino
        a.entry_timeout = ATTR_TIMEOUT
        a.attr_timeout = ATTR_TIMEOUT
        a.st_blksize = BLKSIZE
        return a

    @staticmethod
    def _resize(f: File, size: int) -> None:
        assert f.data is not None
        if size < len(f.data):
            del f.data[size:]
        else:
            f.data.extend(bytes(size - len(f.data)))

    def _read_buffer(self, size: int) -> memoryview:
        if len(self._buf) < size:  # once per mount in practice: requests are at most max_read
            self._buf = memoryview(os.urandom(size))
        return self._buf

    # -- names ------------------------------------------------------------------------------

    async def lookup(self, parent_inode: int, name: bytes, ctx: fuse.RequestContext) -> fuse.EntryAttributes:
        self._check_parent(parent_inode)
        if name in (b".", b".."):
            return self._root_attrs()
        f = self.by_name.get(name)
        if f is None:
            raise fuse.FUSEError(errno.ENOENT)
        f.nlookup += 1
        return self._attrs(f.ino)

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            f = self.files.get(ino)
            if f is not None:
                f.nlookup -= n
                self._maybe_drop(f)

    async def getattr(self, inode: int, ctx: fuse.RequestContext | None = None) -> fuse.EntryAttributes:
        return self._attrs(inode)

    async def setattr(
        self,
        inode: int,
        attr: fuse.EntryAttributes,
        fields: fuse.SetattrFields,
        fh: int | None,
        ctx: fuse.RequestContext,
    ) -> fuse.EntryAttributes:
        if inode != fuse.ROOT_INODE:
            f = self._file(inode)
            if fields.update_size:
                f.size = attr.st_size
                if self.pass_files and f.path is not None:
                    os.truncate(f.path, attr.st_size)
                if f.data is not None:
                    self._resize(f, attr.st_size)
            if fields.update_mode:
                f.mode = stat.S_IFREG | stat.S_IMODE(attr.st_mode)
            if fields.update_mtime:
                f.mtime_ns = attr.st_mtime_ns
        return self._attrs(inode)

    async def opendir(self, inode: int, ctx: fuse.RequestContext) -> int:
        if inode != fuse.ROOT_INODE:
            raise fuse.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: fuse.ReaddirToken) -> None:
        names = sorted(self.by_name)
        for i, name in enumerate(names[start_id:], start_id):
            f = self.by_name[name]
            if not fuse.readdir_reply(token, name, self._attrs(f.ino), i + 1):
                return
            f.nlookup += 1

    async def unlink(self, parent_inode: int, name: bytes, ctx: fuse.RequestContext) -> None:
        self._check_parent(parent_inode)
        if name not in self.by_name:
            raise fuse.FUSEError(errno.ENOENT)
        self._unlink_name(name)

    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: fuse.RequestContext,
    ) -> None:
        self._check_parent(parent_inode_old)
        self._check_parent(parent_inode_new)
        if flags & fuse.RENAME_EXCHANGE:
            raise fuse.FUSEError(errno.EINVAL)
        f = self.by_name.get(name_old)
        if f is None:
            raise fuse.FUSEError(errno.ENOENT)
        if flags & fuse.RENAME_NOREPLACE and name_new in self.by_name:
            raise fuse.FUSEError(errno.EEXIST)
        if name_new == name_old:
            return
        self._unlink_name(name_new)
        del self.by_name[name_old]
        self.by_name[name_new] = f
        if self.pass_files and f.path is not None and self.backing_dir is not None:  # as a save's rename does
            new_path = self.backing_dir / os.fsdecode(name_new)
            os.rename(f.path, new_path)
            f.path = new_path

    async def getxattr(self, inode: int, name: bytes, ctx: fuse.RequestContext) -> bytes:
        if inode == fuse.ROOT_INODE and name == STATS_XATTR:
            return json.dumps(self.stats()).encode()
        # As kv-chunk-fs answers security.* (asked on writes): ENODATA, not ENOSYS, which would
        # make the kernel stop asking and so cost the floor less than the filesystem it bounds.
        raise fuse.FUSEError(errno.ENODATA)

    def stats(self) -> dict[str, object]:
        """The requests the kernel sent (by name), the reads and writes served, the mode and why."""
        front = self.front
        requests = {Op(i).name: n for i, n in enumerate(front.requests) if n and i in Op._value2member_map_}
        return {
            "mode": "passthrough" if front and front.passthrough else "served",
            "why": front.why if front else "",
            "requests": requests if front else {},
            "served_reads": self.served_reads,
            "served_writes": self.served_writes,
            "backing_refused": front.backing_refused if front else 0,
        }

    async def listxattr(self, inode: int, ctx: fuse.RequestContext) -> list[bytes]:
        return []

    async def statfs(self, ctx: fuse.RequestContext) -> fuse.StatvfsData:
        out = fuse.StatvfsData()
        out.f_bsize = out.f_frsize = 4096
        out.f_namemax = 255
        return out

    # -- files ------------------------------------------------------------------------------

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: fuse.RequestContext
    ) -> tuple[fuse.FileInfo, fuse.EntryAttributes]:
        self._check_parent(parent_inode)
        self._unlink_name(name)  # the kernel looked it up first; a racing create replaces it
        f = File(self._next_ino, stat.S_IFREG | stat.S_IMODE(mode), ctx.uid, ctx.gid)
        f.data = bytearray() if self.keep_data else None
        if self.pass_files and self.backing_dir is not None:  # a file on disk for the kernel to write
            f.path = self.backing_dir / os.fsdecode(name)
            f.backing = os.open(f.path, os.O_RDWR | os.O_CREAT, 0o600)
            if os.fstat(f.backing).st_size:  # (no O_TRUNC of an empty file: ext4 flushes such a file at close)
                os.ftruncate(f.backing, 0)
        self._next_ino += 1
        self.files[f.ino] = self.by_name[name] = f
        f.nlookup += 1
        f.opens += 1
        return self._file_info(f, flags & ~os.O_TRUNC), self._attrs(f.ino)

    async def open(self, inode: int, flags: int, ctx: fuse.RequestContext) -> fuse.FileInfo:
        f = self._file(inode)
        if flags & os.O_TRUNC:
            f.size = 0
            if f.data is not None:
                f.data.clear()
        f.opens += 1
        return self._file_info(f, flags)

    def _file_info(self, f: File, flags: int) -> fuse.FileInfo:
        """As kv-chunk-fs: warm reads stay in the kernel. With --passthrough, the file on disk
        serves the open (its own descriptor, opened as the caller asked)."""
        if not self.pass_files or f.path is None:
            return fuse.FileInfo(fh=f.ino, keep_cache=True)
        keep = flags & (os.O_ACCMODE | os.O_TRUNC)
        return fuse.FileInfo(fh=f.ino, backing_fd=os.open(f.path, keep | os.O_CLOEXEC))

    async def read(self, fh: int, off: int, size: int) -> memoryview:
        f = self._file(fh)
        self.served_reads += 1
        n = max(0, min(size, f.size - off))
        if f.backing is not None:  # on the FUSE thread, as simple as a pass-through can be
            return memoryview(os.pread(f.backing, n, off))
        if f.data is not None:
            return memoryview(f.data)[off : off + n]
        return self._read_buffer(n)[:n]

    async def write(self, fh: int, off: int, buf: memoryview) -> int:
        f = self._file(fh)
        self.served_writes += 1
        f.size = max(f.size, off + len(buf))
        f.dirty = True
        if f.backing is not None and self.pass_files:
            os.pwrite(f.backing, buf, off)  # served after all (the kernel refused the backing file)
        if f.data is not None:
            if len(f.data) < off:
                f.data.extend(bytes(off - len(f.data)))
            f.data[off : off + len(buf)] = buf
        return len(buf)

    async def flush(self, fh: int) -> None:
        f = self._file(fh)
        if f.dirty:  # only a writer's close: a new mtime makes the kernel drop the file's cached pages
            f.mtime_ns, f.dirty = time.time_ns(), False

    async def fsync(self, fh: int, datasync: bool) -> None:
        pass

    async def release(self, fh: int) -> None:
        f = self._file(fh)
        f.opens -= 1
        self._maybe_drop(f)


def mount_options() -> set[str]:
    """kv-chunk-fs's options under another name, so /proc/mounts tells the two apart."""
    same = {o for o in daemon.mount_options(os.geteuid() == 0) if not o.startswith(("fsname=", "subtype="))}
    return same | {"fsname=nullfs", "subtype=nullfs"}


async def _unmount_on_signal(session: Session, _ops: object) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            session.terminate()
            return


def serve(
    mountpoint: Path,
    readahead_kb: int,
    writeback_cache: bool,
    keep_data: bool = False,
    backing: Path | None = None,
    passthrough: bool = False,
) -> None:
    daemon.clear_stale_mount(mountpoint)
    daemon.tune_process()
    ops = NullOperations(writeback_cache, keep_data, backing, passthrough)
    session = ops.front = Session(ops, str(mountpoint), mount_options())
    session.start()
    try:
        # kv-chunk-fs's own loop (bdi tuning, task counts): only the handlers differ. A signal
        # unmounts at once: nothing here holds a save to wait for.
        trio.run(daemon._main, session, mountpoint, readahead_kb, [partial(_unmount_on_signal, session)])
    finally:
        session.close(unmount=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mountpoint")
    p.add_argument("--kernel-readahead-kb", type=int, default=4096, help="the mount's bdi read_ahead_kb")
    p.add_argument("--writeback-cache", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--keep-data", action="store_true", help="keep written bytes in memory and read them back")
    p.add_argument("--backing", type=Path, help="also serve this directory's files, read from disk per request")
    p.add_argument("--passthrough", action="store_true", help="with --backing: the kernel reads and writes them")
    args = p.parse_args()
    if args.passthrough and args.backing is None:
        p.error("--passthrough needs --backing DIR")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(Path(args.mountpoint).resolve(), args.kernel_readahead_kb, args.writeback_cache, args.keep_data,
          args.backing, args.passthrough)  # fmt: skip


if __name__ == "__main__":
    main()
