"""A store directory: snapshots (stubs), packs, the chunk map, staging and temp dirs.

``Repository`` wires the pieces together for the FUSE layer, GC, fsck and the API. It knows
paths relative to ``snapshots/`` and nothing about inodes or requests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from . import stubs
from .chunker import Chunker
from .index import Index
from .packstore import PackStore, restrict
from .reader import ChunkCache, Fetcher
from .writer import FileContent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreSettings:
    chunk_min: int = 16 << 10
    chunk_avg: int = 64 << 10
    chunk_max: int = 256 << 10
    pack_size: int = 64 << 20
    readahead: int = 32 << 20
    prefetch_workers: int = 8
    cache_size: int = 256 << 20
    verify_reads: bool = True
    writeback_cache: bool = False  # the kernel's: it rewrites a file's last partial page
    durability: str = "close"  # "close": survives a killed daemon; "fsync": also power loss


class Repository:
    def __init__(self, root: Path, settings: StoreSettings | None = None) -> None:
        self.settings = settings = settings or StoreSettings()
        self.root = root
        self.snapshots = root / "snapshots"
        self.tmp = root / "tmp"
        self.staging = root / "staging"
        # Other users reach the snapshots only through the mount: the store itself is the daemon's
        # user's alone (snapshots/ keeps its mode, which the mount shows as its root's).
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        restrict(root, 0o700)
        for d in (self.snapshots, self.tmp, self.staging):
            d.mkdir(mode=0o700 if d != self.snapshots else 0o777, parents=True, exist_ok=True)
        restrict(self.tmp, 0o700)
        restrict(self.staging, 0o700)
        self.durable = settings.durability == "fsync"
        # Renames and unlinks of stubs hold ns_lock and bump ns_gen, so GC can tell that its walk
        # of snapshots/ raced with one (a renamed stub can be missed by a directory listing).
        self.ns_lock = threading.Lock()
        self.ns_gen = 0
        self.store = PackStore(root, settings.pack_size, durable=self.durable)
        self.chunker = self._chunker()
        self.cache = ChunkCache(settings.cache_size)
        self.fetcher = Fetcher(
            self.store, self.cache, settings.prefetch_workers, settings.readahead, settings.verify_reads
        )

    def _chunker(self) -> Chunker:
        """Chunk sizes are fixed per store at creation, so later saves keep deduplicating."""
        s = self.settings
        wanted = f"{s.chunk_min},{s.chunk_avg},{s.chunk_max}"
        stored = self.store.get_meta("chunk_params")
        if stored is None:
            self.store.set_meta("chunk_params", wanted)
            stored = wanted
        elif stored != wanted:
            log.warning("store %s was created with chunk sizes %s; ignoring configured %s", self.root, stored, wanted)
        cmin, cavg, cmax = (int(x) for x in stored.split(","))
        return Chunker(cmin, cavg, cmax)

    def empty_index(self) -> Index:
        return Index(self.chunker.min, self.chunker.avg, self.chunker.max)

    def path(self, rel: str) -> Path:
        return self.snapshots / rel if rel else self.snapshots

    def read_chunks(self, index: Index, offset: int, size: int) -> bytes:
        return self.fetcher.read(index, offset, size)

    def content(self, index: Index) -> FileContent:
        return FileContent(
            self.store,
            self.chunker,
            index,
            self.staging,
            self.read_chunks,
            keep_partial_page=self.settings.writeback_cache,
        )

    def load(self, rel: str) -> FileContent:
        """Content of an existing snapshot; raises StubError for a stub that is not an index."""
        with self.store.lock:  # read and pin as one step: GC's sweep cannot fall between them
            return self.content(stubs.read_index(self.path(rel)))

    def prepare_stub(self, index: Index, like: str | None) -> Path:
        like_path = self.path(like) if like is not None else None
        tmp = stubs.prepare(self.tmp, index, like_path, fsync=False)
        with contextlib.suppress(OSError):  # fsck's mark is about the old content, not this one
            os.removexattr(tmp, stubs.BROKEN, follow_symlinks=False)
        return tmp

    def install_stub(self, tmp: Path, rel: str) -> None:
        """The commit point of a save: the complete new stub replaces the old one."""
        with self.ns_lock:
            os.rename(tmp, self.path(rel))
            self.ns_gen += 1

    def close(self) -> None:
        self.fetcher.close()
        self.store.close()
