"""The async face of an open file: what the FUSE layer awaits for a handle's reads and writes.

A ``FileHandle`` is one open handle over the file's shared ``FileContent``. It owns the step a
write needs first (a whole file of the content's own: a copy, in a worker thread), and the read
fast path: on the event loop, a read
whose bytes are cached, or already put back from a stored group (chunker relayout), is answered
with no thread hop; anything else reads in a worker thread. No call here waits on the event loop
for a lock another thread holds across I/O: the content's ``cond`` is never held across I/O.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from kvchunkfs.file.content import FileContent, Mode
from kvchunkfs.file.fetcher import Cursor, Fetcher
from kvchunkfs.file.reader import HandleReader

log = logging.getLogger(__name__)

T = TypeVar("T")


async def _thread(fn: Callable[..., T], *args: Any) -> T:
    return await trio.to_thread.run_sync(fn, *args)


async def truncate(content: FileContent, size: int) -> None:
    """Truncate ``content`` (its file's writes, truncates and commits ordered by the caller); a
    content that is no whole file of its own is first copied into one, in a worker thread."""
    content.check_size(size)
    if not content.own_file():
        await _thread(content.to_staging, size)
    content.truncate(size)


class FileHandle:
    """One open handle: its reads (with a read-ahead cursor of its own) and writes over the shared content."""

    def __init__(self, content: FileContent, fetcher: Fetcher, lock: trio.Lock, name: Callable[[], str | None]) -> None:
        self.content = content
        self.fetcher = fetcher
        self.lock = lock  # the file's, shared by its handles: its writes, truncates and commits in order
        self.name = name  # the file's path now, for log lines
        self.cursor = Cursor()  # this handle's read-ahead
        if content.mode is Mode.CLEAN:
            self.cursor.locations = content.locations  # looked up once, at load
        self.reader = HandleReader(fetcher, self.cursor)

    async def write(self, offset: int, data: bytes | memoryview) -> None:
        """Apply one write, in arrival order with the file's others, to the whole file of the
        content's own (copied first, in a worker thread, if it has none). ``data`` may be a view of
        a buffer the caller reuses once this returns."""
        content = self.content
        async with self.lock:
            content.check_size(offset + len(data))
            if not content.own_file():
                log.info("%s: written, copying it into a file of its own first", self.name())
                await _thread(content.to_staging)
            content.write(offset, data)

    def read_ready(self, offset: int, size: int) -> bytes | memoryview | None:
        """The bytes if they can be answered on the event loop (no wait, no lock held across I/O):
        a restore's prefetched chunks, or a stored group's bytes already put back in file order."""
        content = self.content
        if content.mode is not Mode.CLEAN:
            return None
        if content.plain_range(offset, size):
            ahead = content.read_ahead_limit(offset + size)
            return self.fetcher.read_cached(content.index, offset, size, self.cursor, ahead)
        return content.decoded(offset, size)  # a re-laid-out group: the one put back in file order

    def plain_range(self, offset: int, size: int) -> tuple[int, int] | None:
        """The file a read may be copied from by the kernel: the whole file in memory (served
        mode), its descriptor and how many of the ``size`` bytes at ``offset`` it has (it may end
        first); None if the bytes are elsewhere (a whole file on disk is read in a worker thread)."""
        content = self.content
        fd = content.whole_fd()
        whole = content.whole
        if fd < 0 or whole is None or not whole.in_memory:
            return None
        return fd, max(0, min(size, os.fstat(fd).st_size - offset))

    async def read(self, offset: int, size: int) -> bytes | memoryview:
        content = self.content
        fd = content.whole_fd()
        if fd >= 0:  # a whole file (served mode): in memory, read here; else in a worker thread
            whole = content.whole
            if whole is not None and whole.in_memory:
                return os.pread(fd, size, offset)
            return await _thread(os.pread, fd, size, offset)
        data = self.read_ready(offset, size)
        if data is None and self.content.mode is Mode.CLEAN:
            data = await self._group_bytes(offset, size)
        if data is not None:
            return data
        return await _thread(self.content.read, offset, size, self.reader)

    async def _group_bytes(self, offset: int, size: int) -> bytes | memoryview | None:
        """A read of a group being put back: waited for on the event loop, woken by the decode,
        instead of in a worker thread (the hop there and back cost more than the wait itself);
        None if the bytes are not there when woken (the usual read then says why)."""
        token = trio.lowlevel.current_trio_token()
        woken = trio.Event()

        def wake() -> None:  # on the decode's thread
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(woken.set)

        if not self.content.when_ready(offset, size, wake):
            return self.read_ready(offset, size)
        await woken.wait()
        return self.read_ready(offset, size)
