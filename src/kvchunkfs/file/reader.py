"""How an open file's content reads its chunks.

``ReadChunks`` is any ``(index, offset, size) -> bytes``: tools, staging copies and resumes read
through the fetcher with no read-ahead of their own. ``HandleReader`` is an open handle's: the same
reads through its cursor (read-ahead), plus the chunks' own buffers (``views``) and a cursor of its
own for a decode running ahead on another thread (``detached``); relayout reads use both when they
have one (file/groups.py).
"""

from __future__ import annotations

from collections.abc import Callable

from kvchunkfs.file.fetcher import Cursor, Fetcher
from kvchunkfs.format.index import Index

ReadChunks = Callable[[Index, int, int], bytes]


class HandleReader:
    """An open handle's reads: ``(index, offset, size) -> bytes``, and ``views`` (the same bytes
    as the chunks' own buffers, for a group to be put back without joining it first)."""

    def __init__(self, fetcher: Fetcher, cursor: Cursor | None) -> None:
        self.fetcher, self.cursor = fetcher, cursor

    def __call__(self, index: Index, offset: int, size: int) -> bytes:
        return self.fetcher.read(index, offset, size, self.cursor)

    def views(self, index: Index, offset: int, size: int) -> list[memoryview]:
        return self.fetcher.read_views(index, offset, size, self.cursor)

    def detached(self) -> HandleReader:
        """The same reads through a cursor of their own (a decode ahead, on another thread): the
        handle's stays where its reads left it; the chunk locations looked up at open are shared."""
        locations = self.cursor.locations if self.cursor is not None else None
        return HandleReader(self.fetcher, Cursor(locations=locations))
