"""FUSE operations: inodes, handles and POSIX semantics on top of ``Repository``.

Inode numbers are ours, not the stubs': a save replaces a stub by rename, which gives it a new
host inode, while the file the kernel knows must keep its identity. ``Node`` maps an inode to its
path under ``snapshots/`` (``None`` once unlinked) and to the shared ``FileContent`` while open.
An unchanged content stays loaded for ``linger`` seconds (``reopen_linger``) after its last close:
llama-server opens a snapshot twice per restore (it reads the end and the header, closes, and opens
it again), and the second open takes the first one's content and its whole file, if
the stub still holds the bytes it was loaded from.

Everything runs on the single trio thread; work that blocks (chunking, reading chunks, staging
copies, pinning, writing stubs) goes to worker threads, and the trio thread never waits on a lock
that another thread holds across I/O (docs/design.md, "Concurrency"). A handle's reads and writes
are one call into its ``FileHandle`` (file/handle.py), which makes those hops; names and metadata
change through ``Repository``, which tells the catalog. A per-node trio lock keeps writes,
truncates and commits of one file in arrival order. The save protocol itself is
``Files.prepare_save`` (in a thread) and ``Files.finish_save`` (the stub's install, here, once no
rename of the file is in flight). Creates, unlinks and file renames run in threads (the file
system's journal may hold them), each node's path gated meanwhile (fuse/gate.py).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import json
import logging
import math
import os
import sqlite3
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import trio

from kvchunkfs.file.adopt import same_sum
from kvchunkfs.file.content import FileContent
from kvchunkfs.file.files import Files, PendingSave
from kvchunkfs.file.handle import FileHandle, truncate
from kvchunkfs.file.ingest import Ingester, Job, Outcome
from kvchunkfs.file.room import Room
from kvchunkfs.format.index import IndexFormatError
from kvchunkfs.fuse import api as fuse
from kvchunkfs.fuse import openers
from kvchunkfs.fuse.admission import admit
from kvchunkfs.fuse.gate import PathGate
from kvchunkfs.fuse.retries import StaleRetries
from kvchunkfs.store.packs import ChunkCorrupt, ChunkMissing
from kvchunkfs.store.remote import RemoteTier

log = logging.getLogger(__name__)

T = TypeVar("T")
OnPath = Callable[[str], None]  # run on a snapshot's path in a worker thread
ATTR_TIMEOUT = 1.0
BACKLOG_STEP = 0.05  # seconds between looks at ingestion's backlog while a close waits for it
STATS_XATTR = "user.kvcfs.stats"  # read-only, on the root directory, for the daemon's user


@dataclass(eq=False)
class Restore:
    """One restore of a snapshot: the read-only opens its content serves while it is open or
    lingering. llama-server opens a snapshot twice per restore; both are one restore, counted once
    (``restores``, the use count), timed from its first open to its last close, and reported when
    its content is closed or taken for something else (``Operations._end_restore``)."""

    name: str
    size: int
    source: str  # where its first open found the content: "local packs", "remote" or "memory"
    start: float  # monotonic time its first open arrived
    opens: int = 1
    handles: int = 0  # its handles still open
    closed: float | None = None  # when its last handle so far was released


@dataclass(eq=False)
class Node:
    ino: int
    path: str | None  # relative to snapshots/; "" is the root
    is_dir: bool
    nlookup: int = 0
    opens: int = 0
    content: FileContent | None = None
    lock: trio.Lock = field(default_factory=trio.Lock)
    gate: PathGate = field(default_factory=PathGate)  # its stub renamed in a thread (fuse/gate.py)
    loading: trio.Event | None = None  # set while an open loads the content: later opens wait for it
    lingering: FileContent | None = None  # closed but kept, pins and all, for a reopen (``linger``)
    last_stat: os.stat_result | None = None
    writers: int = 0  # open handles that may write: a read-only open meanwhile is not a restore
    restore: Restore | None = None  # the restore its content serves (open or lingering), if any
    # Times set (utimensat/futimens) on the open file, with the content's generation then: the
    # save's new stub gets them too, unless the file was written after they were set.
    # (atime, mtime, generation, whole file's mtime): a write passed through to the whole file moves
    # no generation, only the file's own mtime.
    set_times: tuple[int | None, int | None, int, int] | None = None
    ingesting: int = 0  # its staged saves queued for ingestion: kept, so renames keep its path
    synced: bytes | None = None  # the checksum of the save a client's fsync stored, while open for writing
    # Staged saves sealed while the writer's file description could still write them (passed
    # through, a child's copy of the descriptor outlives the close): ingested at its last release.
    deferred: list[Job] = field(default_factory=list)
    left: str | None = None  # its last path, once unlinked or renamed over


@dataclass(eq=False)
class Handle:
    node: Node
    file: FileHandle  # its reads and writes
    writer: bool = False
    opener: int | None = None  # process that opened it for writing: its own last close commits (flush)
    restore: Restore | None = None  # the restore this read-only open is part of


class Observer(Protocol):
    """Told about saves and restores (metrics); called on the FUSE thread, so it must be quick."""

    def on_save(self, seconds: float, size: int, new_bytes: int, closed: float | None = None) -> None: ...

    def on_restore(self, seconds: float, size: int) -> None: ...


def _errno_of(e: BaseException) -> int:
    if isinstance(e, OSError) and e.errno:
        return e.errno
    return errno.EIO


# The caller's own mistake (a size past max_file_size, a bad argument) is logged at debug: any
# local user could fill the log with ERROR lines otherwise. The store's trouble (EIO, ENOSPC, a
# stub that is no snapshot, a missing or corrupt chunk) stays an error.
CALLER_ERRNOS = frozenset({errno.EFBIG, errno.EINVAL})


def _level(e: BaseException) -> int:
    """The log level of a request that failed with ``e``."""
    return logging.DEBUG if isinstance(e, OSError) and e.errno in CALLER_ERRNOS else logging.ERROR


def _guarded(name: str, handler: Callable[..., Any]) -> Callable[..., Any]:
    """``handler`` that answers an unexpected exception with an errno and a log line.

    The session answers anything else with EIO too, but without saying which handler failed and
    why; and an exception in ``forget`` (no reply to carry it) is logged here and dropped.
    """

    @functools.wraps(handler)
    async def guard(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await handler(self, *args, **kwargs)
        except fuse.FUSEError:
            if name == "forget":  # no reply to carry it
                log.error("forget failed with a FUSEError; ignored")
                return None
            raise
        except Exception as e:
            code = _errno_of(e)
            # An OSError is the store's answer (one line); anything else is a bug (traceback).
            log.log(
                _level(e),
                "%s failed (%s): %s: %s",
                name,
                errno.errorcode.get(code, code),
                type(e).__name__,
                e,
                exc_info=not isinstance(e, OSError),
            )
            if name == "forget":
                return None
            raise fuse.FUSEError(code) from None

    return guard


def guard_handlers(cls: type[T]) -> type[T]:
    """Wrap every request handler of ``cls`` (all async methods the session calls) with ``_guarded``."""
    for name, value in vars(fuse.Operations).items():
        if inspect.iscoroutinefunction(value):
            setattr(cls, name, _guarded(name, getattr(cls, name)))
    return cls


@guard_handlers
class Operations(fuse.Operations):
    def __init__(self, files: Files) -> None:
        super().__init__()
        self.files = files
        self.repo = repo = files.repo
        self.enable_passthrough = repo.settings.fuse_passthrough
        self.nodes: dict[int, Node] = {}
        self.by_path: dict[str, Node] = {}
        self.handles: dict[int, Handle] = {}
        self.retries = StaleRetries()  # opens answered ESTALE, which the kernel retries (fuse/retries.py)
        self.warm_up_stats: Callable[[], dict[str, int]] = dict  # the mount's warm-up (file/warmup.py)
        self._next_ino = fuse.ROOT_INODE + 1
        self._next_fh = 1
        root = Node(fuse.ROOT_INODE, "", True, nlookup=1)
        self.nodes[root.ino] = root
        self.by_path[""] = root
        self.saves = 0
        self.restores = 0
        self.observer: Observer | None = None
        self.write_requests = 0
        self.write_bytes = 0
        self.open_files = 0  # contents loaded (open or lingering); a number other threads can read
        self.linger = 0.0  # seconds an unchanged content stays loaded after its last close (daemon: reopen_linger)
        self.lingering: dict[Node, float] = {}  # node -> when its lingering content is closed
        self.lingered = trio.Event()  # set when a content starts lingering (daemon.close_lingering)
        self.reopens = 0  # opens that took a lingering content
        self.went_idle = trio.Event()  # set when the last open file is released (see daemon.trim_when_idle)
        self.idle_gen = 0  # bumped by every first open and every last release: "still the same idle spell?"
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
        # Staged saves (store/wholefiles.py): a writer's close hands its file to ingestion, which
        # the daemon starts (``start_ingestion``); None: every save is stored before its close returns.
        self.ingester: Ingester | None = None
        self.staged_saves = 0  # saves handed to ingestion
        self.deferred_saves = 0  # of them, waiting for their writer's last release (``Node.deferred``)
        self.room: Room | None = None  # room for saves, checked at their open (file/room.py)
        self.stop_timeout = 60.0  # the daemon's: how long an unmount waits for staged saves to be stored

    # -- staged saves ------------------------------------------------------------------------

    def start_ingestion(self, workers: int = 1) -> None:
        """Saves of whole files are stored behind their close from now on (on the trio thread,
        with a whole-file directory set up)."""
        self._token = trio.lowlevel.current_trio_token()
        self.ingester = Ingester(
            self.files, self.install_ingested, self.ingestion_done, self.repo.settings.ingest_backlog, workers
        )
        # Passed through, a client's mapping may write a staged file after its close: hot copies are copies.
        self.ingester.fresh_hot_copies = lambda: self.session is None or self.session.passthrough
        if self.repo.whole is not None:
            self.room = Room(self.repo.root, self.repo.whole, self.ingester)

    async def stop_ingestion(self) -> None:
        """At unmount: store what is staged, for up to ``stop_timeout`` seconds (a reboot after
        the stop would lose it); what is left is stored by the next mount."""
        ingester = self.ingester
        if ingester is None:
            return
        for node in self.nodes.values():  # the mount is gone: no release will come
            jobs, node.deferred = node.deferred, []
            self.deferred_saves -= len(jobs)
            for job in jobs:
                job.adopt = False
                ingester.submit(job)
        count, size = ingester.backlog()
        if count:
            log.info("storing %d staged saves (%s) before stopping", count, _mib(size))
        bound = self.stop_timeout
        if not await self._thread(ingester.drain, bound):
            log.warning("staged saves still not stored after %.0f s: the next mount stores them", bound)
        await self._thread(ingester.close)
        if self.repo.whole is not None:  # what the stop leaves only in memory, by name
            ingester.report_unstored(self.repo.whole.staged_dir)
        self.ingester = None

    async def resume_staged(self) -> int:
        """Queue the staged saves a previous daemon left (killed before storing them); clear the
        stubs' names of staged files that are gone (a reboot: the previous version stays) and
        delete staged files no stub names. Costs nothing when nothing is staged. The saves queued."""
        whole = self.repo.whole
        if whole is None:
            return 0
        kept = await self._thread(self.repo.adopt_kept)  # versions a lost staged save falls back to
        present = set(await self._thread(whole.staged_names))
        if not present and not whole.rebooted and not kept:
            return 0
        found, complete = await self._thread(self.repo.staged_saves)
        queued = 0
        for rel, staged in found:
            if staged.name in present and staged.boot == whole.boot:
                node = self._remember(rel, False)
                # Not made a hot copy: a mapping from before the restart may still write the file.
                self._queue_ingestion(node, whole.staged_path(staged.name), staged.size, 0.0, adopt=False)
                present.discard(staged.name)
                queued += 1
                continue
            why = "another boot" if staged.boot != whole.boot else "its staged copy is gone"
            try:
                done = await self._thread(self.repo.lose_staged, rel)
            except OSError as e:  # its stub names a file that is gone: reads of it fail (EIO) until then
                log.error("the lost save of %s (%s) is still named on its stub: %s", rel, why, e)
                continue
            log.warning(_LOST[done], rel, why)
        if not complete and present:
            log.warning("%d staged files kept: a stub that may name one could not be read", len(present))
            present.clear()
        for name in present:  # written but never closed, or superseded
            await self._thread(whole.drop_staged, whole.staged_path(name))
        if queued:
            log.info("%d saves staged before the last stop are being stored", queued)
        return queued

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

    # -- helpers ----------------------------------------------------------------------------

    async def _thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args)

    def _node(self, ino: int) -> Node:
        node = self.nodes.get(ino)
        if node is None:
            raise fuse.FUSEError(errno.ENOENT)
        return node

    def _child(self, parent: int, name: bytes) -> str:
        base = self._node(parent).path
        if base is None:
            raise fuse.FUSEError(errno.ENOENT)
        sname = os.fsdecode(name)
        return f"{base}/{sname}" if base else sname

    def _remember(self, rel: str, is_dir: bool) -> Node:
        node = self.by_path.get(rel)
        if node is None:
            node = Node(self._next_ino, rel, is_dir)
            self._next_ino += 1
            self.nodes[node.ino] = node
            self.by_path[rel] = node
        return node

    def _detach(self, node: Node) -> None:
        """The name is gone; open handles keep the node's content alive."""
        if node.path is not None and self.by_path.get(node.path) is node:
            del self.by_path[node.path]
        node.left, node.path = node.path, None
        self._maybe_drop(node)

    def _maybe_drop(self, node: Node) -> None:
        if (
            node.nlookup <= 0
            and node.opens == 0
            and node.lingering is None
            and node.ingesting == 0
            and node.ino != fuse.ROOT_INODE
        ):
            self.nodes.pop(node.ino, None)
            if node.path is not None and self.by_path.get(node.path) is node:
                del self.by_path[node.path]

    async def _from_remote(self, remote: RemoteTier | None, step: str, rel: str) -> bool:
        """Read-through (in a thread: network): ``RemoteTier.lookup`` or ``fill_dir``. An unreachable
        bucket is logged and answered from local state only."""
        if remote is None:
            return False
        try:
            return bool(await self._thread(getattr(remote, step), rel))
        except (OSError, ValueError) as e:
            log.warning("remote %s of %s failed: %s", step, rel, e)
            return False

    async def _refresh_from_remote(self, rel: str) -> None:
        """Last writer wins across hosts: if another host saved ``rel`` since this host last synced
        it, and it is not open here, the bucket's version replaces the local stub, and the name gets
        a fresh inode (the kernel forgets the old version's pages and size, as after a rename)."""
        remote = self.repo.remote
        if remote is None or not remote.newer_in_bucket(rel) or self._in_use(rel):
            return
        try:
            fetched = await self._thread(remote.prepare_refresh, rel)
        except (OSError, ValueError) as e:
            log.warning("remote refresh of %s failed: %s", rel, e)
            return
        if fetched is None:
            return
        # Here, on the FUSE thread, the rename is ordered with saves, renames and unlinks.
        if self._in_use(rel) or not fetched.current(self.repo.path(rel)):
            await self._thread(fetched.discard)  # a local change came first: it will be uploaded
            return
        try:
            self.repo.install_fetched(fetched.tmp, rel)
        except OSError as e:  # the local version stays; the next lookup tries again
            log.warning("remote refresh of %s failed: %s", rel, e)
            await self._thread(fetched.discard)
            return
        node = self.by_path.get(rel)
        if node is not None:
            del self.by_path[rel]  # the old inode lives on until the kernel forgets it
        try:
            await self._thread(remote.refreshed, fetched)
        except (OSError, sqlite3.Error) as e:  # the next mount re-checks it (same bytes, same ETag)
            log.warning("remote refresh of %s not recorded: %s", rel, e)

    def _in_use(self, rel: str) -> bool:
        node = self.by_path.get(rel)
        return node is not None and (node.content is not None or node.opens > 0)

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
            return self._attrs(self._node(parent_inode))
        if name == b"..":
            node = self._node(parent_inode)
            parent = (node.path or "").rpartition("/")[0]
            return self._attrs(self.by_path.get(parent) or self.by_path[""])
        rel = self._child(parent_inode, name)
        known = self.by_path.get(rel)
        if known is not None:  # a revalidation may come in while the name's rename runs
            await known.gate.settled()
        await self._refresh_from_remote(rel)
        try:
            st = self.repo.lstat(rel)
        except FileNotFoundError:
            if not await self._from_remote(self.repo.remote, "lookup", rel):
                raise fuse.FUSEError(errno.ENOENT) from None
            try:
                st = self.repo.lstat(rel)
            except OSError as e:  # gone again meanwhile
                raise fuse.FUSEError(e.errno or errno.EIO) from None
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        node = self._remember(rel, stat.S_ISDIR(st.st_mode))
        attrs = self._attrs(node)
        node.nlookup += 1
        return attrs

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            node = self.nodes.get(ino)
            if node is not None:
                node.nlookup -= n
                self._maybe_drop(node)

    async def getattr(self, inode: int, ctx: fuse.RequestContext | None = None) -> fuse.EntryAttributes:
        node = self._node(inode)
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
        node = self._node(inode)
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
        node = self._node(inode)
        if not node.is_dir:
            raise fuse.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: fuse.ReaddirToken) -> None:
        node = self._node(fh)
        if node.path is None:
            return
        if start_id == 0:  # once per listing: the bucket's entries this directory lacks
            await self._from_remote(self.repo.remote, "fill_dir", node.path)
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
            child = self._remember(rel, stat.S_ISDIR(st.st_mode))
            try:
                attrs = self._attrs(child)
            except fuse.FUSEError:
                self._maybe_drop(child)
                continue
            if not fuse.readdir_reply(token, os.fsencode(name), attrs, i + 1):
                self._maybe_drop(child)
                return
            child.nlookup += 1

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: fuse.RequestContext) -> fuse.EntryAttributes:
        rel = self._child(parent_inode, name)
        try:
            self.repo.mkdir(rel, stat.S_IMODE(mode), ctx.uid, ctx.gid)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        await self._sync_dirs(rel)
        node = self._remember(rel, True)
        attrs = self._attrs(node)
        node.nlookup += 1
        return attrs

    async def rmdir(self, parent_inode: int, name: bytes, ctx: fuse.RequestContext) -> None:
        rel = self._child(parent_inode, name)
        try:
            self.repo.rmdir(rel)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        node = self.by_path.get(rel)
        if node is not None:
            self._detach(node)
        await self._sync_dirs(rel)

    async def unlink(self, parent_inode: int, name: bytes, ctx: fuse.RequestContext) -> None:
        rel = self._child(parent_inode, name)
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
                self._detach(node)
                await self.drop_lingering(node)
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
        old, new = self._child(parent_inode_old, name_old), self._child(parent_inode_new, name_new)
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
                self._detach(target)
            self._move(old, new)
        if target is not None:
            await self.drop_lingering(target)
        await self._sync_dirs(old, new)

    async def _sync_dirs(self, *rels: str) -> None:
        """durability=fsync: a namespace change survives a power cut once its call returns."""
        if self.repo.durable:
            try:
                await self._thread(self.repo.sync_dirs, *rels)
            except OSError as e:
                raise fuse.FUSEError(e.errno or errno.EIO) from None

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        node = self._node(fh)
        if node.path is None:
            return
        try:
            await self._thread(self.repo.sync_entries, node.path)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    def _move(self, old: str, new: str) -> None:
        prefix = old + "/"
        for rel in [p for p in self.by_path if p == old or p.startswith(prefix)]:
            node = self.by_path.pop(rel)
            node.path = new + rel[len(old) :]
            self.by_path[node.path] = node

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
        rel = self._child(parent_inode, name)
        try:  # in a thread, as create
            await self._thread(self.repo.create, rel, stat.S_IMODE(mode), ctx.uid, ctx.gid)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None
        node = self._remember(rel, False)
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

    def _stale(self, node: Node) -> bool:
        """The node's name is gone or names another node now (unlinked, renamed over, replaced by
        a fresh inode): an open of it that must load a content answers ESTALE, and the kernel looks
        the name up again and opens what it names now (fs/namei.c, ``LOOKUP_REVAL``)."""
        return node.path is None or self.by_path.get(node.path) is not node

    async def _load(self, node: Node, allow_broken: bool = False, then: OnPath | None = None) -> FileContent:
        rel = node.path  # under the node's gate: no rename of it meanwhile
        if rel is None:  # unlinked: ``_acquire`` answered ESTALE already
            raise fuse.FUSEError(errno.ESTALE)
        try:
            if allow_broken:  # O_TRUNC: the old content is replaced whole, never read
                return await self._thread(self.files.replacement, rel)
            return await self._thread(_and_then, self.files.load, rel, then)
        except (IndexFormatError, OSError, ChunkMissing, ChunkCorrupt) as e:  # OSError: StubError too;
            # a chunk missing or damaged: the put-back of a whole copy at open read it
            if allow_broken and not isinstance(e, FileNotFoundError):
                log.warning("overwriting unreadable snapshot %s: %s", rel, e)
                return await self._thread(self.files.content, self.repo.empty_index())
            gone = isinstance(e, FileNotFoundError)  # unlinked behind the open (or the truncate): ENOENT
            log.log(logging.DEBUG if gone else logging.ERROR, "cannot open snapshot %s: %s", rel, e)
            raise fuse.FUSEError(errno.ENOENT if isinstance(e, FileNotFoundError) else errno.EIO) from None

    async def _acquire(
        self, node: Node, allow_broken: bool = False, then: OnPath | None = None, made: FileContent | None = None
    ) -> FileContent:
        """The node's shared content, loaded by the first of concurrent opens; counts one open.

        The open is counted before any await, so a release meanwhile does not close the content,
        and a second open waits for the first one's load instead of loading (and pinning) again.
        ``then`` runs on the snapshot's path in the thread that loads it or checks a lingering
        content, if this open does either (a restore's use count: one thread hop, not two).
        ``made``: the content of a file this open created, loaded already (closed if another open
        loaded one meanwhile).
        """
        node.opens += 1
        name = node.path if node.path is not None else node.left  # a rename may replace it meanwhile
        arrival = self.retries.arrival()
        try:
            if made is not None:
                await self._take_made(node, made)
            while node.content is None:
                if node.loading is not None:
                    await node.loading.wait()
                    continue
                node.loading = loaded = trio.Event()
                try:
                    async with node.gate.use():  # the path read in a thread: no rename meanwhile
                        if self._stale(node):  # its name went while it waited, or before
                            log.debug("open of inode %d: its name names another file now (ESTALE)", node.ino)
                            self.retries.expect(name if name in self.by_path else None)  # retried there
                            raise fuse.FUSEError(errno.ESTALE)
                        content = await self._revive(node, allow_broken, then)
                        if content is None:
                            content = await self._load(node, allow_broken, then)
                            self.open_files += 1
                    node.content = content
                    self.idle_gen += 1
                finally:
                    node.loading = None
                    loaded.set()
            return node.content
        except BaseException:
            await self._drop_open(node, commit=False)
            raise
        finally:
            if not self._stale(node):
                self.retries.opened(node.path, arrival)

    async def _take_made(self, node: Node, made: FileContent) -> None:
        kept = node.lingering  # an earlier file's, under this name: not this one
        if kept is not None and node.content is None and node.loading is None:
            node.lingering = None
            self.lingering.pop(node, None)
            self._end_restore(node)
            await self._close_content(kept)
        if node.content is None and node.loading is None:
            node.content = made
            self.open_files += 1
            self.idle_gen += 1
        else:  # the file was opened meanwhile: this open joins that one
            await self._thread(made.close)

    async def _drop_open(self, node: Node, commit: bool = True) -> None:
        """One open fewer; the last one saves the content if it changed, then closes it, or keeps
        it loaded for ``linger`` seconds if it is the stub's content unchanged."""
        node.opens -= 1
        content = node.content
        if node.opens == 0 and content is not None:
            try:
                if commit:
                    await self._commit(node)
            except fuse.FUSEError:
                pass  # already logged; the previous version of the snapshot stays
            except Exception:
                log.exception("saving %s on release failed; the previous version stays", node.path)
            finally:
                if node.opens == 0 and node.content is content:
                    node.content = None
                    if self.linger > 0 and node.path is not None and content.loaded_from is not None:
                        node.lingering = content
                        self.lingering[node] = trio.current_time() + self.linger
                        self.lingered.set()
                    else:
                        self._end_restore(node)  # before the close's wait: an open meanwhile is a new one
                        await self._close_content(content)
        self._maybe_drop(node)

    async def _close_content(self, content: FileContent) -> None:
        await self._thread(content.close)  # unpins: takes store.lock
        self.open_files -= 1  # after the unpin: a test waiting for 0 may collect them
        if self.open_files == 0:
            self.idle_gen += 1
            self.went_idle.set()

    async def _revive(self, node: Node, allow_broken: bool, then: OnPath | None = None) -> FileContent | None:
        """The node's lingering content for this open if the stub still holds the bytes it was
        loaded from (then nothing is read or pinned again); else it is closed, and None. ``then``
        runs in the checking thread if the content is taken."""
        kept = node.lingering
        if kept is None:
            return None
        node.lingering = None
        self.lingering.pop(node, None)
        # Without ``then``, here, not in a thread: a small file read moments ago (as lookup's
        # lstat, no lock, no journal), and a hop to a worker costs more while the first open's
        # decodes run. With it, in the thread ``then`` needs anyway.
        if allow_broken or node.path is None:
            current = False
        elif then is None:
            current = self.files.still_current(node.path, kept)
        else:
            current = await self._thread(_and_then, lambda rel: self.files.still_current(rel, kept), node.path, then)
        if current:
            self.reopens += 1
            return kept
        self._end_restore(node)
        await self._close_content(kept)
        return None

    async def drop_lingering(self, node: Node) -> None:
        """Close the node's lingering content now (at its time, or its name is gone: GC may take
        its chunks once it is unpinned)."""
        kept = node.lingering
        if kept is not None:
            node.lingering = None
            self.lingering.pop(node, None)
            self._end_restore(node)
            await self._close_content(kept)
        self._maybe_drop(node)

    async def close_lingered(self, now: float | None = None) -> float | None:
        """Close the lingering contents whose time is up (all of them with ``now`` = inf); the
        seconds until the next one is due, or None if none lingers."""
        now = trio.current_time() if now is None else now
        for node in [n for n, due in self.lingering.items() if due <= now]:
            await self.drop_lingering(node)
        if not self.lingering:
            return None
        return max(0.0, min(self.lingering.values()) - trio.current_time())

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
            what = f"open of {self._node(inode).path} for writing"
            return await self._start_write(what, flags, self._open, inode, flags, ctx)
        return await self._open(inode, flags, ctx)

    async def _open(self, inode: int, flags: int, ctx: fuse.RequestContext) -> fuse.FileInfo:
        node = self._node(inode)
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
            await self._count_restore(node, node.path, content, self.handles[fh], start, source, noted)
        else:
            self._end_restore(node)  # its content is taken for writing: that restore is over
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

    async def _count_restore(
        self, node: Node, rel: str, content: FileContent, handle: Handle, start: float, source: str, noted: bool
    ) -> None:
        """Make ``handle`` (on ``content``, the snapshot at ``rel``) part of the node's restore: a new
        one (counted, a use of the snapshot), or the one under way whose content it took
        (llama-server's second open of a restore)."""
        restore = node.restore
        if restore is None:
            self.restores += 1
            restore = node.restore = Restore(rel, content.size, source, start)
        else:
            restore.opens += 1
            noted = True  # its first open counted the use
        restore.handles += 1
        handle.restore = restore
        if not noted:  # the content was loaded already: no thread ran for this open
            async with node.gate.use():
                if node.path is not None:
                    await self._thread(self.repo.note_use, node.path)

    def _end_restore(self, node: Node) -> None:
        """The node's restore is over once none of its handles is open and its content is closed or
        taken by another open: report it (metrics, history, one log line)."""
        restore = node.restore
        if restore is None or restore.handles:
            return
        node.restore = None
        seconds = (restore.closed or time.monotonic()) - restore.start
        self._observe("on_restore", seconds, restore.size)
        log.info("restored %s: %s in %.0f ms from %s (%d open%s)", restore.name, _mib(restore.size), seconds * 1000,
                 restore.source, restore.opens, "" if restore.opens == 1 else "s")  # fmt: skip

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: fuse.RequestContext
    ) -> tuple[fuse.FileInfo, fuse.EntryAttributes]:
        what = f"create of {self._child(parent_inode, name)}"
        return await self._start_write(what, flags, self._create, parent_inode, name, mode, flags, ctx)

    async def _create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: fuse.RequestContext
    ) -> tuple[fuse.FileInfo, fuse.EntryAttributes]:
        rel = self._child(parent_inode, name)
        pid = ctx.pid if self.mountpoint else None
        try:  # one thread: a create may wait in the file system's journal (durable: and its fsyncs)
            made, opener = await self._thread(self._made, rel, stat.S_IMODE(mode), ctx.uid, ctx.gid, pid)
        except (IndexFormatError, ChunkMissing, ChunkCorrupt, OSError) as e:
            log.log(logging.WARNING if isinstance(e, OSError) else logging.ERROR, "create of %s failed: %s", rel, e)
            raise fuse.FUSEError(_errno_of(e)) from None
        node = self._remember(rel, False)
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
                await self._ingest_deferred(node)
        finally:
            if handle.writer:  # counted until its save is done: a stop waits for it
                self.writing -= 1
                self._write_ended()
        if restore is not None and node.content is not None:  # still open for something else: it ends here
            self._end_restore(node)

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

    async def _commit(
        self, node: Node, durable: bool = False, closing: bool = False, unless: Callable[[], bool] | None = None
    ) -> None:
        """Save the node's content as its stub if it changed (the atomic replace): stored now, or,
        a whole file handed to ingestion, its staged file named on the stub (``_stage``).
        ``closing``: a writer's own close (its handle still counts among the node's writers);
        ``unless``: a blocking check that, true, makes this close not a commit (in the save's thread)."""
        content = node.content
        if content is None or not (content.dirty or durable):
            return
        ingester = self.ingester
        if ingester is not None and ingester.backlogged():  # bounded: the client waits, the backlog does not grow
            # Not under the node's lock: ingestion takes it to install (the wait would never end). On
            # this thread, not a worker's: closes waiting in every worker would leave none for the
            # install that ends their wait.
            log.info("ingestion is %s behind: the close of %s waits", _mib(ingester.backlog()[1]), node.path)
            ingester.waits += 1
            while ingester.backlogged() and self.ingester is ingester:
                await trio.sleep(BACKLOG_STEP)
        async with node.lock:
            if not content.dirty and not durable:
                return
            start = time.monotonic()
            others = node.writers - closing  # handles still open that may write on
            limit = self.repo.settings.max_file_size
            if content.whole is not None and content.size > limit:
                # Written past it through the backing file (passthrough): refused here, at the save.
                log.debug("saving %s refused: %d bytes, max_file_size is %d", node.path, content.size, limit)
                await self._forget_unsaved(node)
                raise fuse.FUSEError(errno.EFBIG)
            staged = not durable and not self.repo.durable and self.ingester is not None and content.own_file()
            inline = not durable and self._memory_short()  # counted: a save while memory is short
            if staged:  # a write to it may have failed for room: never committed, staged or stored now
                await self._room_to_stage(node, content, unless)
            if staged and not inline:
                if await self._stage(node, content, start, copy=others > 0, unless=unless) and others > 0:
                    content.mark_changed()  # their close saves what they write (passthrough: unseen)
                return
            if unless is not None and await self._thread(unless):
                log.debug("flush of %s from another copy of the descriptor: not a commit", node.path)
                return
            try:
                pending = await self._thread(self.files.prepare_save, content, node.path, durable)
                await node.gate.settled()  # no rename of it in flight, and none starts before the install
                rel = node.path  # read at rename time: a rename of the open file meanwhile is honoured
                if not self.files.finish_save(pending, rel):
                    return  # unlinked while open: nothing to save
                assert rel is not None
                self._carry_set_times(node, pending.gen, rel)
                if pending.durable:
                    await self._thread(self.files.sync_dir, rel)
            except (ChunkMissing, ChunkCorrupt, OSError) as e:
                log.error("saving %s failed, previous version kept: %s", node.path, e)
                await self._forget_unsaved(node)
                raise fuse.FUSEError(_errno_of(e)) from None
            self.saves += 1
            seconds, new_bytes = time.monotonic() - start, pending.new_bytes
            self._observe("on_save", seconds, pending.index.size, new_bytes)
            log.info("saved %s: %s, %s new, in %.0f ms", rel, _mib(pending.index.size), _mib(new_bytes),
                     seconds * 1000)  # fmt: skip
            if node.writers - closing > 0 and content.whole is not None:
                content.mark_changed()  # still open for writing: passthrough writes are unseen
                # A client's fsync: its close stores nothing again if the file is still this save
                # (ingesting it again would replace the durable stub by one a power cut can take).
                node.synced = pending.record.file_sum if durable and pending.record is not None else None

    async def _room_to_stage(self, node: Node, content: FileContent, unless: Callable[[], bool] | None) -> None:
        """A save of a staged file is not committed if a write to it may have failed for lack of
        room, nor if the store could not take it: ENOSPC (or the store's errno), the previous version
        kept. A FLUSH that ``unless`` says is not a commit is not refused (its writer's close is)."""
        room = self.room
        if room is None:
            return
        error = await self._thread(room.at_close, content)
        if error is not None and unless is not None and await self._thread(unless):
            return  # not a commit: the caller's own check says so again, and nothing is saved
        if error is not None:
            log.error("saving %s refused, previous version kept: %s", node.path, error.strerror)
            await self._forget_unsaved(node)
            raise fuse.FUSEError(error.errno or errno.EIO)

    async def _stage(
        self, node: Node, content: FileContent, start: float, copy: bool, unless: Callable[[], bool] | None = None
    ) -> bool:
        """A save by its staged file: the commit point is naming the file on the stub (from then
        on it is the snapshot, through a kill -9 too); ingestion stores it behind the close.
        False if ``unless`` said this is not a commit."""
        assert self.ingester is not None
        synced, node.synced = node.synced, None
        if synced is not None and (unless is None or not await self._thread(unless)):
            if await self._thread(same_sum, content.whole_fd(), synced):
                content.committed(content.gen)  # unchanged since the client's fsync stored it durably
                return True
        elif synced is not None:  # a FLUSH from another copy of the descriptor: not a commit
            node.synced = synced
            return False
        async with node.gate.use():
            rel = node.path
            try:
                staged = await self._thread(self._seal_and_stage, content, copy, rel, unless)
            except OSError as e:
                log.error("saving %s failed, previous version kept: %s", node.path, e)
                await self._forget_unsaved(node)
                raise fuse.FUSEError(_errno_of(e)) from None
            if staged is None:
                log.debug("flush of %s from another copy of the descriptor: not a commit", node.path)
                return False
            path, size, gen = staged
            if rel is not None:
                self._carry_set_times(node, gen, rel)
        content.committed(gen)
        if rel is None:  # unlinked while open: nothing to save
            return True
        self.staged_saves += 1
        # Its own file (not a copy) may still be written after this close through another reference
        # to the writer's file description (a child's inherited descriptor: passed through, the
        # kernel writes it directly): stored at the last release, as the file is then.
        self._queue_ingestion(node, path, size, (time.monotonic() - start) * 1000, defer=not copy)
        return True

    def _memory_short(self) -> bool:
        """Memory is short (store/pressure.py): this save is stored now, not staged (counted)."""
        whole = self.repo.whole
        if whole is None or not whole.short or self.ingester is None or self.repo.durable:
            return False
        whole.stats.saves_inline += 1
        return True

    def _seal_and_stage(
        self, content: FileContent, copy: bool, rel: str | None, unless: Callable[[], bool] | None
    ) -> tuple[Path, int, int] | None:
        """A staged save's blocking part, one thread hop: the file sealed and named on the stub
        (dropped if the file was unlinked); None, nothing done, if ``unless()``."""
        if unless is not None and unless():
            return None
        whole = self.repo.whole
        assert whole is not None
        path, size, gen = content.seal(copy)
        try:
            if rel is not None:
                self.repo.stage(rel, path.name, size)
        except BaseException:
            whole.drop_staged(path)
            raise
        if rel is None:
            whole.drop_staged(path)
        return path, size, gen

    def _queue_ingestion(
        self, node: Node, path: Path, size: int, closed_ms: float, defer: bool = False, adopt: bool = True
    ) -> None:
        assert self.ingester is not None
        node.ingesting += 1
        job = Job(path, size, lambda: node.path, owner=node, closed_ms=closed_ms, adopt=adopt)
        if defer and node.writers > 0 and self.session is not None and self.session.passthrough:
            node.deferred.append(job)
            self.deferred_saves += 1
        else:
            self.ingester.submit(job)

    async def _ingest_deferred(self, node: Node) -> None:
        """The writer's file description is released (a child's inherited descriptor kept it open
        until now): its sealed saves are stored as their files are now, writes made after the
        close included (the stub's staged size follows the file's)."""
        jobs, node.deferred = node.deferred, []
        async with node.lock, node.gate.use():
            for job in jobs:
                try:
                    job.size = await self._thread(self._restage, node.path, job)
                except OSError as e:  # ingestion reads the file as it is all the same
                    log.warning("the save of %s grew after its close; its size not updated: %s", node.path, e)
                assert self.ingester is not None
                self.ingester.submit(job)
                self.deferred_saves -= 1  # counted until queued: ``Mount.ingested`` waits for it

    def _restage(self, rel: str | None, job: Job) -> int:
        """The staged file's size now; named on the stub if it changed and the stub still names it."""
        try:
            size = os.stat(job.path).st_size
        except FileNotFoundError:
            return job.size
        if rel is not None and size != job.size:
            staged = self.repo.staged(rel)
            if staged is not None and staged.name == job.name:
                self.repo.stage(rel, job.name, size)
        return size

    # -- ingestion's callbacks (worker threads) ---------------------------------------------

    def install_ingested(self, job: Job, pending: PendingSave) -> Outcome:
        """From an ingestion worker: install its new stub on the trio thread (``_install``)."""
        try:
            return trio.from_thread.run(self._install, job, pending, trio_token=self._token)
        except trio.RunFinishedError:
            _discard(pending)
            return Outcome.LATER

    async def _install(self, job: Job, pending: PendingSave) -> Outcome:
        node = job.owner
        assert isinstance(node, Node)
        # The node's lock orders it with the saves of the file (``_stage`` names a newer staged file
        # under it): a stub read as naming this save must still name it when it is replaced.
        async with node.lock, node.gate.use():
            rel = node.path
            try:
                current = None if rel is None else await self._thread(self.repo.staged, rel)
            except OSError:  # cannot tell: the staged file stays the snapshot (ingestion tries again)
                await self._thread(_discard, pending)
                raise
            if rel is None or current is None or current.name != job.name:
                await self._thread(_discard, pending)
                return Outcome.SUPERSEDED
            try:
                self.files.finish_staged(pending, rel)  # the stub replaced: no staged save named any more
            except OSError:  # ingestion logs it and tries again
                await self._thread(_discard, pending)
                raise
        return Outcome.INSTALLED

    def ingestion_done(self, job: Job, outcome: Outcome, new_bytes: int, seconds: float) -> None:
        """From an ingestion worker: the job is over (metrics, the log line, the node let go)."""
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(self._ingested, job, outcome, new_bytes, seconds, trio_token=self._token)

    def _ingested(self, job: Job, outcome: Outcome, new_bytes: int, seconds: float) -> None:
        node = job.owner
        assert isinstance(node, Node)
        node.ingesting -= 1
        self._maybe_drop(node)
        if outcome is not Outcome.INSTALLED:
            return
        self.saves += 1
        stored = job.closed_ms / 1000 + time.monotonic() - job.queued  # from the close's start until stored
        self._observe("on_save", stored, job.size, new_bytes, job.closed_ms / 1000)
        log.info("saved %s: %s, %s new, closed in %.0f ms, stored in %.0f ms", node.path or job.where() or job.name,
                 _mib(job.size), _mib(new_bytes), job.closed_ms, seconds * 1000)  # fmt: skip

    def _carry_set_times(self, node: Node, gen: int, rel: str) -> None:
        """Give the saved stub the times set on the open file, if nothing was written after them."""
        times, node.set_times = node.set_times, None
        if times is None or times[2] != gen or times[3] != (node.content.whole_mtime() if node.content else -1):
            return
        try:
            self.repo.set_times(rel, times[0], times[1])
        except OSError as e:  # the save stands; only its times are the save's
            log.warning("times set on %s not kept: %s", rel, e)

    def _invalidate_entry(self, parent_ino: int, name: bytes) -> None:
        try:
            self.invalidate_entry(parent_ino, name)
        except OSError as e:  # the kernel does not know the name: nothing to drop
            log.debug("invalidating %r: %s", name, e)

    def _observe(self, event: str, *args: float) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, event)(*args)
        except Exception:  # metrics must never fail a save or a restore
            log.exception("observer %s failed", event)

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

    def _path_of(self, inode: int) -> str | None:
        """The node's path; None for an unlinked one or an unknown inode (the store answers ENOENT)."""
        node = self.nodes.get(inode)
        return node.path if node is not None else None

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
            return self.repo.get_xattr(self._path_of(inode), sname)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: fuse.RequestContext) -> None:
        try:
            self.repo.set_xattr(self._path_of(inode), os.fsdecode(name), value)
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    async def listxattr(self, inode: int, ctx: fuse.RequestContext) -> list[bytes]:
        try:
            return [os.fsencode(n) for n in self.repo.list_xattrs(self._path_of(inode))]
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    async def removexattr(self, inode: int, name: bytes, ctx: fuse.RequestContext) -> None:
        try:
            self.repo.remove_xattr(self._path_of(inode), os.fsdecode(name))
        except OSError as e:
            raise fuse.FUSEError(e.errno or errno.EIO) from None

    # -- introspection ----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        c = self.repo.store.counters
        return (
            {
                "chunks_written": c.chunks_written,
                "bytes_written": c.bytes_written,
                "chunks_deduped": c.chunks_deduped,
                "bytes_deduped": c.bytes_deduped,
                "pack_reads": c.pack_reads,
                "pack_bytes_read": c.pack_bytes_read,
                "pack_direct_reads": c.direct_reads,
                "chunks_read": self.files.restore.stats.chunks_read,
                "restores_to_memory": self.files.restore.stats.to_memory,
                "restores_to_disk": self.files.restore.stats.to_disk,
                "restore_disk_copies": self.files.restore.stats.disk_copies_open,
                "restore_buffers_reused": self.files.buffers.reused,
                "saves": self.saves,
                "restores": self.restores,
                "write_requests": self.write_requests,
                "write_request_bytes": self.write_bytes,
                "open_files": self.open_files,
                "lingering_files": len(self.lingering),
                "reopens": self.reopens,
                "memory_trims": self.memory_trims,
                "idle_checks": self.idle_checks,
                "bytes_predicted": self.files.successors.predicted_bytes if self.files.successors else 0,
                "file_order_saves": self.files.checks.file_order_saves,
                "checksum_mismatches": self.files.checks.mismatches,
                "fuse_passthrough": int(self.session is not None and self.session.passthrough),
            }
            | self.whole_stats()
            | self.warm_up_stats()
            | (self.repo.remote.stats() if self.repo.remote is not None else {})
        )

    def whole_stats(self) -> dict[str, int]:
        """The staged saves and the hot tier: ingestion's backlog, the tier's size and traffic."""
        whole, ingester = self.repo.whole, self.ingester
        if whole is None:
            return {}
        queued, queued_bytes = ingester.backlog() if ingester is not None else (0, 0)
        files, size = whole.hot_usage()
        h = whole.stats
        return {
            "staged_saves": self.staged_saves,
            "ingest_queue": queued + self.deferred_saves,
            "ingest_queue_bytes": queued_bytes,
            "ingest_waits": ingester.waits if ingester is not None else 0,
            "ingest_failures": ingester.failures if ingester is not None else 0,
            "ingest_behind_ms": int(ingester.lag() * 1000) if ingester is not None else 0,
            "ingest_backlog_limit": ingester.limit if ingester is not None else 0,
            **self._room_stats(),
            "hot_files": files,
            "hot_bytes": size,
            "hot_budget": whole.budget,
            "hot_hits": h.hits,
            "hot_misses": h.misses,
            "hot_put_backs": h.put_backs,
            "hot_evictions": h.evictions,
        } | whole.tier_stats()

    def _room_stats(self) -> dict[str, int]:
        """Whether the store is degraded (ingestion cannot store what is staged) and how much is
        not stored; the saves refused for it and the opens that waited for room."""
        ingester, room = self.ingester, self.room
        unstored = ingester.unstored() if ingester is not None else []
        return {
            "ingest_degraded": int(ingester is not None and ingester.degraded() is not None),
            "unstored_saves": len(unstored),
            "unstored_bytes": sum(j.size for j in unstored),
            "saves_refused": room.refused if room is not None else 0,
            "room_waits": room.waits if room is not None else 0,
        }

    def fuse_mode(self) -> dict[str, str]:
        """How the kernel's requests are served: "passthrough" (the kernel may serve an open file
        from its backing file) or "served" (every byte through the daemon), and why."""
        if self.session is None:
            return {"mode": "unmounted", "why": ""}
        return {"mode": "passthrough" if self.session.passthrough else "served", "why": self.session.why}


_LOST = {  # Repository.lose_staged's outcome -> the log line
    "index": "the save of %s was lost (%s): its previous version stays",
    "kept": "the save of %s was lost (%s): the version it replaced is back",
    "removed": "the first save of %s was lost (%s): the name is removed",
}


def _mib(n: int) -> str:
    """A byte count for a log line: MiB with a decimal, or bytes below one."""
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"


def _discard(pending: PendingSave) -> None:
    """A prepared stub that is not installed (blocking)."""
    if pending.tmp is not None:
        with contextlib.suppress(FileNotFoundError):
            pending.tmp.unlink()


def _and_then(fn: Callable[[str], T], rel: str, then: OnPath | None) -> T:
    """``fn(rel)``, then ``then(rel)`` if given and ``fn`` did not return False (one thread)."""
    out = fn(rel)
    if then is not None and out is not False:
        then(rel)
    return out
