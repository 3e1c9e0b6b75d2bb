"""The interface the file layer uses to store and fetch chunks.

``PackStore`` (local packs + map) implements it. The shared tier on S3 (``store/remote.py``) is not
a second implementation: the read path needs the local map (locations, runs of back-to-back chunks),
so the tier keeps the local packs as its cache, brings a snapshot's missing chunks into them when it
is opened (``Files.load``) and uploads behind the saves; this interface and the save path are
unchanged by it (docs/design.md, "The remote tier").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

Chunk = tuple[bytes, bytes | memoryview]  # (SHA-256 id, bytes)


class ChunkStore(Protocol):
    def has(self, ids: Iterable[bytes]) -> set[bytes]:
        """The ids of ``ids`` the store holds."""
        ...

    def put_many(self, chunks: Sequence[Chunk], owner: object) -> int:
        """Store the chunks the store lacks, pin all of them for ``owner``; returns new bytes written.

        Raises OSError (e.g. ENOSPC) with nothing of the failing batch committed.
        """
        ...

    def get_many(self, ids: Sequence[bytes]) -> list[bytes]:
        """The bytes of each id, in order; ChunkMissing / ChunkCorrupt if one cannot be returned."""
        ...

    def pin(self, owner: object, ids: Iterable[bytes]) -> None:
        """Keep ``ids`` from garbage collection until ``unpin(owner)`` (an open file's chunks)."""
        ...

    def unpin(self, owner: object) -> None: ...

    def sync(self) -> None:
        """Make every chunk stored so far durable."""
        ...
