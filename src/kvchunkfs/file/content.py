"""The content of an open file: clean or a whole file.

``FileContent`` is shared by every handle of one file and knows nothing of FUSE.

* CLEAN   – the content is the stub's index; nothing to save.
* STAGING – the content is a whole plain file (``staging_fd``): a staged save of its own, which
            writes and truncates change in place, or a shared one (a hot copy, a save handed to
            ingestion), copied into one of its own before the first change (``to_staging``).

A save stores the whole file in one pass (``prepare``: file/chunking.py), the same function
ingestion runs behind a close. A content with no whole file (an offline tool's) reads its chunks,
stored groups put back in file order through ``FileGroups`` (file/groups.py). A snapshot's record
is checked wherever its whole file is put back (file/restore.py) or copied.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvchunkfs.file import sparse
from kvchunkfs.file.buffers import BufferPool
from kvchunkfs.file.chunking import store_file
from kvchunkfs.file.copyrange import copy_range
from kvchunkfs.file.filesums import FileChecks
from kvchunkfs.file.groups import FileGroups
from kvchunkfs.file.predict import Successors
from kvchunkfs.file.reader import ReadChunks
from kvchunkfs.format.chunker import BATCH
from kvchunkfs.format.cutter import Cutter
from kvchunkfs.format.filerecord import FileRecord, file_hasher
from kvchunkfs.format.index import Index
from kvchunkfs.store.chunkstore import ChunkStore
from kvchunkfs.store.packs import ChunkCorrupt, ChunkMissing, Location
from kvchunkfs.store.stubs import Staged
from kvchunkfs.store.wholefiles import WholeFiles

log = logging.getLogger(__name__)


def _copy_file(src: int, dst: int, keep: int | None) -> int:
    """Copy ``src``'s first ``keep`` bytes (None: all) to the empty ``dst``; the bytes copied.
    In the kernel where it can (file/copyrange.py)."""
    size = os.fstat(src).st_size if keep is None else min(keep, os.fstat(src).st_size)
    pos = 0
    while pos < size:  # data only: a hole stays a hole (a sparse file is not copied as its zeros)
        try:
            pos = os.lseek(src, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            break  # only a hole up to the end
        end = min(os.lseek(src, pos, os.SEEK_HOLE), size)
        while pos < end:
            n = copy_range(src, dst, end - pos, pos)
            if n == 0:
                break  # shorter meanwhile
            pos += n
        if pos < end:
            break
    os.ftruncate(dst, size if keep is None else keep)
    return size


class Mode(enum.Enum):
    CLEAN = "clean"
    STAGING = "staging"


class FileContent:
    def __init__(
        self,
        store: ChunkStore,
        chunker: Cutter,
        index: Index,
        staging_dir: Path,
        read_chunks: ReadChunks,
        max_size: int = 1 << 62,
        successors: Successors | None = None,
        buffers: BufferPool | None = None,
        checks: FileChecks | None = None,
        whole: WholeFiles | None = None,
    ) -> None:
        self.store = store
        self.chunker = chunker
        self.index = index
        self.staging_dir = staging_dir
        self.read_chunks = read_chunks
        self.max_size = max_size
        self.successors = successors  # None: cut every byte (``predict_chunks`` off)
        # Chunker relayout: the chunks hold some byte ranges (groups) permuted; reads put them back.
        self.checks = checks if checks is not None else FileChecks()
        self.groups = FileGroups(chunker.group_w, self.checks)
        if not index.size:
            self.groups.set_layout(index, [])  # a new file: no group
        # The loaded snapshot's file record and the index object it describes (None: none, or
        # the content changed since).
        self.record: FileRecord | None = None
        self._record_index: Index | None = None
        self.buffers = buffers
        # Where the loaded index's chunks were when it was opened (may go stale: readers re-locate).
        self.locations: dict[bytes, Location] | None = None
        self.all_local = False  # the map had every chunk at load (else the shared tier may have them)
        # The SHA-256 of the stub's bytes and the map's drop generation it was loaded from; None once changed.
        self.loaded_from: tuple[bytes, int] | None = None
        self.mode = Mode.CLEAN
        self.cond = threading.Condition()
        self.gen = 0  # bumped by every change; a commit clears ``dirty`` only if unchanged
        self.dirty = False
        self.bytes_new = 0  # bytes this file added to the store
        self._reported_new = 0
        self.staging_fd = -1
        self.staging_path: Path | None = None
        # Whole-file mode (a mounted store): the content is a plain file under ``whole`` from its
        # first write on (a staged file the kernel may write directly); ``shared``: that file is not
        # this content's to change (a hot copy, a save handed to ingestion), so the next write or
        # truncate copies it first. Without ``whole`` (an offline tool) the copy is a plain file
        # under ``staging_dir``.
        self.whole = whole
        self.shared = False
        self.staged: Staged | None = None  # the stub's staged save when loaded (Files sets it)
        self.source: str | None = None  # where a restore found the bytes (Files: log lines)
        # A whole file on the store's disk (a snapshot too big for the memory tier): read in a
        # worker thread, never on the event loop; the callback runs at close.
        self.on_disk: Callable[[], None] | None = None
        self._retired_fds: list[int] = []
        store.pin_index(self, index)

    # -- state ------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        if self.mode is Mode.STAGING:
            return os.fstat(self.staging_fd).st_size
        return self.index.size

    def _changed(self) -> None:
        self.gen += 1
        self.dirty = True
        self.loaded_from = None  # no longer the stub's content, even once saved

    def use_record(self, record: FileRecord | None, name: str) -> None:
        """The loaded snapshot's file record (None: it has none) and path (for log lines): reads
        take its groups from it and check them, a whole-file copy checks its checksum."""
        with self.cond:
            self.record, self._record_index = record, self.index
            self.groups.name = name
            if record is not None and record.form.groups_given:
                self.groups.set_layout(self.index, record.groups)

    def _loaded_record(self) -> FileRecord | None:
        """Under ``cond``: the record if the index is still the one it describes."""
        if self.record is not None and self._record_index is self.index and self.mode is Mode.CLEAN:
            return self.record
        return None

    # -- writing ----------------------------------------------------------------------------

    def check_size(self, size: int) -> None:
        """EFBIG if the file would pass ``max_file_size``."""
        if size > self.max_size:
            raise OSError(errno.EFBIG, f"file would be {size} bytes, max_file_size is {self.max_size}")

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Write into the whole file of its own the content is (``own_file``: else ``to_staging``
        first, in a thread). ``data`` may be a view of the caller's buffer."""
        self.check_size(offset + len(data))
        with self.cond:
            if not self.own_file_locked():
                raise OSError(errno.EIO, "a write to a file the content does not own")
            self._changed()
            fd = self.staging_fd
        # Outside the lock, so a reader's pread on a worker thread never holds up the FUSE thread.
        # The fd stays open until close() (see _close_staging), and writes of one file are ordered
        # by the FUSE layer.
        os.pwrite(fd, data, offset)

    def truncate(self, length: int) -> None:
        """Truncate the whole file of its own the content is (``to_staging(length)`` first if not)."""
        self.check_size(length)
        with self.cond:
            if not self.own_file_locked():
                raise OSError(errno.EIO, "a truncate of a file the content does not own")
            if length != self.size:
                os.ftruncate(self.staging_fd, length)
            self._changed()

    # -- staging ----------------------------------------------------------------------------

    def use_whole(self, fd: int, path: Path | None, on_disk: Callable[[], None] | None = None) -> None:
        """The content is the plain file ``fd``: this content's own (``path``: deleted at close)
        or shared (None: a hot copy, a staged save, a put-back on disk; copied before any change).
        ``on_disk``: ``fd`` is an anonymous file on disk, this is called at close. Before any handle."""
        with self.cond:
            self.staging_fd, self.staging_path = fd, path
            self.shared = path is None
            self.mode = Mode.STAGING
            self.on_disk = on_disk

    def snapshot(self) -> tuple[Index, FileRecord | None, dict[bytes, Location] | None]:
        """The loaded snapshot: its index, its file record (None: none, or changed since) and
        where its chunks were at load (a put-back reads them: file/restore.py)."""
        with self.cond:
            return self.index, self._loaded_record(), self.locations

    def whole_fd(self) -> int:
        """The whole file the content is (-1: none)."""
        with self.cond:
            return self.staging_fd if self.mode is Mode.STAGING else -1

    def whole_mtime(self) -> int:
        """The whole file's modification time in ns (-1: none): it moves with writes the kernel
        makes to it directly."""
        fd = self.whole_fd()
        return os.fstat(fd).st_mtime_ns if fd >= 0 else -1

    def mark_changed(self) -> None:
        """Count the content as changed (a handle that may write it without telling us)."""
        with self.cond:
            self._changed()

    def own_file(self) -> bool:
        """Whether the content is a plain file this content may change (a handle may write it directly)."""
        with self.cond:
            return self.own_file_locked()

    def own_file_locked(self) -> bool:
        """``own_file`` under ``cond``."""
        return self.mode is Mode.STAGING and not self.shared

    def seal(self, copy: bool) -> tuple[Path, int, int]:
        """A save of the content as it is: its staged file (path, size, generation) handed to the
        caller (ingestion), the content keeping it open read-only; with ``copy`` (other writers
        still have the file open) a copy of it instead. Blocking: a copy runs in a worker thread."""
        assert self.whole is not None
        with self.cond:
            if self.mode is not Mode.STAGING or self.shared or self.staging_path is None:
                raise OSError(errno.EIO, "nothing staged to save")
            gen, fd, path = self.gen, self.staging_fd, self.staging_path
            if not copy:
                self.staging_path, self.shared = None, True
                return path, os.fstat(fd).st_size, gen
        new, out = self.whole.new_staged()
        try:
            size = _copy_file(fd, out, None)
        except BaseException:
            os.close(out)
            self.whole.drop_staged(new)
            raise
        os.close(out)
        return new, size, gen

    def to_staging(self, keep: int | None = None) -> None:
        """Copy the content (its first ``keep`` bytes: a truncate) into a staging file of its own
        (blocking; run in a thread)."""
        with self.cond:
            if self.mode is Mode.STAGING and not self.shared:
                return
            if self.mode is Mode.STAGING:  # a shared whole file: copied as it is
                source = self.staging_fd
            else:
                source = -1
        if source >= 0:
            self._copy_whole(source, keep)
            return
        with self.cond:
            if self.mode is Mode.STAGING:
                return
            # The index itself (its groups are known by identity).
            index, isize = self.index, self.index.size
            size = isize
            record = self._loaded_record()
        if self.whole is not None:
            # Only its data takes room (its zeros stay holes): there before the first byte is copied.
            self.whole.reserve(sparse.data_bytes(index))
            path, fd = self.whole.new_staged()
        else:
            path = self.staging_dir / f"{uuid.uuid4().hex}.staging"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if keep is not None:
            isize = min(isize, keep)
            size = min(size, keep)
            record = None  # part of the file: each group read is still checked whole
        try:
            pos = 0
            hasher = file_hasher() if record is not None else None  # the whole snapshot is copied
            while pos < isize:
                n = min(BATCH, isize - pos)
                piece = self.groups.read_file(index, pos, n, self.read_chunks, isize)
                if hasher is not None:
                    hasher.update(piece)
                sparse.write_nonzero(fd, piece, pos)
                pos += n
            if record is not None and hasher is not None and hasher.digest() != record.file_sum:
                raise self.checks.mismatch(f"{self.groups.name or 'a file'}: the whole file copied for a rewrite")
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self._staged(fd, path)

    def _copy_whole(self, source: int, keep: int | None) -> None:
        """A shared whole file -> a staged copy of this content's own."""
        assert self.whole is not None
        self.whole.reserve(os.fstat(source).st_blocks * 512)  # its data (a hole takes no room)
        path, fd = self.whole.new_staged()
        try:
            _copy_file(source, fd, keep)
        except BaseException:
            os.close(fd)
            self.whole.drop_staged(path)
            raise
        with self.cond:
            old = self.staging_fd
        self._retired_fds.append(old)  # a read on a worker thread may still use it: closed at close()
        self._staged(fd, path)

    def _staged(self, fd: int, path: Path) -> None:
        with self.cond:
            self.staging_fd, self.staging_path = fd, path
            self.shared = False
            self.mode = Mode.STAGING

    def _close_staging(self, final: bool = False) -> None:
        """Drop the staged copy. Its fd is closed only at ``close()`` (``final``): a read on a worker
        thread may still be using it, and a closed fd number can be reused by any other open."""
        if self.staging_fd >= 0:
            self._retired_fds.append(self.staging_fd)
            self.staging_fd = -1
        if final:
            for fd in self._retired_fds:
                os.close(fd)
            self._retired_fds.clear()
        if self.staging_path is not None:
            try:
                os.unlink(self.staging_path)
            except FileNotFoundError:
                pass
            self.staging_path = None

    # -- reading ----------------------------------------------------------------------------

    def read(self, offset: int, size: int, read_chunks: ReadChunks) -> bytes | memoryview:
        with self.cond:
            staging_fd = self.staging_fd if self.mode is Mode.STAGING else -1
            index, isize = self.index, self.index.size
        if staging_fd >= 0:  # outside the lock, as in write()
            return os.pread(staging_fd, size, offset)
        end = min(offset + size, isize)
        if offset >= end:
            return b""
        return self.groups.read_file(index, offset, end - offset, read_chunks, isize)

    # -- commit -----------------------------------------------------------------------------

    def prepare(self) -> Prepared:
        """Store the whole file the content is (file/chunking.py): the index, its generation and
        its file record, the stored form checked to parse to the groups stored (else stored in file
        order). Blocking."""
        with self.cond:
            gen = self.gen
            if self.mode is Mode.CLEAN:
                record = self.record if self._record_index is self.index else None
                return Prepared(self.index, gen, record)
            fd = self.staging_fd  # open until close(), whatever replaces it meanwhile
        name = self.groups.name or "a file"
        try:
            stored = store_file(fd, self.store, self.chunker, self, self.successors, self.checks, name)
        except (OSError, ChunkCorrupt, ChunkMissing):
            raise
        except Exception as e:  # a bug: the save fails (EIO), the daemon goes on
            log.exception("storing %s failed", name)
            raise OSError(errno.EIO, f"storing {name} failed: {e!r}") from e
        with self.cond:
            self.bytes_new += stored.new_bytes
        return Prepared(stored.index, gen, stored.record)

    def take_new_bytes(self) -> int:
        """Bytes this file added to the store since the last call (one save's new bytes)."""
        new, self._reported_new = self.bytes_new - self._reported_new, self.bytes_new
        return new

    def committed(self, gen: int) -> None:
        with self.cond:
            if gen == self.gen:
                self.dirty = False

    def close(self) -> None:
        """Last handle gone: drop the staged copy and the pins."""
        with self.cond:
            self._close_staging(final=True)
            on_disk, self.on_disk = self.on_disk, None
        if on_disk is not None:
            on_disk()
        self.store.unpin(self)


@dataclass
class Prepared:
    """A save's chunks stored: the index to install, the generation it saves and its file record
    (None: a snapshot saved before records, unchanged)."""

    index: Index
    gen: int
    record: FileRecord | None
