"""Open-file services over a ``Repository``: file contents, loads (a whole file for every open of
a snapshot: file/restore.py), and the save protocol.

A save, in the order docs/design.md requires: store the whole file (pack bytes, then map rows:
``prepare_save``, file/chunking.py), sync packs and map if durable, write the complete new stub
under ``tmp/``, then rename it over the snapshot (``finish_save``). Every step blocks; callers run
it in a thread.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import sqlite3
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchunkfs.file.buffers import BufferPool
from kvchunkfs.file.content import FileContent
from kvchunkfs.file.filesums import FileChecks
from kvchunkfs.file.predict import Successors
from kvchunkfs.file.queues import InFlight
from kvchunkfs.file.restore import Restore
from kvchunkfs.format import filerecord, relayout
from kvchunkfs.format.filerecord import FileRecord
from kvchunkfs.format.index import Index
from kvchunkfs.store import stubs
from kvchunkfs.store.layout import fsync_dir
from kvchunkfs.store.packs import ChunkCorrupt, Location
from kvchunkfs.store.repository import Repository
from kvchunkfs.store.stubs import StubError
from kvchunkfs.store.wholefiles import WholeFiles

log = logging.getLogger(__name__)

BUFFER_SIZES_KEY = "restore_buffers"  # map meta: the pool's buffer sizes at the last unmount
LOADS_KEPT = 8  # recently opened snapshots whose checked index and chunk locations are remembered
CHECK_BATCH = 16384  # chunks of a large index looked up (and checked) at a time at open
HASHED_READ = 1 << 20  # a larger stub is first only hashed: a reopen need not hold its bytes
# Up to this many chunks (a 4 GiB file of 64 KiB chunks), a file's chunks are looked up all at once
# at open and the locations kept for its put-back (~280 bytes a chunk); a larger file's at put-back.
LOCATE_ALL = 65536


@dataclass
class PendingSave:
    """A save whose chunks are stored and whose new stub waits under ``tmp/`` for its rename."""

    content: FileContent
    index: Index
    gen: int
    tmp: Path | None  # None: the file was unlinked, nothing to install
    durable: bool
    record: FileRecord | None = None

    @property
    def new_bytes(self) -> int:
        return self.content.take_new_bytes()


class Files:
    def __init__(self, repo: Repository) -> None:
        s = repo.settings
        self.repo = repo
        # cache_size bounds the buffers restores and saves reuse (file/buffers.py): the pieces a
        # put-back reads, a save's batches joined and groups re-laid out for storing.
        self.buffers = BufferPool(s.cache_size)
        pool = self.buffers
        repo.chunker.alloc = lambda n: pool.take(n, brief=True)  # a save's groups are re-laid out there too
        self.restore = Restore(repo, self.buffers, s.prefetch_workers, s.verify_reads)
        # Reopening a snapshot (a warm restore, a client's open/stat/close) skips decoding and the
        # whole-file map lookup. Locations may go stale (GC moves chunks): a put-back relocates,
        # as for locations looked up at open. Only touched under store.lock, in load.
        # Keyed by path, valid while the stub's bytes are the same (their SHA-256 compared, with the
        # file record's and the staged mark's). Also keyed by the store's ``drop_gen``: eviction
        # drops rows a remembered load relied on. The index is a copy sharing the open's table.
        self._loaded: OrderedDict[str, tuple[bytes, int, Index, dict[bytes, Location]]] = OrderedDict()
        # The chunk that followed each recently cut chunk: a next turn's save takes those bytes
        # without cutting them (file/predict.py).
        self.successors = Successors() if s.predict_chunks else None
        self.checks = FileChecks()  # saves stored in file order, checksum mismatches (metrics)
        self.restores = InFlight()  # clients' loads under way: the warm-up waits for them (file/warmup.py)

    def read_chunks(self, index: Index, offset: int, size: int, ahead: int | None = None) -> bytes:
        """Bytes ``[offset, offset + size)`` of the stored stream ``index`` names (short at its
        end), each chunk read from its pack and checked against its id and the index's length.
        For tools, appends and copies of a file being written: a restore puts the whole file back."""
        end = min(offset + size, index.size)
        if offset >= end:
            return b""
        first, last = index.find(offset), index.find(end - 1)
        datas = self.repo.store.get_many(index.ids[first : last + 1])
        for i, data in enumerate(datas, first):
            if len(data) != index.length(i):  # the map's chunk is not the one the index means
                raise ChunkCorrupt(f"chunk {index.ids[i].hex()} is {len(data)} bytes, the index says {index.length(i)}")
        head = offset - index.start(first)
        if len(datas) == 1:
            return bytes(datas[0][head : head + end - offset])
        return b"".join(datas)[head : head + end - offset]

    def read_file(self, index: Index, offset: int, size: int) -> bytes:
        """The file's bytes (stored groups of chunker relayout put back, each whole): tools and tests."""
        read = self.read_chunks
        found = relayout.groups(lambda off, n: read(index, off, n), index.size, self.repo.chunker.group_w)
        out = bytearray(read(index, offset, size))
        end = offset + len(out)
        for g in found:
            assert g.end is not None
            lo, hi = max(offset, g.start), min(end, g.end)
            if lo < hi:
                whole = relayout.to_file(g, read(index, g.start, g.end - g.start))
                out[lo - offset : hi - offset] = whole[lo - g.start : hi - g.start]
        return bytes(out)

    def reserve_buffers(self) -> None:
        """Fault in the restore buffers now (a daemon at mount): a restore soon after a restart
        does not wait for fresh memory. Of the sizes the last mount kept (``close``), if known."""
        try:
            sizes = json.loads(self.repo.store.get_meta(BUFFER_SIZES_KEY) or "null")
        except (OSError, ValueError, sqlite3.Error):
            sizes = None
        ok = isinstance(sizes, list) and all(isinstance(n, int) for n in sizes)
        self.buffers.reserve(sizes if ok else None)

    def remember_buffers(self) -> None:
        """Note the sizes of the buffers kept, for the next mount's ``reserve_buffers`` (a hint)."""
        try:
            self.repo.store.set_meta(BUFFER_SIZES_KEY, json.dumps(self.buffers.sizes()))
        except (OSError, sqlite3.Error) as e:
            log.warning("could not note the restore buffers' sizes: %s", e)

    def content(self, index: Index, whole: bool = True) -> FileContent:
        """A new open-file content (pins the index's chunks: blocking, call in a thread); with
        ``whole`` false, one whose copies are plain files under ``staging/`` (not the memory tier)."""
        repo = self.repo
        return FileContent(
            repo.store,
            repo.chunker,
            index,
            repo.staging,
            self.read_chunks,
            max_size=repo.settings.max_file_size,
            successors=self.successors,
            buffers=self.buffers,
            checks=self.checks,
            whole=repo.whole if whole else None,
        )

    def replacement(self, rel: str) -> FileContent:
        """Content for an open that truncates the snapshot (``O_TRUNC``: every next-turn save of
        llama-server): empty. The old stub is neither decoded nor located nor pinned, and the
        chunks it names are not fetched from the shared tier; it stays the snapshot until the new
        one is renamed over it, which copies its metadata as any save does."""
        if not os.path.lexists(self.repo.path(rel)):
            raise FileNotFoundError(rel)
        whole = self.repo.whole
        short = whole is not None and whole.short  # memory is short: written through, not staged
        content = self.content(self.repo.empty_index(), whole=not short)
        if self.repo.whole is not None and not short:
            try:
                path, fd = self.repo.whole.new_staged()
                content.use_whole(fd, path)
            except BaseException:
                content.close()
                raise
        return content

    def load(self, rel: str) -> FileContent:
        """Content of an existing snapshot; StubError for a stub that is not an index, or whose chunk
        lengths disagree with the map (reads would return wrong bytes).

        Read and pin as one step under ``store.lock``: GC's sweep cannot fall between them. With a
        remote tier, the chunks the local packs lack are fetched first (outside the lock: network).
        """
        with self.restores.client():  # the warm-up waits meanwhile
            return self._load_whole(rel)

    def _load_whole(self, rel: str) -> FileContent:
        content = self._load(rel)
        for _ in range(3):  # its staged file stored and moved into the hot tier between: load again
            try:
                if self._whole_copy(content, rel):
                    return content  # its staged save, or a hot copy: no chunk is read
                break
            except _StagedGone:
                content.close()
                content = self._load(rel)
        else:
            content.close()
            raise StubError(f"{rel}: its staged save keeps vanishing as it is opened")
        try:
            key = _hot_key(content)
            if self.restore.fetches_into_whole(content, key):
                assert key is not None
                fetched = self.restore.fetch_into_whole(self, rel, content, key)
                if fetched is not None:
                    return fetched
                content = self._load(rel)  # the stub changed while its chunks came: the new version
            content = self.restore.fetch_missing(self, rel, content)
            self.restore.put_back(content, rel, _hot_key(content))  # memory, or the store's disk
        except BaseException:
            content.close()
            raise
        return content

    def _whole_copy(self, content: FileContent, rel: str) -> bool:
        """Back ``content`` by a whole file that already holds it: the snapshot's staged save (the
        snapshot itself until ingested), else the hot copy of its checksum. False if none."""
        whole = self.repo.whole
        if whole is None:
            return False
        staged = content.staged
        if staged is not None:
            try:
                fd = whole.open_staged(staged.name)
            except FileNotFoundError as e:  # stored meanwhile, most likely: the caller loads again
                raise _StagedGone(f"{rel}: its staged save {staged.name} is gone") from e
            except (OSError, ValueError) as e:
                raise StubError(f"{rel}: its staged save {staged.name} cannot be opened: {e}") from e
            content.use_whole(fd, None)
            content.source = "its staged save"
            return True
        key = _hot_key(content)
        if key is None or whole.budget <= 0:
            return False
        hot = whole.hot_open(key, rel)
        if hot is None:
            return False
        fd = hot
        if os.fstat(fd).st_size != content.index.size:
            os.close(fd)
            raise OSError(errno.EIO, f"{rel}: its hot copy has the wrong size")
        content.use_whole(fd, None)
        content.source = "a hot copy"
        return True

    def _staged_present(self, staged: stubs.Staged) -> bool:
        whole = self.repo.whole
        assert whole is not None
        try:
            return whole.staged_path(staged.name).exists()
        except ValueError:
            return False

    def load_stub(self, rel: str) -> FileContent:
        """The snapshot's content as its stub names it, nothing put back (blocking)."""
        return self._load(rel)

    def _load(self, rel: str) -> FileContent:
        with self.repo.store.lock:
            index, found, complete, loaded_from, record, staged = self._checked_index(rel)
            content = self.content(index)
        content.staged = staged
        content.locations = found  # the put-back reads from these: one map lookup per open
        content.all_local = complete
        content.loaded_from = loaded_from
        content.use_record(record, rel)
        return content

    def still_current(self, rel: str, content: FileContent) -> bool:
        """Whether ``content``, closed since and unchanged, is still the snapshot at ``rel``: its
        stub holds the bytes it was loaded from and no chunk has left the map since (blocking).
        Its pins were kept, so GC has not taken its chunks meanwhile."""
        if content.loaded_from is None:
            return False
        try:
            _raw, size, _record_mark, staged, h = self._read_stub(self.repo.path(rel), keep=False)
        except OSError:
            return False
        digest = _digest(h, staged)
        return self._same_load((digest, self.repo.store.drop_gen), size, content.loaded_from, content.index)

    @staticmethod
    def _read_stub(path: Path, keep: bool = True) -> tuple[bytes | None, int | None, bytes, stubs.Staged | None, Any]:
        """(index bytes, size xattr, file record bytes with a length mark: b"" if none, staged
        save, a SHA-256 of the first and the third: see ``_digest``), all from one open of the
        stub. Without ``keep``, the index bytes of a stub over ``HASHED_READ`` are only hashed (None)."""
        fd = stubs.open_stub(path)
        try:
            data: bytes | None = None
            if keep or os.fstat(fd).st_size <= HASHED_READ:
                data, size = stubs.read_stub(fd)
                h = hashlib.sha256(data)
            else:
                h, size = stubs.hash_stub(fd), stubs.stub_size(fd)
            record = stubs.read_record(fd)
            staged = stubs.read_staged(fd)
        finally:
            os.close(fd)
        mark = b"" if record is None else record + len(record).to_bytes(4, "little") + b"\x01"
        h.update(mark)
        return data, size, mark, staged, h

    @staticmethod
    def _same_load(now: tuple[bytes, int], size: int | None, then: tuple[bytes, int] | None, index: Index) -> bool:
        """Whether a stub read ``now`` (the SHA-256 of its bytes, the map's drop generation) with
        size xattr ``size`` is still what ``index`` was loaded from ``then``: the bytes compared
        (stubs are replaced, never edited, but an inode number can be reused)."""
        return now == then and size in (None, index.size)

    def _checked_index(
        self, rel: str
    ) -> tuple[Index, dict[bytes, Location], bool, tuple[bytes, int], FileRecord | None, stubs.Staged | None]:
        """The snapshot's index (a copy: an open file may change it), its chunks' locations (all of
        them for an index of up to ``LOCATE_ALL`` chunks, else none: reads look them up), checked
        against the map, whether the map has every chunk, its file record and its staged save;
        remembered while the stub's bytes (its record's too) stay the same, if the map had every
        chunk (one it lacked may arrive later: a fetch from the shared tier, a recovery)."""
        path = self.repo.path(rel)
        for _ in range(3):
            raw, size, mark, staged, h = self._read_stub(path, keep=False)
            if self.repo.whole is None:  # an offline tool: the chunk store's version (the mount stores the staged one)
                staged = None
            for _ in range(3):
                if staged is None or self._staged_present(staged):
                    break
                # Gone: stored meanwhile (ingestion replaced the stub, then took the file into the hot
                # tier: read the stub again), or lost if the stub still names it.
                raw, size, mark, again, h = self._read_stub(path, keep=False)
                if again != staged:
                    staged = again
                    continue
                # A version kept for a power cut put back after its staged file was stored, or the file
                # deleted: the index beside it, the version before, is the snapshot.
                log.error("the save of %s is lost (its staged copy %s is gone): its previous version is served",
                          rel, staged.name)  # fmt: skip
                with contextlib.suppress(OSError):
                    self.repo.unstage(rel)
                staged = None
            digest = _digest(h, staged)  # what the content is loaded from
            gen = self.repo.store.drop_gen
            if staged is not None:  # the staged file is the snapshot; the index beside it is the version before
                return self.repo.empty_index(), {}, False, (digest, gen), None, staged
            hit = self._loaded.get(rel)
            if hit is not None and self._same_load((digest, gen), size, (hit[0], hit[1]), hit[2]):
                self._loaded.move_to_end(rel)
                return hit[2].copy(), hit[3], True, (digest, gen), _record(mark, hit[2].size, path), staged
            if raw is None:  # only hashed: read it now, the same bytes unless replaced meanwhile
                raw, size, mark, again, h = self._read_stub(path)
                if again != staged or _digest(h, staged) != digest:
                    continue
            assert raw is not None
            index = stubs.decode_stub(raw, size, path)
            del raw  # the index shares it
            record = _record(mark, index.size, path)
            found, complete = self._locate_checked(rel, index)
            if complete:
                self._loaded[rel] = (digest, gen, index.copy(), found)
                self._loaded.move_to_end(rel)
                while len(self._loaded) > LOADS_KEPT:
                    self._loaded.popitem(last=False)
            return index, found, complete, (digest, gen), record, staged
        raise StubError(f"{rel}: its stub keeps being replaced as it is opened")

    def _locate_checked(self, rel: str, index: Index) -> tuple[dict[bytes, Location], bool]:
        """The locations of the index's chunks (none kept for one of more than ``LOCATE_ALL``
        chunks: looked up and checked ``CHECK_BATCH`` at a time, then dropped) and whether the map
        has every one; StubError if the map gives one of them another length."""
        store = self.repo.store
        keep = len(index) <= LOCATE_ALL
        step = max(1, len(index)) if keep else CHECK_BATCH
        kept: dict[bytes, Location] = {}
        complete = True
        for lo in range(0, len(index), step):
            ids = index.ids[lo : lo + step]
            found = store.locate_many(ids)
            bad = store.length_mismatch(index, found, lo, lo + len(ids))
            if bad is not None:
                raise StubError(f"{rel}: {bad}")
            complete = complete and all(cid in found for cid in ids)
            if keep:
                kept = found
        return kept, complete

    def prepare_save(self, content: FileContent, rel: str | None, durable: bool) -> PendingSave:
        """Chunk what is still queued, sync if durable, write the new stub under ``tmp/`` (blocking).

        ``rel`` is the file's path now, for the metadata the new stub carries over; None if unlinked.
        """
        durable = durable or self.repo.durable
        if rel is not None:
            content.groups.name = rel  # for log lines
        p = content.prepare()
        if durable:
            self.repo.sync()
        record = p.record.encode() if p.record is not None else None
        tmp = self.repo.prepare_stub(p.index, rel, durable, record) if rel is not None else None
        return PendingSave(content, p.index, p.gen, tmp, durable, p.record)

    def finish_staged(self, pending: PendingSave, rel: str) -> None:
        """``finish_save`` of an ingested staged save: its metadata is the snapshot's now."""
        assert pending.tmp is not None
        self.repo.install_staged(pending.tmp, rel)
        pending.content.committed(pending.gen)

    def finish_save(self, pending: PendingSave, rel: str | None) -> bool:
        """The commit point: rename the new stub over ``rel``, the file's path at this moment.

        One rename, no lock: call it where namespace changes are serialized (the FUSE thread), so a
        rename of the open file cannot fall between reading ``rel`` and this rename. False if the
        file was unlinked meanwhile (nothing is saved).
        """
        if pending.tmp is None or rel is None:
            if pending.tmp is not None:
                pending.tmp.unlink()
            pending.content.committed(pending.gen)
            return False
        self.repo.install(pending.tmp, rel)
        pending.content.committed(pending.gen)
        return True

    def sync_dir(self, rel: str) -> None:
        """After a durable save: the rename itself survives power loss (blocking)."""
        fsync_dir(self.repo.path(rel).parent)

    def close(self) -> None:
        self.restore.close()


