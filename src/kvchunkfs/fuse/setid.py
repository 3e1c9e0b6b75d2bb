"""The set-id rule: which inodes the kernel believes set-user-ID or set-group-ID, and dropping
those bits where the kernel asks (``HANDLE_KILLPRIV_V2``): a write or truncate by a caller without
CAP_FSETID, a chown, an ``O_TRUNC`` open. What the kernel itself did before; only for an inode the
kernel believes set-id, so the common case costs a set lookup.

All of it runs on the session's trio thread: no lock.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable

import trio

from kvchunkfs.fuse.api import EntryAttributes, Operations, RequestContext, SetattrFields

log = logging.getLogger(__name__)

_SETID = stat.S_ISUID | stat.S_ISGID


class SetId:
    """The rule for one mount's inodes (see the module's docstring). ``invalidate`` tells the kernel
    to drop an inode's cached attributes (blocking: called in a worker thread)."""

    def __init__(self, ops: Operations, invalidate: Callable[[int], None]) -> None:
        self.ops = ops
        self._invalidate = invalidate
        self._inodes: set[int] = set()  # inodes whose mode, as last told to the kernel, has set-id bits

    def seen(self, attrs: EntryAttributes) -> None:
        """The kernel is told ``attrs``: keep track of the inodes it believes set-id."""
        if attrs.st_mode & _SETID:
            self._inodes.add(attrs.st_ino)
        elif self._inodes:
            self._inodes.discard(attrs.st_ino)

    def __contains__(self, inode: int) -> bool:
        return inode in self._inodes

    async def drop(self, nodeid: int, ctx: RequestContext) -> EntryAttributes | None:
        """Clear the set-user-ID bit, and set-group-ID with group execute. The new attributes, or
        None if nothing changed."""
        if nodeid not in self._inodes:
            return None
        mode = (await self.ops.getattr(nodeid, ctx)).st_mode
        new = mode & ~stat.S_ISUID
        if mode & stat.S_IXGRP:
            new &= ~stat.S_ISGID
        if new == mode:
            return None
        attr, fields = EntryAttributes(), SetattrFields()
        attr.st_mode, fields.update_mode = new, True
        out = await self.ops.setattr(nodeid, attr, fields, None, ctx)
        self.seen(out)
        return out

    async def kill(self, nodeid: int, ctx: RequestContext) -> None:
        """A write or an open that asks the bits dropped: drop them, and the kernel forgets the
        attributes it cached (they are not in the answer)."""
        if nodeid in self._inodes and await self.drop(nodeid, ctx):
            await trio.to_thread.run_sync(self._forget_attrs, nodeid)

    def _forget_attrs(self, nodeid: int) -> None:
        try:
            self._invalidate(nodeid)
        except OSError as e:
            log.debug("invalidating the attributes of %d: %s", nodeid, e)
