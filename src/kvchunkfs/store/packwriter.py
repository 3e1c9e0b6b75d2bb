"""The one writer of pack bytes: saves append through it, and so do GC's compaction copies.

It keeps the ordering rule of docs/design.md ("Saving: the order of writes") in one place: a
batch's record and its chunks go to the pack's known end in one ``pwritev`` (record before bytes,
``packformat``), are fsynced if asked, and only then is the caller's ``commit`` run (bytes before
rows). If the write, the fsync or the commit fails (OSError), the pack is cut back to where the batch began and the next
batch is written there again: explicit offsets, so even a failing cut only leaves dead bytes.

The writer does not know the map: ``new_pack`` numbers a pack and enters it in the map
(``PackStore.create_pack``), and ``commit`` commits a batch's rows. ``commit`` must raise OSError
only when nothing of the batch was committed (the bytes are cut off after it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvchunkfs.store.chunkstore import Chunk
from kvchunkfs.store.packformat import BATCH_HEADER_SIZE, ENTRY_SIZE, PACK_HEADER_SIZE, batch_record, pack_header

_IOV_MAX = 512  # writev takes at most IOV_MAX (1024) buffers


@dataclass(frozen=True)
class Batch:
    """One batch as written: its chunks, where each one's bytes begin, and the batch's end."""

    pack: int
    chunks: Sequence[Chunk]
    offsets: list[int]
    end: int

    def placed(self) -> list[tuple[bytes, int, int]]:
        """(id, pack, offset) of each chunk."""
        return [(cid, self.pack, off) for (cid, _), off in zip(self.chunks, self.offsets, strict=True)]


def create_pack_file(path: Path) -> int:
    """A new pack file holding just its header; returns a write fd (never through an existing file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        pwrite_all(fd, [pack_header()], 0)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


class PackWriter:
    """Appends batches to one open pack at a time, starting a new one (``new_pack``: number, write
    fd) when the open one reaches ``pack_size``. Not thread-safe: its owner serializes the calls
    (saves hold ``PackStore.lock``; GC is one thread)."""

    def __init__(self, new_pack: Callable[[], tuple[int, int]], pack_size: int, fsync: bool) -> None:
        self._new_pack = new_pack
        self.pack_size = pack_size
        self.fsync = fsync  # each batch fsynced before its commit
        self.pack: int | None = None  # the open pack
        self.fd = -1
        self.end = 0  # the open pack's known end: where the next batch goes

    def append(self, chunks: Sequence[Chunk], commit: Callable[[Batch], None]) -> Batch:
        """Write one batch (record + chunks) at the open pack's end, then ``commit`` it; the pack is
        closed afterwards if it reached ``pack_size`` (a batch itself may pass it)."""
        fd, pack, start = self._open()
        record = batch_record([(cid, len(data)) for cid, data in chunks])
        offsets = []
        off = start + len(record)
        for _, data in chunks:
            offsets.append(off)
            off += len(data)
        batch = Batch(pack, chunks, offsets, off)
        try:
            pwrite_all(fd, [record, *(data for _, data in chunks)], start)
            if self.fsync:
                os.fsync(fd)
            commit(batch)
        except OSError:
            with contextlib.suppress(OSError):  # see the module docstring: the next batch goes to ``start``
                os.ftruncate(fd, start)
            raise
        self.end = off
        if self.end >= self.pack_size:
            self.close()
        return batch

    def append_fitting(self, chunks: Sequence[Chunk], commit: Callable[[Batch], None]) -> None:
        """``append`` in batches that keep packs within ``pack_size``: a new pack is started whenever
        the next chunk would pass it (a backlog can make one call many MiB; packs stay near their
        size, so GC can delete or compact them piece by piece). Each batch is committed on its own."""
        i = 0
        while i < len(chunks):
            cost = BATCH_HEADER_SIZE + ENTRY_SIZE + len(chunks[i][1])
            if self.pack is not None and self.end + cost > self.pack_size:
                self.close()
            _, _, end = self._open()
            room = self.pack_size - end - BATCH_HEADER_SIZE
            size = 0
            first = i
            while i < len(chunks) and (i == first or size + ENTRY_SIZE + len(chunks[i][1]) <= room):
                size += ENTRY_SIZE + len(chunks[i][1])
                i += 1
            self.append(chunks[first:i], commit)

    def _open(self) -> tuple[int, int, int]:
        if self.pack is None:
            self.pack, self.fd = self._new_pack()
            self.end = PACK_HEADER_SIZE
        return self.fd, self.pack, self.end

    def close(self) -> None:
        """Stop appending to the open pack (the next batch starts a new one)."""
        if self.pack is not None:
            os.close(self.fd)
            self.pack, self.fd, self.end = None, -1, 0


def pwrite_all(fd: int, datas: Sequence[bytes | memoryview], offset: int) -> None:
    """Write ``datas`` at ``offset`` (never at the fd's position: a failed batch cannot shift the next)."""
    for i in range(0, len(datas), _IOV_MAX):
        part = datas[i : i + _IOV_MAX]
        total = sum(len(d) for d in part)
        written = os.pwritev(fd, part, offset)
        if written < total:  # short write (rare on regular files): finish from a joined copy, or raise
            rest = memoryview(b"".join(part))
            while written < total:
                written += os.pwrite(fd, rest[written:], offset + written)
        offset += total
