"""The async face of an open file: what the FUSE layer awaits for a handle's reads and writes.

A ``FileHandle`` is one open handle over the file's shared ``FileContent``. It owns the step a
write needs first (a whole file of the content's own: a copy, in a worker thread). A read is a
read of the content's whole file: in the memory tier on the event loop, on disk in a worker
thread. No call here waits on the event loop for a lock another thread holds across I/O: the
content's ``cond`` is never held across I/O.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from kvchunkfs.file.content import FileContent

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
    """One open handle: its reads and writes over the shared content (nothing of its own to build)."""

    def __init__(self, content: FileContent, lock: trio.Lock, name: Callable[[], str | None]) -> None:
        self.content = content
        self.lock = lock  # the file's, shared by its handles: its writes, truncates and commits in order
        self.name = name  # the file's path now, for log lines

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

    def plain_range(self, offset: int, size: int) -> tuple[int, int] | None:
        """The file a read may be copied from by the kernel: the whole file in memory (served
        mode), its descriptor and how many of the ``size`` bytes at ``offset`` it has (it may end
        first); None if the bytes are elsewhere (a whole file on disk is read in a worker thread)."""
        content = self.content
        fd = content.whole_fd()
        whole = content.whole
        if fd < 0 or whole is None or not whole.in_memory or content.on_disk is not None:
            return None
        return fd, max(0, min(size, os.fstat(fd).st_size - offset))

    async def read(self, offset: int, size: int) -> bytes | memoryview:
        content = self.content
        fd = content.whole_fd()
        if fd >= 0:  # a whole file (served mode): in memory, read here; else in a worker thread
            whole = content.whole
            if whole is not None and whole.in_memory and content.on_disk is None:
                return os.pread(fd, size, offset)
            return await _thread(os.pread, fd, size, offset)
        # No whole file (an in-process user without a memory tier): read from its chunks.
        return await _thread(content.read, offset, size, content.read_chunks)
