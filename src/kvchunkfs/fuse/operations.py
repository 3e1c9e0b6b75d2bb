"""FUSE operations: POSIX semantics of the snapshots directory on top of ``Repository``.

The file system answers the session's requests against the repository, the open files and the
save service: the inode and handle tables are the bridge's (fuse/bridge.py), the shared contents
of open files and their linger the open-file cache's (fuse/openfiles.py), a save's life from the
writer's close the save service's (file/saves.py, one call per close), restores fuse/restores.py's.

Everything runs on the single trio thread; work that blocks (chunking, reading chunks, staging
copies, pinning, writing stubs) goes to worker threads, and the trio thread never waits on a lock
that another thread holds across I/O (docs/design.md, "Concurrency"). A handle's reads and writes
are one call into its ``FileHandle`` (file/handle.py), which makes those hops; names and metadata
change through ``Repository``, which tells the catalog. A per-node trio lock keeps writes,
truncates and commits of one file in arrival order. Creates, unlinks and file renames run in
threads (the file system's journal may hold them), each node's path gated meanwhile (fuse/gate.py).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import math
import os
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any, TypeVar, cast

import trio

from kvchunkfs.file.content import FileContent
from kvchunkfs.file.counters import read_path_counters
from kvchunkfs.file.files import Files
from kvchunkfs.file.handle import FileHandle, truncate
from kvchunkfs.file.refresh import from_remote, refresh_from_remote
from kvchunkfs.file.room import Room
from kvchunkfs.file.saves import SavedFile, SaveRefused, SaveService
from kvchunkfs.file.saves import errno_of as _errno_of
from kvchunkfs.format.index import IndexFormatError
from kvchunkfs.fuse import api as fuse
from kvchunkfs.fuse import openers
from kvchunkfs.fuse.admission import admit
from kvchunkfs.fuse.bridge import Bridge, Handle, Node
from kvchunkfs.fuse.guard import guard_handlers
from kvchunkfs.fuse.guard import level as _level
from kvchunkfs.fuse.openfiles import OnPath, OpenFiles
from kvchunkfs.fuse.restores import Restores
from kvchunkfs.fuse.retries import StaleRetries
from kvchunkfs.store.packs import ChunkCorrupt, ChunkMissing

log = logging.getLogger(__name__)

T = TypeVar("T")
ATTR_TIMEOUT = 1.0
STATS_XATTR = "user.kvcfs.stats"  # read-only, on the root directory, for the daemon's user


@guard_handlers
class Operations(fuse.Operations):
    def __init__(self, files: Files) -> None:
        super().__init__()
        self.files = files
        self.repo = repo = files.repo
        self.enable_passthrough = repo.settings.fuse_passthrough
        self.bridge = Bridge()  # the inode and handle tables (fuse/bridge.py)
        self.nodes, self.by_path, self.handles = self.bridge.nodes, self.bridge.by_path, self.bridge.handles
        self.retries = StaleRetries()  # opens answered ESTALE, which the kernel retries (fuse/retries.py)
        self.save_service = SaveService(files, self)  # a save's life from the writer's close (file/saves.py)
        self.restores = Restores(repo)  # restore accounting (fuse/restores.py)
        self.opened = OpenFiles(files, self.bridge, self.restores, self.retries, self._commit)  # fuse/openfiles.py
        self.warm_up_stats: Callable[[], dict[str, int]] = dict  # the mount's warm-up (file/warmup.py)
        self.write_requests = 0
        self.write_bytes = 0
        self.memory_trims = 0
        self.idle_checks = 0  # idle spells after which the heap was trimmed if RSS was high (daemon.py)
        self.mountpoint: str | None = None  # set by the daemon: which FLUSH is the writer's own close
        self._device: str | None = None  # the mount's major:minor, looked up at the first such FLUSH
        # A graceful stop (fuse/stop.py) refuses new writes and waits for these to end.
        self.stopping = False
        # Writes under way: handles open for writing until their release has saved, and truncates by
        # path (no handle) until theirs has.
        self.writing = 0
        self.last_write_end = -math.inf  # trio time the last of them ended
        self.write_activity = trio.Event()  # set (and replaced) whenever one ends

    @property
    def room(self) -> Room | None:
        """Room for saves, checked at their open (file/room.py): the save service's."""
        return self.save_service.room

    @property
    def _next_fh(self) -> int:
        return self.bridge.next_fh

    @_next_fh.setter
    def _next_fh(self, fh: int) -> None:
        self.bridge.next_fh = fh

    # -- what the save service asks of the mount (file/saves.py ``Mount``) ------------------

    def file_at(self, rel: str) -> SavedFile:
        return self.bridge.remember(rel, False)

    def let_go(self, file: SavedFile) -> None:
        self.bridge.maybe_drop(cast(Node, file))  # the files it is given are ours

    async def forget_unsaved(self, file: SavedFile) -> None:
        await self._forget_unsaved(cast(Node, file))

    def passthrough(self) -> bool | None:
        return None if self.session is None else self.session.passthrough

    # -- a graceful stop (fuse/stop.py) -----------------------------------------------------

    def writes_in_flight(self) -> int:
        return self.writing

    def open_for_writing(self) -> list[str]:
        return sorted({h.node.path or "(unlinked)" for h in self.handles.values() if h.writer})

    def _write_ended(self) -> None:
        self.last_write_end = trio.current_time()
        self.write_activity.set()
        self.write_activity = trio.Event()

    def _refuse_writes_if_stopping(self, what: str) -> None:
        """While stopping, no new write starts: the stop waits only for those under way."""
        if self.stopping:
            log.info("stopping: %s refused (read-only until the next mount)", what)
            raise fuse.FUSEError(errno.EROFS)

    async def _start_write(self, what: str, flags: int, call: Callable[..., Awaitable[T]], *args: Any) -> T:
        """An open or create that may write: refused while stopping; a writer is counted from the
        request on (its release uncounts it), so a stop that begins meanwhile waits for it too."""
        self._refuse_writes_if_stopping(what)
        if self.room is not None:  # before any byte: refused, or held until there is room
            await admit(self.room, what, self._writing_sizes, lambda: self.stopping)
            self._refuse_writes_if_stopping(what)
        writer = flags & os.O_ACCMODE != os.O_RDONLY
        self.writing += writer
        try:
            return await call(*args)
        except BaseException:
            if writer:  # no handle: the kernel sends no release
                self.writing -= 1
                self._write_ended()
            raise

    def _writing_sizes(self) -> list[int]:
        """The sizes of the files open for writing (each once)."""
        contents = {h.node.content for h in self.handles.values() if h.writer and h.node.content is not None}
        return [c.size for c in contents if c is not None]

    async def _thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args)

    def _stat_node(self, node: Node) -> os.stat_result:
        if node.path is None:
            if node.last_stat is None:
                raise fuse.FUSEError(errno.ENOENT)
            return node.last_stat
        try:
            st = self.repo.lstat(node.path)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        node.last_stat = st
        return st

    def _attrs(self, node: Node) -> fuse.EntryAttributes:
        st = self._stat_node(node)
        a = fuse.EntryAttributes()
        a.st_ino = node.ino
        a.generation = 0
        a.entry_timeout = ATTR_TIMEOUT
        a.attr_timeout = ATTR_TIMEOUT
        a.st_mode = st.st_mode
        a.st_nlink = st.st_nlink if stat.S_ISDIR(st.st_mode) else 1
        a.st_uid = st.st_uid
        a.st_gid = st.st_gid
        a.st_rdev = 0
        if stat.S_ISREG(st.st_mode):
            if node.content is not None:
                size = node.content.size
            else:
                known = self.repo.stub_size(node.path) if node.path is not None else None
                size = known if known is not None else 0
                if known is None:
                    log.warning("snapshot %s has no valid size attribute", node.path)
        else:
            size = st.st_size
        a.st_size = size
        a.st_blksize = 1 << 20
        a.st_blocks = (size + 511) // 512
        a.st_atime_ns = st.st_atime_ns
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        return a

    # -- lookup and attributes --------------------------------------------------------------

    async def lookup(self, parent_inode: int, name: bytes, ctx: fuse.RequestContext) -> fuse.EntryAttributes:
        if name == b".":
            return self._attrs(self.bridge.node(parent_inode))
        if name == b"..":
            node = self.bridge.node(parent_inode)
            parent = (node.path or "").rpartition("/")[0]
            return self._attrs(self.by_path.get(parent) or self.by_path[""])
        rel = self.bridge.child(parent_inode, name)
        known = self.by_path.get(rel)
        if known is not None:  # a revalidation may come in while the name's rename runs
            await known.gate.settled()
        await refresh_from_remote(self.repo, rel, self.bridge.in_use, lambda rel: self.by_path.pop(rel, None))
        try:
            st = self.repo.lstat(rel)
        except FileNotFoundError:
            if not await from_remote(self.repo.remote, "lookup", rel):
                raise fuse.FUSEError(errno.ENOENT) from None
            try:
                st = self.repo.lstat(rel)
            except OSError as e:  # gone again meanwhile
                raise fuse.FUSEError(e.errno or errno.EIO) from None
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        node = self.bridge.remember(rel, stat.S_ISDIR(st.st_mode))
        attrs = self._attrs(node)
        node.nlookup += 1
        return attrs

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        self.bridge.forget(inode_list)

    async def getattr(self, inode: int, ctx: fuse.RequestContext | None = None) -> fuse.EntryAttributes:
        node = self.bridge.node(inode)
        await node.gate.settled()
        return self._attrs(node)

    async def setattr(
        self,
        inode: int,
        attr: fuse.EntryAttributes,
        fields: fuse.SetattrFields,
        fh: int | None,
        ctx: fuse.RequestContext,
    ) -> fuse.EntryAttributes:
        node = self.bridge.node(inode)
        if fields.update_size:
            self._refuse_writes_if_stopping(f"truncate of {node.path}")
            await self._truncate(node, attr.st_size)
        await node.gate.settled()
        rel = node.path
        try:
            if rel is not None and fields.update_mode:
                self.repo.set_mode(rel, stat.S_IMODE(attr.st_mode))
            if rel is not None and (fields.update_uid or fields.update_gid):
                self.repo.set_owner(
                    rel,
                    attr.st_uid if fields.update_uid else -1,
                    attr.st_gid if fields.update_gid else -1,
                )
            if rel is not None and (fields.update_atime or fields.update_mtime):
                times = (
                    attr.st_atime_ns if fields.update_atime else None,
                    attr.st_mtime_ns if fields.update_mtime else None,
                )
                self.repo.set_times(rel, *times)
                if node.content is not None and node.content.dirty:  # cp -a, tar -x: kept by the save
                    node.set_times = (*times, node.content.gen, node.content.whole_mtime())
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        return self._attrs(node)

    async def _truncate(self, node: Node, size: int) -> None:
        if node.is_dir:
            raise fuse.FUSEError(errno.EISDIR)
        if size > self.repo.settings.max_file_size:  # before the file is opened (or put back) at all
            log.debug("truncate of %s to %d refused: max_file_size is %d", node.path, size,
                      self.repo.settings.max_file_size)  # fmt: skip
            raise fuse.FUSEError(errno.EFBIG)
        # As an open, truncate, close: it shares the content of the handles open, and counts as
        # one more open meanwhile, so their last release cannot close it under the truncate.
        self.writing += 1
        try:
            content = await self._acquire(node, allow_broken=size == 0)
            try:
                async with node.lock:
                    await self._apply_truncate(content, size)
            finally:
                await self._drop_open(node)
        finally:
            self.writing -= 1
            self._write_ended()

    async def _apply_truncate(self, content: FileContent, size: int) -> None:
        try:
            await truncate(content, size)
        except (ChunkMissing, ChunkCorrupt, OSError) as e:  # a damaged snapshot: EIO for this file only
            log.log(_level(e), "truncate failed: %s", e)
            raise fuse.FUSEError(_errno_of(e)) from None

    # -- directories ------------------------------------------------------------------------

    async def opendir(self, inode: int, ctx: fuse.RequestContext) -> int:
        node = self.bridge.node(inode)
        if not node.is_dir:
            raise fuse.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: fuse.ReaddirToken) -> None:
        node = self.bridge.node(fh)
        if node.path is None:
            return
        if start_id == 0:  # once per listing: the bucket's entries this directory lacks
            await from_remote(self.repo.remote, "fill_dir", node.path)
        try:
            names = self.repo.list_dir(node.path)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        for i, name in enumerate(names[start_id:], start_id):
            rel = f"{node.path}/{name}" if node.path else name
            try:
                st = self.repo.lstat(rel)
            except FileNotFoundError:
                continue
            child = self.bridge.remember(rel, stat.S_ISDIR(st.st_mode))
            try:
                attrs = self._attrs(child)
            except fuse.FUSEError:
                self.bridge.maybe_drop(child)
                continue
            if not fuse.readdir_reply(token, os.fsencode(name), attrs, i + 1):
                self.bridge.maybe_drop(child)
                return
            child.nlookup += 1

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: fuse.RequestContext) -> fuse.EntryAttributes:
        rel = self.bridge.child(parent_inode, name)
        try:
            self.repo.mkdir(rel, stat.S_IMODE(mode), ctx.uid, ctx.gid)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        await self._sync_dirs(rel)
        node = self.bridge.remember(rel, True)
        attrs = self._attrs(node)
        node.nlookup += 1
        return attrs

    async def rmdir(self, parent_inode: int, name: bytes, ctx: fuse.RequestContext) -> None:
        rel = self.bridge.child(parent_inode, name)
        try:
            self.repo.rmdir(rel)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        node = self.by_path.get(rel)
        if node is not None:
            self.bridge.detach(node)
        await self._sync_dirs(rel)

    async def unlink(self, parent_inode: int, name: bytes, ctx: fuse.RequestContext) -> None:
        rel = self.bridge.child(parent_inode, name)
        node = self.by_path.get(rel)
        async with AsyncExitStack() as stack:
            if node is not None:
                await stack.enter_async_context(node.gate.change())
                if node.content is not None:
                    node.last_stat = self._stat_node(node)
            try:
                await self._thread(self.repo.unlink, rel)  # a journal wait must not stall the loop
            except OSError as e:
                raise fuse.FUSEError(e.errno or errno.EIO) from None
            if node is not None:
                self.bridge.detach(node)
                await self.opened.drop_lingering(node)
        await self._sync_dirs(rel)

    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: fuse.RequestContext,
    ) -> None:
        old, new = self.bridge.child(parent_inode_old, name_old), self.bridge.child(parent_inode_new, name_new)
        if flags & ~fuse.RENAME_NOREPLACE:  # RENAME_EXCHANGE, RENAME_WHITEOUT (overlayfs's): not ours
            raise fuse.FUSEError(errno.EINVAL)
        if old == new:  # POSIX: the same file, nothing to do (the kernel does not ask; be safe)
            if not self.repo.exists(old):
                raise fuse.FUSEError(errno.ENOENT)
            if flags & fuse.RENAME_NOREPLACE:
                raise fuse.FUSEError(errno.EEXIST)  # as Linux answers renameat2 there
            return
        await self.retries.let_in(new)  # opens of ``new`` a rename made stale are being retried
        source, target = self.by_path.get(old), self.by_path.get(new)
        moved = [n for n in (source, target) if n is not None]
        # A file's rename runs in a thread (it may wait in the file system's journal), its nodes'
        # paths gated meanwhile; a directory's stays on this thread: every node under it moves.
        in_thread = source is not None and not any(n.is_dir for n in moved)
        async with AsyncExitStack() as stack:
            if in_thread:
                for n in sorted(moved, key=lambda n: n.ino):
                    await stack.enter_async_context(n.gate.change())
            try:
                if flags & fuse.RENAME_NOREPLACE and self.repo.exists(new):
                    raise fuse.FUSEError(errno.EEXIST)
                if target is not None and target.content is not None:
                    target.last_stat = self._stat_node(target)
                if in_thread:
                    await self._thread(self.repo.rename, old, new)
                else:
                    self.repo.rename(old, new)
            except OSError as e:
                raise fuse.FUSEError(e.errno or errno.EIO) from None
            if target is not None:
                self.bridge.detach(target)
            self.bridge.move(old, new)
        if target is not None:
            await self.opened.drop_lingering(target)
        await self._sync_dirs(old, new)

    async def _sync_dirs(self, *rels: str) -> None:
        """durability=fsync: a namespace change survives a power cut once its call returns."""
        if self.repo.durable:
            try:
                await self._thread(self.repo.sync_dirs, *rels)
            except OSError as e:
                raise fuse.FUSEError(e.errno or errno.EIO) from None

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        node = self.bridge.node(fh)
        if node.path is None:
            return
        try:
            await self._thread(self.repo.sync_entries, node.path)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: fuse.RequestContext
    ) -> fuse.EntryAttributes:
        raise fuse.FUSEError(errno.EPERM)  # hard links would share one stub between names

    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: fuse.RequestContext
    ) -> fuse.EntryAttributes:
        raise fuse.FUSEError(errno.EPERM)  # a snapshot is a file; the store follows no symlink

    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: fuse.RequestContext
    ) -> fuse.EntryAttributes:
        """A regular file: an empty snapshot, as create and close make. FIFOs, sockets, devices: EPERM."""
        if stat.S_IFMT(mode) not in (0, stat.S_IFREG):
            raise fuse.FUSEError(errno.EPERM)
        rel = self.bridge.child(parent_inode, name)
        try:  # in a thread, as create
            await self._thread(self.repo.create, rel, stat.S_IMODE(mode), ctx.uid, ctx.gid)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        node = self.bridge.remember(rel, False)
        attrs = self._attrs(node)
        node.nlookup += 1
        return attrs

    async def statfs(self, ctx: fuse.RequestContext) -> fuse.StatvfsData:
        sv = os.statvfs(self.repo.snapshots)
        out = fuse.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail"):
            setattr(out, name, getattr(sv, name))
        out.f_namemax = sv.f_namemax
        return out

    # -- files: open, create, release -------------------------------------------------------

    async def _acquire(
        self, node: Node, allow_broken: bool = False, then: OnPath | None = None, made: FileContent | None = None
    ) -> FileContent:
        """The node's shared content; counts one open (fuse/openfiles.py ``OpenFiles.acquire``)."""
        return await self.opened.acquire(node, allow_broken, then, made)

    async def _drop_open(self, node: Node, commit: bool = True) -> None:
        """One open fewer; the last one saves the content (fuse/openfiles.py ``OpenFiles.drop_open``)."""
        await self.opened.drop_open(node, commit)

    async def _new_handle(
        self, node: Node, content: FileContent, flags: int, ctx: fuse.RequestContext, opener: int | None = None
    ) -> int:
        """A handle on ``content`` for an open already counted by ``_acquire`` (``opener``: its
        process, if known)."""
        writer = flags & os.O_ACCMODE != os.O_RDONLY
        # The process, not the thread: its descriptor table tells which FLUSH is its last close.
        if opener is None and writer and self.mountpoint:
            opener = await self._thread(openers.task_group, ctx.pid)
        if not writer:
            opener = None
        fh = self._next_fh
        self._next_fh += 1
        file = FileHandle(content, node.lock, lambda: node.path)
        self.handles[fh] = Handle(node, file, writer=writer, opener=opener)
        node.writers += writer
        return fh

    async def open(self, inode: int, flags: int, ctx: fuse.RequestContext) -> fuse.FileInfo:
        if flags & os.O_TRUNC or flags & os.O_ACCMODE != os.O_RDONLY:
            what = f"open of {self.bridge.node(inode).path} for writing"
            return await self._start_write(what, flags, self._open, inode, flags, ctx)
        return await self._open(inode, flags, ctx)

    async def _open(self, inode: int, flags: int, ctx: fuse.RequestContext) -> fuse.FileInfo:
        node = self.bridge.node(inode)
        if node.is_dir:
            raise fuse.FUSEError(errno.EISDIR)
        start = time.monotonic()
        truncating = bool(flags & os.O_TRUNC)
        noted = False

        def note_use(rel: str) -> None:  # in the thread of the load or the reopen's check
            nonlocal noted
            self.repo.note_use(rel)
            noted = True

        reading = flags & os.O_ACCMODE == os.O_RDONLY and node.writers == 0
        joining = reading and node.restore is not None  # a restore under way: not another use
        held = node.content if node.content is not None else node.lingering
        remote = self.repo.remote
        partial = reading and remote is not None and node.path is not None and remote.is_partial(node.path)
        content = await self._acquire(node, allow_broken=truncating, then=note_use if reading and not joining else None)
        if truncating:  # before the handle exists: if it fails, the kernel never sends a release
            try:
                async with node.lock:
                    await self._apply_truncate(content, 0)
            except BaseException:
                await self._drop_open(node, commit=False)
                raise
        writer = flags & os.O_ACCMODE != os.O_RDONLY
        if writer:
            try:
                await self._own_file(node, content)
            except BaseException:
                await self._drop_open(node, commit=False)
                raise
        fh = await self._new_handle(node, content, flags, ctx)
        if flags & os.O_ACCMODE == os.O_RDONLY and node.path is not None and node.writers == 0:
            # A restore: a read-only open of a complete file (none being written through another handle).
            whence = content.source or ("remote" if partial else "local packs")
            source = "memory" if content is held else whence
            await self.restores.count(node, node.path, content, self.handles[fh], start, source, noted)
        else:
            self.restores.end(node)  # its content is taken for writing: that restore is over
        return fuse.FileInfo(fh=fh, keep_cache=True, backing_fd=self._backing(content))

    def writes_in_place(self, inode: int) -> bool:
        """An open for writing now would write the file the node's open files use: its content is
        a file of its own already (another writer's)."""
        node = self.nodes.get(inode)
        content = node.content if node is not None else None
        return content is not None and content.own_file()

    async def _own_file(self, node: Node, content: FileContent) -> None:
        """Before a handle that may write: the content is a whole file of its own, which the kernel
        may write directly (passthrough), so it counts as changed from now on."""
        if content.whole is None:
            return
        async with node.lock:
            if not content.own_file():
                await self._thread(content.to_staging)
            content.mark_changed()

    @staticmethod
    def _backing(content: FileContent) -> int | None:
        """A new fd of the whole file the content is, for the kernel to serve the open from
        (passthrough); None for a content that is not one (the session closes the fd)."""
        fd = content.whole_fd()
        return os.dup(fd) if fd >= 0 else None

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: fuse.RequestContext
    ) -> tuple[fuse.FileInfo, fuse.EntryAttributes]:
        what = f"create of {self.bridge.child(parent_inode, name)}"
        return await self._start_write(what, flags, self._create, parent_inode, name, mode, flags, ctx)

    async def _create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: fuse.RequestContext
    ) -> tuple[fuse.FileInfo, fuse.EntryAttributes]:
        rel = self.bridge.child(parent_inode, name)
        pid = ctx.pid if self.mountpoint else None
        try:  # one thread: a create may wait in the file system's journal (durable: and its fsyncs)
            made, opener = await self._thread(self._made, rel, stat.S_IMODE(mode), ctx.uid, ctx.gid, pid)
        except (IndexFormatError, ChunkMissing, ChunkCorrupt, OSError) as e:
            log.log(logging.WARNING if isinstance(e, OSError) else logging.ERROR, "create of %s failed: %s", rel, e)
            raise fuse.FUSEError(_errno_of(e)) from None
        node = self.bridge.remember(rel, False)
        content = await self._acquire(node, made=made)  # or joins an open that loaded it meanwhile
        try:
            await self._own_file(node, content)
        except BaseException:
            await self._drop_open(node, commit=False)
            raise
        fh = await self._new_handle(node, content, flags, ctx, opener)
        attrs = self._attrs(node)
        node.nlookup += 1
        return fuse.FileInfo(fh=fh, keep_cache=True, backing_fd=self._backing(content)), attrs

    def _made(self, rel: str, mode: int, uid: int, gid: int, pid: int | None) -> tuple[FileContent, int | None]:
        """A create's blocking part, one thread hop: the new stub, its content, the opener's process.
        The stub was just written empty: its content is a new empty one, as for an ``O_TRUNC`` open
        (nothing to read back)."""
        self.repo.create(rel, mode, uid, gid)
        content = self.files.replacement(rel)
        return content, openers.task_group(pid) if pid is not None else None

    async def flush(self, fh: int) -> None:
        handle = self.handles[fh]
        if not handle.writer:  # a reader's close must not save a half-written file, nor fail with its error
            return
        content = handle.node.content
        if content is None or not content.dirty:
            return
        # A dup() or a child's copy (close-on-exec, exit) closed while the writer still has the file
        # open: committing then would install a prefix. Its own close (or the last release) commits.
        await self._commit(handle.node, closing=True, unless=functools.partial(self._other_copy_closed, handle))

    def _other_copy_closed(self, handle: Handle) -> bool:
        """True if the handle's opener still holds the file open for writing, so this FLUSH came
        from another copy of its descriptor (blocking: reads /proc). False when in doubt: the opener
        is gone or its table cannot be read, and a commit keeps the crash contract."""
        if handle.opener is None or self.mountpoint is None:
            return False
        if self._device is None:
            self._device = openers.mount_device(self.mountpoint)
            if self._device is None:
                log.warning("mount %s not found in /proc/self/mountinfo: every flush commits", self.mountpoint)
                self.mountpoint = None
                return False
        try:
            return openers.holds_for_writing(handle.opener, handle.node.ino, self._device)
        except OSError as e:  # gone (its exit was this FLUSH), or not ours to read
            log.debug("descriptor table of %d: %s; flush commits", handle.opener, e)
            return False

    async def fsync(self, fh: int, datasync: bool) -> None:
        node = self.handles[fh].node
        await self._commit(node, durable=True)

    async def release(self, fh: int) -> None:
        handle = self.handles.pop(fh)
        node = handle.node
        node.writers -= handle.writer
        restore = handle.restore
        if restore is not None:
            restore.handles -= 1
            if not restore.handles:
                restore.closed = time.monotonic()
        try:
            await self._drop_open(node)
            if handle.writer and node.writers == 0 and node.deferred:
                await self.save_service.ingest_deferred(node)
        finally:
            if handle.writer:  # counted until its save is done: a stop waits for it
                self.writing -= 1
                self._write_ended()
        if restore is not None and node.content is not None:  # still open for something else: it ends here
            self.restores.end(node)

    async def _forget_unsaved(self, node: Node) -> None:
        """A save failed: the kernel still caches the unsaved pages and, with the writeback cache, owns
        the file size, so it would serve the previous version padded with zeros. Give the name a fresh
        inode instead (as a rename does): the next lookup sees the previous version, size included."""
        rel = node.path
        if rel is None:
            return
        if self.by_path.get(rel) is node:
            del self.by_path[rel]  # the old inode keeps working until the kernel drops it
        parent_rel, _, name = rel.rpartition("/")
        parent = self.by_path.get(parent_rel)
        if parent is not None:  # before the failing close() returns, so no new open finds the old inode
            await self._thread(self._invalidate_entry, parent.ino, os.fsencode(name))

    @property
    def open_files(self) -> int:
        """Contents loaded (open or lingering)."""
        return self.opened.open_files

    async def _commit(
        self, node: Node, durable: bool = False, closing: bool = False, unless: Callable[[], bool] | None = None
    ) -> None:
        """Save the node's content if it changed (file/saves.py ``SaveService.commit``)."""
        try:
            await self.save_service.commit(node, durable, closing, unless)
        except SaveRefused as e:  # logged; the previous version of the snapshot stays
            raise fuse.FUSEError(e.errno) from None

    def _invalidate_entry(self, parent_ino: int, name: bytes) -> None:
        try:
            self.invalidate_entry(parent_ino, name)
        except OSError as e:  # the kernel does not know the name: nothing to drop
            log.debug("invalidating %r: %s", name, e)

    # -- data -------------------------------------------------------------------------------

    # The session replies with any buffer: a memoryview spares a copy.
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        handle = self.handles[fh]
        try:
            return await handle.file.read(off, size)  # a restore's prefetched chunks: no thread hop
        except (ChunkMissing, ChunkCorrupt, OSError) as e:
            log.error("read of %s at %d failed: %s", handle.node.path, off, e)
            raise fuse.FUSEError(_errno_of(e)) from None

    def read_plain(self, fh: int, off: int, size: int) -> tuple[int, int] | None:
        handle = self.handles.get(fh)
        return handle.file.plain_range(off, size) if handle is not None else None

    async def write(self, fh: int, off: int, buf: memoryview) -> int:
        handle = self.handles[fh]
        node = handle.node
        self.write_requests += 1
        self.write_bytes += len(buf)
        try:
            await handle.file.write(off, buf)
        except (ChunkMissing, ChunkCorrupt, OSError) as e:
            log.log(_level(e), "write to %s at %d failed: %s", node.path, off, e)
            if self.room is not None and _errno_of(e) in (errno.ENOSPC, errno.EDQUOT):  # no room: its save
                self.room.note_failed_write(handle.file.content)  # is not committed (it lacks this write)
            raise fuse.FUSEError(_errno_of(e)) from None
        return len(buf)

    # -- extended attributes ----------------------------------------------------------------

    async def getxattr(self, inode: int, name: bytes, ctx: fuse.RequestContext) -> bytes:
        sname = os.fsdecode(name)
        if inode == fuse.ROOT_INODE and sname == STATS_XATTR:
            # Every user's saves and restores, and whether bytes were in the store already (a
            # dedup oracle): the daemon's own user only (docs/design.md, "Threat model").
            if ctx.uid != os.geteuid():
                log.debug("%s refused to uid %d (pid %d): the daemon's user only", STATS_XATTR, ctx.uid, ctx.pid)
                raise fuse.FUSEError(errno.EACCES)
            return json.dumps(self.stats()).encode()
        try:
            return self.repo.get_xattr(self.bridge.path_of(inode), sname)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: fuse.RequestContext) -> None:
        try:
            self.repo.set_xattr(self.bridge.path_of(inode), os.fsdecode(name), value)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    async def listxattr(self, inode: int, ctx: fuse.RequestContext) -> list[bytes]:
        try:
            return [os.fsencode(n) for n in self.repo.list_xattrs(self.bridge.path_of(inode))]
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    async def removexattr(self, inode: int, name: bytes, ctx: fuse.RequestContext) -> None:
        try:
            self.repo.remove_xattr(self.bridge.path_of(inode), os.fsdecode(name))
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    # -- introspection ----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Every part's own counters: the store's and the read path's, this file system's, the save
        service's (staged saves, the memory tier, room), the remote tier's."""
        remote = self.repo.remote
        return (
            read_path_counters(self.files)
            | self.counters()
            | self.save_service.stats()
            | self.warm_up_stats()
            | (remote.stats() if remote is not None else {})
        )

    def counters(self) -> dict[str, int]:
        """The file system's own: restores, write requests, open and lingering files, idle trims."""
        return {
            "restores": self.restores.restores,
            "write_requests": self.write_requests,
            "write_request_bytes": self.write_bytes,
            "open_files": self.opened.open_files,
            "lingering_files": len(self.opened.lingering),
            "reopens": self.opened.reopens,
            "memory_trims": self.memory_trims,
            "idle_checks": self.idle_checks,
            "fuse_passthrough": int(self.session is not None and self.session.passthrough),
        }

    def fuse_mode(self) -> dict[str, str]:
        """How the kernel's requests are served: "passthrough" (the kernel may serve an open file
        from its backing file) or "served" (every byte through the daemon), and why."""
        if self.session is None:
            return {"mode": "unmounted", "why": ""}
        return {"mode": "passthrough" if self.session.passthrough else "served", "why": self.session.why}
