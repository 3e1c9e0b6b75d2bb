"""Chunk store: append-only pack files plus the chunk map (``chunkmap``), pins, and the reads.

Packs are the truth, the map is a cache. Saves append through the pack writer (``packwriter``): a
batch record listing the chunks (``packformat``) and their bytes are written at the open pack's
known end first, then the map rows and the pack's new committed end (table ``packs``) are committed
in one transaction. A crash between the two leaves a described batch past the committed end, which
recovery adds to the map. A map row therefore never points at bytes that were not written, and
the map can always be rebuilt from the packs (docs/design.md, "Saving: the order of writes").

Pins protect chunks that open files use but no stub names yet (a save in progress, a file that
was unlinked while open). Garbage collection treats pinned ids as live; the existence check and
the pin of a save happen under ``lock``, the same lock GC holds while it deletes map rows, so a
chunk found in the store cannot vanish before the stub that names it is renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from kvchunkfs.format.index import Index
from kvchunkfs.store import direct
from kvchunkfs.store.chunkmap import UPSERT_END, ChunkMap, ChunkMissing, Location, os_error
from kvchunkfs.store.layout import Layout, fsync_dir
from kvchunkfs.store.packformat import PACK_HEADER_SIZE, Described
from kvchunkfs.store.packwriter import Batch, PackWriter, create_pack_file

__all__ = ["ChunkCorrupt", "ChunkMissing", "Location", "PackStore", "StoreCounters", "quick_sum"]

log = logging.getLogger(__name__)

MAX_FDS = 64  # read fds kept open (least recently used idle ones are closed)
FRESH_MAX = 1 << 18  # new ids kept for GC between collections (~30 MB; 16 GB of 64 KiB chunks)


class ChunkCorrupt(ValueError):
    """Chunk bytes read from a pack do not hash to their id."""


def quick_sum(data: bytes | memoryview) -> bytes:
    """The map's check of a chunk's bytes (xxh3-64, ~9x faster than SHA-256 here): local reads
    compare it instead of re-hashing the id. It guards against what a re-hash would (bytes changed
    on disk, a row pointing at the wrong bytes); not against a forger, who would need write access
    to the store, packs and map alike (see the threat model)."""
    return xxhash.xxh3_64_digest(data)


@dataclass
class StoreCounters:
    """Monotonic counters for metrics and tests (bytes and reads that reached disk).

    Worker threads update them concurrently: always through ``add`` (``x += n`` is a read and a
    write, and two threads can lose one of the updates). Readers may read fields without the lock.
    """

    chunks_written: int = 0
    bytes_written: int = 0
    chunks_deduped: int = 0
    bytes_deduped: int = 0
    pack_reads: int = 0
    pack_bytes_read: int = 0
    direct_reads: int = 0  # pack reads that bypassed the page cache (O_DIRECT)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, n in amounts.items():
                setattr(self, name, getattr(self, name) + n)


class _PackFd:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.direct: int | None = None  # the pack's O_DIRECT fd, opened at its first cold read
        self.direct_tried = False
        self.users = 0
        self.retired = False

    def close(self) -> None:
        os.close(self.fd)
        if self.direct is not None:
            os.close(self.direct)


class PackStore(ChunkMap):
    """The store's packs and map as one: saves (``put_many``), pins, GC's and recovery's steps on
    packs and rows, and the read fds. The map's queries are ``ChunkMap``'s."""

    def __init__(self, root: Path, pack_size: int = 64 << 20, durable: bool = False, max_fds: int = MAX_FDS) -> None:
        self.root = root
        self.layout = Layout(root)
        self.packs_dir = self.layout.packs
        self.layout.create_dirs()
        self.layout.make_private()  # every snapshot's bytes: the daemon's user only
        self.pack_size = pack_size
        self.lock = threading.RLock()  # map writes, pack appends, pins, GC sweep
        self._fd_lock = threading.Lock()
        self._fds: OrderedDict[int, _PackFd] = OrderedDict()  # least recently used first
        self.max_fds = max_fds
        # Cold pack bytes read with O_DIRECT on a local disk's file system (off if it refuses).
        self.direct_reads = direct.local_disk(self.packs_dir) is not None
        super().__init__(self.layout.db, durable, self.pack_ids)
        self._writer = PackWriter(self.create_pack, pack_size, fsync=durable)  # the pack saves append to
        self._unsynced: set[int] = set()  # packs written since the last sync()
        self.pins: dict[object, set[bytes]] = {}
        # An open file's chunks, pinned as its index (a copy sharing the table): no object per chunk.
        self.index_pins: dict[object, list[Index]] = {}
        self.counters = StoreCounters()
        # Ids mapped since GC last took them (under ``lock``): with the catalog's dropped ids, what
        # a collection of the changes looks at (maint/gcchanges.py). None once too many piled up: the
        # next collection must walk every stub.
        self._fresh: set[bytes] | None = set()
        self._revisit: set[int] = set()  # packs with dead bytes GC left alone (e.g. the open one)
        # Bumped whenever rows of chunks a snapshot may name are dropped (eviction to the shared
        # tier): locations remembered from before (``Files``' reopen cache) may now lack chunks.
        self.drop_gen = 0

    def pack_ids(self) -> list[int]:
        return self.layout.pack_ids()

    def pack_path(self, pack: int) -> Path:
        return self.layout.pack_path(pack)

    # -- GC's bookkeeping -------------------------------------------------------------------

    def take_fresh(self) -> set[bytes] | None:
        """The ids mapped since the last call (None: too many to have kept; walk every stub)."""
        with self.lock:
            fresh, self._fresh = self._fresh, set()
        return fresh

    def revisit(self, packs: Iterable[int]) -> None:
        """Packs a later GC should look at again (dead bytes it could not reclaim yet)."""
        with self.lock:
            self._revisit.update(packs)

    def take_revisit(self) -> set[int]:
        with self.lock:
            packs, self._revisit = self._revisit, set()
        return packs

    def _note_fresh(self, ids: Iterable[bytes]) -> None:
        """Under ``lock``."""
        if self._fresh is not None:
            self._fresh.update(ids)
            if len(self._fresh) > FRESH_MAX:
                self._fresh = None

    def evict_chunks(self, ids: Sequence[bytes]) -> tuple[int, int]:
        """Drop the rows of ``ids`` that are not pinned (eviction: the chunks are safely in the
        shared tier); returns (rows dropped, their bytes). Call under ``lock`` after checking that no
        stub appeared meanwhile (as GC's sweep does). The pack bytes become dead space that
        compaction gives back; the open pack is closed first if it holds one of them, so that
        compaction may touch it (saves simply start a new pack)."""
        with self.lock:
            pinned = self.pinned()
            drop = [cid for cid in ids if cid not in pinned]
            if not drop:
                return 0, 0
            found = self.locate_many(drop)
            if self._writer.pack is not None and any(loc.pack == self._writer.pack for loc in found.values()):
                self._writer.close()
            n = self.delete_chunks(drop)
            self.drop_gen += 1
            return n, sum(loc.length for loc in found.values())

    def move_chunks(self, old_pack: int, moves: Sequence[tuple[bytes, int, int]], new_end: tuple[int, int]) -> int:
        """Point rows at copies (id, new pack, new offset), each only if it is still in ``old_pack``.

        ``new_end``: (new pack, end of the copied batch), committed with the rows. Durable even with
        durability=close: the old pack is deleted next, and a power failure must not bring back rows
        that point into it.
        """
        sql = "UPDATE chunks SET pack = ?, offset = ? WHERE id = ? AND pack = ?"
        with self.lock:
            steps: list[tuple[str, Sequence[tuple[Any, ...]]]] = [
                (sql, [(pack, off, cid, old_pack) for cid, pack, off in moves]),
                (UPSERT_END, [new_end]),
            ]
            return self._commit(steps, durable=True) - 1

    def adopt(self, pack: int, chunks: Sequence[Described], end: int, replace: Iterable[bytes] = ()) -> int:
        """Map described chunks the map lacks (ids in ``replace``: overwrite their bad rows) and
        record ``end`` as the pack's committed end; returns the rows added or replaced."""
        bad = set(replace)
        rows = [(c.id, pack, c.offset, c.length) for c in chunks]
        sql = "INSERT OR {} INTO chunks (id, pack, offset, length) VALUES (?,?,?,?)"
        steps = [
            (sql.format("REPLACE"), [r for r in rows if r[0] in bad]),
            (sql.format("IGNORE"), [r for r in rows if r[0] not in bad]),
        ]
        with self.lock:
            added = self._commit([*steps, (UPSERT_END, [(pack, end)])]) - 1
            self._note_fresh(r[0] for r in rows)  # adopted rows may name no snapshot: GC looks at them
            self._map_stats = None  # replaced rows change lengths: count again when asked
            return added

    def trim_pack(self, pack: int) -> int:
        """Cut the dead bytes after the last mapped chunk of a closed pack; returns the bytes cut."""
        with self.lock:
            if pack == self._writer.pack:
                return 0
            end = self.mapped_end(pack)
            path = self.pack_path(pack)
            size = path.lstat().st_size
            if end == 0 or size <= end:
                return 0
            self._commit([("UPDATE packs SET end = min(end, ?) WHERE pack = ?", [(end, pack)])])
            self.truncate_pack(pack, end)
            return size - end

    def truncate_pack(self, pack: int, length: int) -> None:
        """Cut a pack file to ``length`` bytes; never through a symlink."""
        fd = os.open(self.pack_path(pack), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, length)
        finally:
            os.close(fd)

    def remove_pack(self, pack: int) -> bool:
        """Delete a pack no row points into (never the open one, never one the map does not know,
        e.g. a legacy pack after chunks.db was lost); False if it is kept."""
        with self.lock:
            used, known = self.pack_state(pack)
            if pack == self._writer.pack or used or not known:
                return False
            self._check_db()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.pack_path(pack))
            self.forget_pack(pack)
        self.retire_pack(pack)
        return True

    # -- the ChunkStore interface (store/chunkstore.py) ----------------------------------------

    def has(self, ids: Iterable[bytes]) -> set[bytes]:
        return set(self.locate_many(ids))

    def get_many(self, ids: Sequence[bytes]) -> list[bytes]:
        """Each chunk read and checked on its own (a put-back reads runs instead: file/restore.py)."""
        found = self.locate_many(ids)
        out = []
        for cid in ids:
            loc = found.get(cid)
            if loc is None:
                raise ChunkMissing(cid.hex())
            data = self.read_run(loc.pack, loc.offset, loc.length)
            if hashlib.sha256(data).digest() != cid:
                raise ChunkCorrupt(f"chunk {cid.hex()} in pack {loc.pack} at {loc.offset} fails its checksum")
            out.append(data)
        return out

    # -- writing ----------------------------------------------------------------------------

    def put_many(self, chunks: Sequence[tuple[bytes, bytes | memoryview]], owner: object) -> int:
        """Store the chunks the store lacks and pin all of them for ``owner``.

        Returns the number of new bytes written. Raises OSError (e.g. ENOSPC) with nothing
        committed for the failing batch; chunks already in the store are still pinned.
        """
        with self.lock:
            pinned = self.pins.setdefault(owner, set())
            pinned.update(cid for cid, _ in chunks)
            self._check_db()  # also a save that finds every chunk: its stub would name a lost map's rows
            try:
                present = self.locate_many(cid for cid, _ in chunks)
            except sqlite3.Error as e:  # callers (the chunker thread) handle OSError only
                raise os_error(e) from e
            new: dict[bytes, bytes | memoryview] = {}
            for cid, data in chunks:
                if cid in present or cid in new:
                    self.counters.add(chunks_deduped=1, bytes_deduped=len(data))
                else:
                    new[cid] = data
            if new:
                self._writer.append_fitting(list(new.items()), self._append_batch)
            return sum(len(d) for d in new.values())

    def _append_batch(self, batch: Batch) -> None:
        """The pack writer's commit of a saved batch: its rows (with their quick sums), then the
        counters. A map failure is the OSError callers handle, so the writer cuts the batch off."""
        rows = [
            (cid, batch.pack, off, len(data), quick_sum(data))
            for (cid, data), off in zip(batch.chunks, batch.offsets, strict=True)
        ]
        try:
            self._insert_rows(rows, batch.pack, batch.end)
        except sqlite3.Error as e:
            raise os_error(e) from e
        self._unsynced.add(batch.pack)
        self.counters.add(chunks_written=len(rows), bytes_written=sum(r[3] for r in rows))

    def _insert_rows(self, rows: list[tuple[bytes, int, int, int, bytes]], pack: int, end: int) -> None:
        """The batch's rows and the pack's new committed end, in one transaction."""
        self._add_rows(rows, pack, end)  # put_many found none of these ids in the map under ``lock``
        self._note_fresh(r[0] for r in rows)

    def create_pack(self) -> tuple[int, int]:
        """A new pack holding just its header (number, write fd), under a number never used before.

        Numbers of deleted packs are not reused: a reader that located a chunk in a pack GC
        deleted must get FileNotFoundError and look again, not read another pack's bytes. The
        pack is known to the map (table ``packs``) before its file exists.
        """
        with self.lock:
            ids = self.pack_ids()
            try:
                pack = max(int(self.get_meta("last_pack") or 0), ids[-1] if ids else 0) + 1
                self._commit(
                    [
                        ("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", [("last_pack", str(pack))]),
                        ("INSERT OR REPLACE INTO packs (pack, end) VALUES (?, ?)", [(pack, PACK_HEADER_SIZE)]),
                    ]
                )
            except sqlite3.Error as e:
                raise os_error(e) from e
            return pack, create_pack_file(self.pack_path(pack))

    @property
    def open_pack(self) -> int | None:
        """The pack new chunks go to; GC never touches it (it may ``seal`` it first)."""
        return self._writer.pack

    def seal(self, pack: int) -> bool:
        """Stop appending to ``pack`` if it is still the open one: the next batch starts a new pack,
        and GC may delete, trim or compact this one like any other. False if it was not open."""
        with self.lock:  # appends hold it: none is writing to the fd being closed
            if self._writer.pack != pack:
                return False
            self._writer.close()
            return True

    def sync(self) -> None:
        """Make every chunk written so far durable (pack data, then the map). The fsyncs run
        outside ``lock`` (opens and saves go on meanwhile): a pack written to while they run is
        synced again next time."""
        with self.lock:
            packs = sorted(self._unsynced)
            self._unsynced.clear()
        try:
            for pack in packs:
                with contextlib.suppress(FileNotFoundError), self.pack_fd(pack) as fd:
                    os.fsync(fd)
            self.checkpoint_map()
            fsync_dir(self.packs_dir)
        except BaseException:
            with self.lock:
                self._unsynced.update(packs)
            raise

    # -- pins -------------------------------------------------------------------------------

    def pin(self, owner: object, ids: Iterable[bytes]) -> None:
        with self.lock:
            self.pins.setdefault(owner, set()).update(ids)

    def pin_index(self, owner: object, index: Index) -> None:
        """``pin`` of every chunk ``index`` names now (later changes to it do not change the pin)."""
        frozen = index.copy()
        with self.lock:
            self.index_pins.setdefault(owner, []).append(frozen)

    def unpin(self, owner: object) -> None:
        with self.lock:
            self.pins.pop(owner, None)
            self.index_pins.pop(owner, None)

    def pinned(self) -> set[bytes]:
        with self.lock:
            out: set[bytes] = set()
            for ids in self.pins.values():
                out |= ids
            for indexes in self.index_pins.values():
                for index in indexes:
                    out.update(index.ids)
            return out

    def is_pinned(self, cid: bytes) -> bool:
        """Under ``lock`` (GC's sweep): one lookup per pin owner, not a union of every pin. A pinned
        index may answer yes for an id it does not hold (``Index.might_hold``): the chunk stays."""
        if any(cid in ids for ids in self.pins.values()):
            return True
        return any(index.might_hold(cid) for indexes in self.index_pins.values() for index in indexes)

    def requeue_fresh(self, ids: Iterable[bytes]) -> None:
        """Give ids back to the next ``take_fresh`` (GC could not decide on them this time)."""
        with self.lock:
            self._note_fresh(ids)

    # -- reading ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def pack_fd(self, pack: int) -> Iterator[int]:
        """A read fd for ``pack`` that stays valid even if GC deletes the pack meanwhile.

        At most ``max_fds`` are cached: opening one more closes the least recently used fd that
        no reader holds (a store has far more packs than a process may have fds).
        """
        with self._pack_entry(pack) as entry:
            yield entry.fd

    @contextlib.contextmanager
    def _pack_entry(self, pack: int) -> Iterator[_PackFd]:
        with self._fd_lock:
            entry = self._fds.get(pack)
            if entry is None:
                entry = _PackFd(os.open(self.pack_path(pack), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
                self._fds[pack] = entry
            else:
                self._fds.move_to_end(pack)
            entry.users += 1
            self._evict_idle()
        try:
            yield entry
        finally:
            with self._fd_lock:
                entry.users -= 1
                if entry.retired and entry.users == 0:
                    entry.close()

    def _direct_fd(self, pack: int, entry: _PackFd) -> int | None:
        """``entry``'s O_DIRECT fd, opened once; None where direct reads are off or refused."""
        if not self.direct_reads:
            return None
        with self._fd_lock:
            if entry.direct_tried:
                return entry.direct
            entry.direct_tried = True
        fd = direct.open_direct(self.pack_path(pack))
        if fd is None:
            log.info("%s refuses direct reads: reading packs through the page cache", self.packs_dir)
            self.direct_reads = False
        with self._fd_lock:
            if entry.retired:  # closed meanwhile (GC deleted the pack): this read goes on without it
                if fd is not None:
                    os.close(fd)
                return None
            entry.direct = fd
        return fd

    def _evict_idle(self) -> None:
        """Under ``_fd_lock``: close idle fds, oldest first, until the cache fits ``max_fds``."""
        excess = len(self._fds) - self.max_fds
        for pack in [p for p, e in self._fds.items() if e.users == 0][: max(0, excess)]:
            self._fds.pop(pack).close()

    def retire_pack(self, pack: int) -> None:
        """Forget the cached fd of a deleted pack; readers holding it finish first."""
        with self._fd_lock:
            entry = self._fds.pop(pack, None)
            if entry is not None:
                entry.retired = True
                if entry.users == 0:
                    entry.close()

    def read_run(self, pack: int, offset: int, length: int) -> bytes:
        with self.pack_fd(pack) as fd:
            data = os.pread(fd, length, offset)
        if len(data) != length:
            raise OSError(errno.EIO, f"pack {pack} is short: wanted {length} bytes at {offset}, got {len(data)}")
        self.counters.add(pack_reads=1, pack_bytes_read=length)
        return data

    def read_run_placed(
        self, pack: int, offset: int, length: int, room: memoryview, piece: int
    ) -> Iterator[tuple[memoryview, int]]:
        """Read the pack's ``length`` bytes from ``offset`` into ``room`` (at least ``length +
        direct.SLACK`` bytes for a direct read, else ``length``), ``piece`` bytes a read. Yields
        (the run's bytes: a view of ``room``, how many of them are in place) after each read, so a
        reader may use a run's first chunks while the rest is still on its way.

        Bytes the page cache does not hold are read with O_DIRECT (``store/direct.py``); the rest
        with plain preads, whose sequential pattern the kernel's read-ahead keeps streaming. No
        WILLNEED hint: announcing a whole run first made cold reads slower, not faster."""
        with self._pack_entry(pack) as entry:
            fd = entry.fd
            dfd = self._direct_fd(pack, entry) if length else None
            at = direct.place(room, offset, length) if dfd is not None else None
            out, done = (at.run if at is not None else room[:length]), 0
            if at is not None and dfd is not None and not direct.resident(fd, offset, length):
                try:
                    for _, done in self._read_direct(dfd, pack, offset, length, at, piece):
                        yield out, done
                    self.counters.add(pack_reads=1, pack_bytes_read=length, direct_reads=1)
                    return
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    log.warning("direct read of pack %d refused (%s): reading through the page cache", pack, e)
                    self.direct_reads = False
            # The rest the usual way, into the same view: readers may hold views of its first bytes.
            if not length:
                yield out, 0  # a run of empty chunks is in place at once
            while done < length:
                n = os.preadv(fd, [out[done : min(length, done + piece)]], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"pack {pack} is short: wanted {length} bytes at {offset}, got {done}")
                done += n
                yield out, done
        self.counters.add(pack_reads=1, pack_bytes_read=length)

    @staticmethod
    def _read_direct(
        fd: int, pack: int, offset: int, length: int, at: direct.Placement, piece: int
    ) -> Iterator[tuple[memoryview, int]]:
        """``read_run_placed``'s direct reads: the aligned span, whole blocks ``piece`` (rounded
        up to a block) at a time; the last read may end short at the pack's end."""
        step = max(direct.ALIGN, -(-piece // direct.ALIGN) * direct.ALIGN)
        head = offset - at.start
        got = 0  # bytes of the span in place
        while head + length > got:
            n = os.preadv(fd, [at.span[got : got + step]], at.start + got)
            if n <= 0:
                have = max(0, got - head)
                raise OSError(errno.EIO, f"pack {pack} is short: wanted {length} bytes at {offset}, got {have}")
            got += n
            yield at.run, min(length, max(0, got - head))

    def close(self) -> None:
        with self.lock:
            self._writer.close()
        with self._fd_lock:
            for entry in self._fds.values():
                entry.close()
            self._fds.clear()
        self.close_map()
