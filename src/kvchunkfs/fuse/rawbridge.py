"""Between the session and the filesystem (go-fuse's ``rawBridge``): what the kernel's rules ask of
the opens of files, kept out of the session, which speaks the protocol only.

Passthrough: one backing file per inode at a time, and a writer's turn (fuse/backing.py). An open
takes its turn among the inode's opens before the filesystem opens it; its answer names the
kernel's backing id for the file it passes through to (0: served), registered by the session for
the inode's first open and closed at its last RELEASE. A truncate by path takes a turn as an open
for writing does. The set-id rule (fuse/setid.py): the inodes the kernel believes set-id, and the
bits dropped where it asks; a set-id file is served, never passed through (the kernel drops no
set-id bit for a passthrough write).

The session calls ``open``/``create`` (its answer sent inside them: the opens behind a writer go
on once it is answered), ``release``, ``setattr``, ``kill_setid`` for a write and ``seen`` for
every attribute it tells the kernel. The kernel's side of a backing file (register, close) is the
session's (``Server``). All of it runs on the session's trio thread: no lock.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import trio

from kvchunkfs.fuse.api import EntryAttributes, FileInfo, Operations, RequestContext, SetattrFields
from kvchunkfs.fuse.backing import Backings, Opening
from kvchunkfs.fuse.setid import SetId


class Server(Protocol):
    """The session's side: its mode, and the kernel's backing ids and notifications."""

    passthrough: bool

    def register_backing(self, fd: int) -> int: ...

    async def close_backing(self, backing_id: int) -> None: ...

    def invalidate_inode(self, inode: int, attr_only: bool = False) -> None: ...


@dataclass(eq=False, slots=True)
class Answer:
    """An open's answer: its handle, the filesystem's ``FileInfo`` and the kernel's backing id
    (0: served)."""

    nodeid: int
    fi: FileInfo
    backing_id: int
    opening: Opening | None


class RawBridge:
    """The rules for the opens of ``ops``'s files on one mount (see the module's docstring)."""

    def __init__(self, ops: Operations, server: Server) -> None:
        self.ops = ops
        self.server = server
        self.backings = Backings()  # passthrough: the inodes' opens and the file each uses
        self.setid = SetId(ops, lambda ino: server.invalidate_inode(ino, attr_only=True))
        self.seen = self.setid.seen  # every attribute the kernel is told

    @asynccontextmanager
    async def open(self, nodeid: int, flags: int, kill_setid: bool, ctx: RequestContext) -> AsyncIterator[Answer]:
        """Open ``nodeid`` (``kill_setid``: the kernel asks the set-id bits dropped); the answer is
        sent in the ``with`` block (``unanswered`` if it could not be)."""
        opening = await self._arrive(nodeid, bool(flags & os.O_TRUNC) or flags & os.O_ACCMODE != os.O_RDONLY)
        try:
            fi = await self.ops.open(nodeid, flags, ctx)
            if kill_setid and nodeid in self.setid:
                try:
                    await self.setid.kill(nodeid, ctx)
                except BaseException:
                    await self.ops.release(fi.fh)  # the open fails: no RELEASE will come for it
                    raise
            yield await self._answer(nodeid, fi, opening)
        finally:
            self._opened(opening)

    @asynccontextmanager
    async def create(
        self, parent: int, name: bytes, mode: int, flags: int, ctx: RequestContext
    ) -> AsyncIterator[tuple[Answer, EntryAttributes]]:
        """Create and open ``name``; the answer is sent in the ``with`` block, as ``open``'s."""
        fi, attrs = await self.ops.create(parent, name, mode, flags, ctx)
        self.seen(attrs)  # (a new file: nothing to drop for an O_TRUNC)
        opening = self.backings.begin(attrs.st_ino) if self.server.passthrough else None  # new: no turn
        try:
            yield await self._answer(attrs.st_ino, fi, opening), attrs
        finally:
            self._opened(opening)

    async def unanswered(self, answer: Answer) -> None:
        """The kernel no longer waits for the answer: release the open (as libfuse does: the kernel
        will send no RELEASE for it)."""
        await self.server.close_backing(self.backings.released(answer.nodeid, answer.fi.fh))
        await self.ops.release(answer.fi.fh)

    async def release(self, nodeid: int, fh: int) -> None:
        # The kernel let go of the file before it sent the RELEASE: an open that waits for the
        # inode's opens of another file goes on at once.
        backing_id = self.backings.released(nodeid, fh)
        try:  # first: an open right after sees the handle gone (a writer's close, then a restore)
            await self.ops.release(fh)
        finally:
            await self.server.close_backing(backing_id)

    async def setattr(
        self,
        nodeid: int,
        attr: EntryAttributes,
        fields: SetattrFields,
        fh: int | None,
        kill_setid: bool,
        ctx: RequestContext,
    ) -> EntryAttributes:
        # A truncate by path writes as an open for writing does (a handle's open took its turn).
        opening = await self._arrive(nodeid, True) if fields.update_size and fh is None else None
        try:
            out = await self.ops.setattr(nodeid, attr, fields, fh, ctx)
        finally:
            if opening is not None:
                self.backings.end(opening)
        self.seen(out)
        if kill_setid and not fields.update_mode:  # a chown, a truncate
            out = await self.setid.drop(nodeid, ctx) or out
        return out

    async def kill_setid(self, nodeid: int, ctx: RequestContext) -> None:
        """A write asks the set-id bits dropped (rare: a set-id file)."""
        if nodeid in self.setid:
            await self.setid.kill(nodeid, ctx)

    async def _arrive(self, nodeid: int, writer: bool) -> Opening | None:
        """Passthrough: the open (or truncate) takes its turn among the inode's (fuse/backing.py);
        EBUSY for a writer the earlier opens of the version it replaces kept waiting too long."""
        if not self.server.passthrough:
            return None
        return await self.backings.arrive(nodeid, writer, lambda: self.ops.writes_in_place(nodeid))

    def _opened(self, opening: Opening | None) -> None:
        """The open is answered, or failed: the opens that wait for its turn go on; a failed one is over."""
        if opening is not None:
            self.backings.turn_over(opening)
            if not opening.answered:
                self.backings.end(opening)

    async def _answer(self, nodeid: int, fi: FileInfo, opening: Opening | None) -> Answer:
        """The backing id to answer ``fi`` with: the inode's file, registered by its first open,
        once the opens of another file are released; 0 (served) for served mode, a set-id file, a
        file the kernel refused. The session has taken ``fi.backing_fd`` over: closed here."""
        fd, backing_id = fi.backing_fd, 0
        if fd is not None and (opening is None or nodeid in self.setid):
            # Served mode; or a set-id file, served: the kernel drops no set-id bit for a passthrough write.
            await trio.to_thread.run_sync(os.close, fd)
            fd = None
        if opening is not None:
            registered = False
            try:
                backing_id, registered = await self.backings.attach(opening, fi.fh, fd, self.server.register_backing)
            finally:
                if fd is not None and registered:
                    os.close(fd)  # the kernel holds the file now: not its last close
                elif fd is not None:  # perhaps its last close, which may wait for the file system: not here
                    await trio.to_thread.run_sync(os.close, fd)
        return Answer(nodeid, fi, backing_id, opening)
