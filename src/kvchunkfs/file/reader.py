"""How an open file's content reads its chunks.

``ReadChunks`` is any reader of a file's stored bytes: tools, staging copies and resumes read
through the fetcher with no read-ahead of their own. ``HandleReader`` is an open handle's: the same
reads through its cursor (read-ahead), plus a group's chunks streamed straight off the packs
(``stream``) and a cursor of its own for a decode running ahead on another thread (``detached``);
relayout reads use both when they have one (file/groups.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from kvchunkfs.file.fetcher import Cursor, Fetcher
from kvchunkfs.format.index import Index


class ReadChunks(Protocol):
    """Bytes ``[offset, offset + size)`` of the file ``index`` names, from its chunks as stored.
    ``ahead``: the offset read-ahead stops at (None: the reader's own window), so reads around a
    stored group leave the group's chunks to its decode, which streams them itself."""

    def __call__(self, index: Index, offset: int, size: int, ahead: int | None = None) -> bytes: ...


class HandleReader:
    """An open handle's reads: ``(index, offset, size) -> bytes`` through its cursor, and ``stream``
    (a group's chunks in order, for its decode)."""

    def __init__(self, fetcher: Fetcher, cursor: Cursor | None) -> None:
        self.fetcher, self.cursor = fetcher, cursor

    def __call__(self, index: Index, offset: int, size: int, ahead: int | None = None) -> bytes:
        return self.fetcher.read(index, offset, size, self.cursor, ahead)

    def stream(self, index: Index, offset: int, end: int) -> Iterator[memoryview]:
        """``Fetcher.stream`` with the locations looked up at open."""
        return self.fetcher.stream(index, offset, end, self.cursor.locations if self.cursor is not None else None)

    def detached(self) -> HandleReader:
        """The same reads through a cursor of their own (a decode ahead, on another thread): the
        handle's stays where its reads left it; the chunk locations looked up at open are shared."""
        locations = self.cursor.locations if self.cursor is not None else None
        return HandleReader(self.fetcher, Cursor(locations=locations))
