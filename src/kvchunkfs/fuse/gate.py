"""A node's path gate: its stub renamed in a worker thread, never under a call that uses its path.

A rename (or an unlink) waits in the file system for as long as its journal makes it (measured:
up to ~40 ms behind the fsyncs of a checkpoint), so it runs in a worker thread, not on the trio
thread where it would stall every other request. While it runs, the node's path is neither the old
one nor the new one for sure; calls that use the path — a ``stat``, an open's load, a commit's
stub install, metadata changes — wait for it, and a rename waits for calls that use the path
across an await (an open's load in a thread). The kernel already orders a rename with the other
changes of the same directories; the gate orders it with the calls by inode, which it does not.

All of it runs on the trio thread: the counts need no lock, and the waits are trio events, so a
wait never blocks the thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


class PathGate:
    """Shared use of a node's path, or one change of it at a time; changes go first."""

    def __init__(self) -> None:
        self.users = 0  # calls using the path across an await
        self.moving = False
        self.waiting = 0  # changes waiting for the users to finish: new users wait behind them
        self._changed = trio.Event()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def settled(self) -> None:
        """Return once no change of the path runs or waits; a caller that does not await before
        it is done with the path needs nothing more."""
        while self.moving or self.waiting:
            await self._changed.wait()

    @asynccontextmanager
    async def use(self) -> AsyncIterator[None]:
        """Use the path across awaits: no change of it starts meanwhile."""
        await self.settled()
        self.users += 1
        try:
            yield
        finally:
            self.users -= 1
            if self.waiting:  # only a change waits for users
                self._wake()

    @asynccontextmanager
    async def change(self) -> AsyncIterator[None]:
        """Change the path (a rename in a thread): alone, once the users are done."""
        self.waiting += 1
        try:
            while self.moving or self.users:
                await self._changed.wait()
        finally:
            self.waiting -= 1
            self._wake()  # cancelled: the users it held back go on
        self.moving = True
        try:
            yield
        finally:
            self.moving = False
            self._wake()
