"""Passthrough's rule: one file per inode at a time, and a writer's turn.

The kernel passes the open files of an inode through to one backing file at a time: while one open
of the inode passes through to a file, an open naming another file fails (EBUSY), and so does an
open that is not passed through (a served one); while a served open is open, one passed through
fails (ETXTBSY). The user sees EIO. The kernel lets go of a file's claim when the file is closed,
before it sends the RELEASE (fs/fuse/iomode.c), so a count from the open's answer to its RELEASE
is never short of the kernel's.

Every open of an inode in passthrough mode is counted here from its arrival to its RELEASE, in the
order of arrival (a ticket), and so is a truncate by path while it runs. A reader shares the file
the inode's open files use, whatever it is. A writer needs a file of its own (a copy of the version
it changes) unless the inode's content is already one (another writer's, which it joins): then it
waits for the opens that were there when it arrived, at most ``BUSY_WAIT`` seconds, after which it
fails with EBUSY before anything changed. Opens that arrive after it wait for its turn to end (its
open answered or failed), then share its file: a stream of readers cannot starve a save, and a
read-only open never gets EBUSY. When an open is answered, the file it needs is compared with the
one the inode's answered opens use; if it is another, the open waits for those to end (a moment:
the last opens of a version no longer loaded, whose RELEASE is on its way).

All of it runs on the session's trio thread: no lock, and a wait never blocks the thread.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import trio

from kvchunkfs.fuse.api import FUSEError

log = logging.getLogger(__name__)

BUSY_WAIT = 2.0  # seconds a writer waits for the earlier opens of a version it replaces
FileId = tuple[int, int]  # (st_dev, st_ino) of a backing file


@dataclass(eq=False)
class Opening:
    """One open of an inode (or a truncate by path), from its arrival to its release."""

    inode: int
    ticket: int
    answered: bool = False  # counted among the users of the inode's file


class _Inode:
    """The opens of one inode and the file they use."""

    __slots__ = ("next_ticket", "live", "turns", "file", "users", "backing_id", "refused", "_changed")

    def __init__(self) -> None:
        self.next_ticket = 0
        self.live: set[int] = set()  # tickets of its opens: arrived and not yet released
        self.turns: list[int] = []  # writers waiting for their turn or taking it, in order of arrival
        self.file: FileId | None = None  # what its answered opens use: a backing file, None served
        self.users = 0  # answered opens using ``file``
        self.backing_id = 0  # the kernel's id of ``file`` (0: served)
        self.refused: FileId | None = None  # a file the kernel refused as a backing file: served
        self._changed = trio.Event()

    def changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self, deadline: float = float("inf")) -> None:
        with trio.move_on_at(deadline):
            await self._changed.wait()

    def idle(self) -> bool:
        return not self.live and not self.turns and not self.users and self.refused is None


class Backings:
    """The rule for one mount's inodes (see the module's docstring)."""

    def __init__(self) -> None:
        self._inodes: dict[int, _Inode] = {}
        self._answered: dict[tuple[int, int], Opening] = {}  # (inode, fh) -> its open

    def opens(self, inode: int) -> int:
        """The inode's opens counted (arrived, not released)."""
        s = self._inodes.get(inode)
        return len(s.live) if s is not None else 0

    def _arrived(self, inode: int) -> tuple[_Inode, Opening]:
        s = self._inodes.get(inode)
        if s is None:
            s = self._inodes[inode] = _Inode()
        op = Opening(inode, s.next_ticket)
        s.next_ticket += 1
        s.live.add(op.ticket)
        return s, op

    def begin(self, inode: int) -> Opening:
        """An open that waits for no turn (a create: the file is new)."""
        return self._arrived(inode)[1]

    async def arrive(self, inode: int, writer: bool, in_place: Callable[[], bool]) -> Opening:
        """An open (``writer``: one that may change the file) arrives: wait for its turn. A writer
        whose ``in_place()`` is false needs a file of its own: it waits for the earlier opens to end,
        then holds its turn until ``turn_over``; EBUSY if they are still open after ``BUSY_WAIT``."""
        s, op = self._arrived(inode)
        if writer:
            s.turns.append(op.ticket)
        try:
            deadline = trio.current_time() + BUSY_WAIT
            while s.turns and s.turns[0] < op.ticket:  # a writer that came first takes its turn first
                await s.wait()
            if writer:
                while not in_place() and (earlier := sum(1 for t in s.live if t < op.ticket)):
                    if trio.current_time() >= deadline:
                        log.warning("open of inode %d for writing refused (EBUSY): %d earlier opens still read "
                                    "the version it replaces after %.0f s", inode, earlier, BUSY_WAIT)  # fmt: skip
                        raise FUSEError(errno.EBUSY)
                    await s.wait(deadline)
                if in_place():
                    self.turn_over(op)  # it writes the file the others use: nothing to hold back
        except BaseException:
            self.end(op)
            raise
        return op

    def turn_over(self, op: Opening) -> None:
        """The writer's open is answered (or failed): the opens behind it go on."""
        s = self._inodes.get(op.inode)
        if s is not None and op.ticket in s.turns:
            s.turns.remove(op.ticket)
            s.changed()

    async def attach(self, op: Opening, fh: int, fd: int | None, register: Callable[[int], int]) -> tuple[int, bool]:
        """The open is answered as ``fh``: through ``fd`` (a backing file; None: served). Waits while
        the inode's answered opens use another file; registers ``fd`` with ``register`` (its
        backing id, 0 if the kernel refused it: served) if it is the first. The backing id to
        answer with (0: served) and whether ``fd`` was registered by this open."""
        s = self._inodes[op.inode]
        file = None
        if fd is not None:
            st = os.fstat(fd)
            file = (st.st_dev, st.st_ino)
            if file == s.refused:
                file = None
        since = trio.current_time()
        warned = False
        while s.users and s.file != file:
            await s.wait(since + BUSY_WAIT if not warned else float("inf"))
            if s.users and s.file != file and not warned and trio.current_time() >= since + BUSY_WAIT:
                log.warning("open of inode %d waits for its open files of another version to close", op.inode)
                warned = True
        registered = False
        if not s.users:
            s.file, s.backing_id = file, 0
            if file is not None and fd is not None:
                s.backing_id = register(fd)
                registered = s.backing_id != 0
                if not registered:  # the kernel refused it: this file's opens are served
                    s.file, s.refused = None, file
        s.users += 1
        op.answered = True
        self._answered[op.inode, fh] = op
        return s.backing_id, registered

    def released(self, inode: int, fh: int) -> int:
        """The kernel released the open ``fh`` (it has let go of its file): the backing id to close
        (its last open), or 0."""
        op = self._answered.pop((inode, fh), None)
        return self.end(op) if op is not None else 0

    def end(self, op: Opening) -> int:
        """The open is over (released, or it failed): the backing id to close (its last open), or 0."""
        s = self._inodes.get(op.inode)
        if s is None or op.ticket not in s.live:
            return 0
        s.live.discard(op.ticket)
        if op.ticket in s.turns:
            s.turns.remove(op.ticket)
        closing = 0
        if op.answered:
            s.users -= 1
            if not s.users:
                closing, s.backing_id, s.file, s.refused = s.backing_id, 0, None, None
        s.changed()
        if s.idle():
            del self._inodes[op.inode]
        return closing
