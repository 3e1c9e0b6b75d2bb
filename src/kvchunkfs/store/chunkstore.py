"""The narrow interfaces the layers above use the store through (as desync's Store / WriteStore /
PruneStore): ``ChunkStore`` for a file's content (store, pin, fetch), ``ChunkReader`` for a
put-back's reads (locate, read runs), ``PruneStore`` for garbage collection (sweep rows, reclaim packs).

``PackStore`` (local packs + map) implements all three. The shared tier on S3 (``store/remote.py``) is not
a second implementation: the read path needs the local map (locations, runs of back-to-back chunks),
so the tier keeps the local packs as its cache, brings a snapshot's missing chunks into them when it
is opened (``Files.load``) and uploads behind the saves; these interfaces and the save path are
unchanged by it (docs/design.md, "The remote tier").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvchunkfs.format.index import Index
from kvchunkfs.store.chunkmap import Location

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

    def pin_index(self, owner: object, index: Index) -> None:
        """``pin`` of the chunks ``index`` names (kept as the index: no object per chunk)."""
        ...

    def unpin(self, owner: object) -> None: ...

    def sync(self) -> None:
        """Make every chunk stored so far durable."""
        ...


class ChunkReader(Protocol):
    """What a put-back (``file/restore.py``) reads through."""

    def locate_many(self, ids: Iterable[bytes]) -> dict[bytes, Location]:
        """Where each of ``ids`` the map knows lies (ids it lacks are left out)."""
        ...

    def read_run_placed(
        self, pack: int, offset: int, length: int, room: memoryview, piece: int
    ) -> Iterator[tuple[memoryview, int]]:
        """Read ``length`` bytes of ``pack`` at ``offset`` into ``room`` (``direct.SLACK`` bytes
        larger lets cold bytes be read with O_DIRECT), yielding (the run's bytes, a view of
        ``room``; how many are in place) after each read."""
        ...

    def get_many(self, ids: Sequence[bytes]) -> list[bytes]:
        """The bytes of each id, each read and checked on its own."""
        ...


class PruneStore(Protocol):
    """What garbage collection (``maint/gc.py``) asks of the store: the sweep of map rows under
    ``lock`` and the reclaiming of packs (delete, trim, compact into packs of its own)."""

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """Held by the sweep; saves check and pin under it (docs/design.md, "Garbage collection and pins")."""
        ...

    @property
    def pack_size(self) -> int: ...

    @property
    def open_pack(self) -> int | None:
        """The pack saves append to: GC leaves it alone unless it ``seal``s it."""
        ...

    # the sweep
    def chunk_lengths(self) -> dict[bytes, int]: ...
    def mapped_pages(self) -> Iterator[tuple[np.ndarray, np.ndarray]]: ...
    def ids_with_keys(self, keys: Iterable[bytes]) -> list[bytes]: ...
    def stats(self) -> tuple[int, int]: ...
    def pinned(self) -> set[bytes]: ...
    def is_pinned(self, cid: bytes) -> bool: ...
    def delete_chunks(self, ids: Iterable[bytes]) -> int: ...
    def drop_rows(self, ids: Iterable[bytes]) -> list[tuple[int, int]]: ...
    def take_fresh(self) -> set[bytes] | None: ...
    def requeue_fresh(self, ids: Iterable[bytes]) -> None: ...

    # the packs
    def pack_ids(self) -> list[int]: ...
    def pack_path(self, pack: int) -> Path: ...
    def pack_usage(self, packs: Iterable[int] | None = None) -> dict[int, tuple[int, int, int]]: ...
    def chunks_in_pack(self, pack: int) -> list[tuple[bytes, int, int]]: ...
    def revisit(self, packs: Iterable[int]) -> None: ...
    def take_revisit(self) -> set[int]: ...
    def seal(self, pack: int) -> bool: ...
    def trim_pack(self, pack: int) -> int: ...
    def remove_pack(self, pack: int) -> bool: ...
    def create_pack(self) -> tuple[int, int]: ...
    def move_chunks(self, old_pack: int, moves: Sequence[tuple[bytes, int, int]], new_end: tuple[int, int]) -> int: ...
