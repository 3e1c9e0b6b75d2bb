"""How an open file's content reads its chunks.

``ReadChunks`` is any reader of a file's stored bytes: tools, staging copies and appends read
through ``Files.read_chunks`` (each chunk checked against its id); a restore never reads this way,
it puts the whole file back (file/restore.py).
"""

from __future__ import annotations

from typing import Protocol

from kvchunkfs.format.index import Index


class ReadChunks(Protocol):
    """Bytes ``[offset, offset + size)`` of the file ``index`` names, from its chunks as stored.
    ``ahead``: ignored (readers read what they are asked for)."""

    def __call__(self, index: Index, offset: int, size: int, ahead: int | None = None) -> bytes: ...