class _StagedGone(StubError):
    """A stub read as naming a staged file that is no longer there when opened."""


def _hot_key(content: FileContent) -> str | None:
    """The hot tier's name for the content loaded: its file record's checksum and size; for a
    snapshot without a record (saved before records, or fetched from the bucket), the SHA-256 of
    its stub's index (chunk ids name the bytes) and size. None for an empty file."""
    size = content.index.size
    if not size:
        return None
    record = content.record
    if record is not None:
        return WholeFiles.key(record.file_sum, size)
    if content.loaded_from is None:
        return None
    return "i" + WholeFiles.key(content.loaded_from[0][:16], size)  # the SHA-256 of what it was loaded from


def _digest(h: Any, staged: stubs.Staged | None) -> bytes:
    """What a content is loaded from (``Files._same_load``, the hot key of a content without a
    record): the SHA-256 of the stub's index bytes, its record mark and its staged save's mark."""
    h = h.copy()
    h.update(_staged_mark(staged))
    return h.digest()


def _staged_mark(staged: stubs.Staged | None) -> bytes:
    """A staged save's part of what a content was loaded from (``Files._same_load``)."""
    return b"" if staged is None else b"\x02" + staged.encode()


def _record(mark: bytes, size: int, path: Path) -> FileRecord | None:
    """The file record in a stub's record bytes (``Files._read_stub``); StubError if it is not one."""
    if not mark:
        return None
    try:
        return filerecord.decode(mark[:-5], size)
    except filerecord.RecordError as e:
        raise StubError(f"{path}: bad file record: {e}") from e
