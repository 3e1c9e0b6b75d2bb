"""Reading one stub into a catalog row: its listing fields, its distinct chunks, its token prefix.

A stub is read through one open file (a rename meanwhile changes nothing read), a piece of its
index at a time, so a load never holds an index of a million chunks whole. Each distinct chunk id
gets a slot in the catalog's reference counts (``idarrays.RefCounts``); a row keeps the slots and
lengths of its distinct chunks (8 bytes a chunk). The token prefix is read from the first pieces of
the index only (more only if the header reaches past them), straight from the store.
"""

from __future__ import annotations

import array
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvchunkfs.format import idarrays
from kvchunkfs.format import index as idx
from kvchunkfs.format.index import Index
from kvchunkfs.service import catalog, prefixtree
from kvchunkfs.store import stubs

HEAD_ENTRIES = 1 << 12  # index entries read for a token prefix (more only if the header is longer)
ReadChunks = Callable[[Index, int, int], bytes]


@dataclass
class Read:
    """What reading a stub gave: its row, its distinct chunks' slots and lengths, its tokens."""

    info: catalog.StubInfo
    slots: np.ndarray
    lens: np.ndarray
    tokens: array.array | None = None
    token_error: str | None = None


NO_SLOTS = np.empty(0, np.uint32)


class StubReader:
    def __init__(self, snapshots_dir: Path, refs: idarrays.RefCounts, read_chunks: ReadChunks | None) -> None:
        self.snapshots_dir = snapshots_dir
        self._refs = refs  # the catalog's reference counts: the slots of the ids read
        self.read_chunks = read_chunks

    def read(self, rel: str) -> Read:
        """Read the stub at ``rel`` (one open file throughout: a rename meanwhile changes nothing
        read) a piece of its index at a time; a stub that is not a valid index gives a row with
        ``error``. Its chunks get slots (count 0 until the catalog counts them)."""
        path = self.snapshots_dir / rel
        info = catalog.StubInfo(path=rel, size=stubs.stub_size(path) or 0, chunks=0, lengths={}, created=0.0,
                                use_count=0, last_use=None, labels={})  # fmt: skip
        catalog.read_metadata(path, info)
        fd = stubs.open_stub(path)
        try:
            info.digest = stubs.hash_stub(fd).digest()
            try:
                slots, lens = self._count_pieces(fd, path, info)
            except OSError as e:  # StubError, or the bytes ended early
                info.error = str(e)
                return Read(info, NO_SLOTS, NO_SLOTS)
            read = Read(info, slots, lens)
            if self.read_chunks is not None:
                read.tokens, read.token_error = self._tokens_of(fd, path)
            else:
                read.token_error = "no chunk reader"
            return read
        finally:
            os.close(fd)

    def _count_pieces(self, fd: int, path: Path, info: catalog.StubInfo) -> tuple[np.ndarray, np.ndarray]:
        """(slots, lengths) of the distinct chunks of the open stub ``fd`` (the length an id's
        last entry gives, as a dict filled in file order keeps); sets ``info``'s size and chunks.

        Each piece is made distinct on its own; across pieces, from the last one back, a flag per
        slot drops the ones a later piece had: a few bytes a chunk, no sort of the whole."""
        pieces = []
        end = chunks = 0
        try:
            for ends, ids in stubs.read_table(fd):
                lens = np.diff(ends, prepend=np.uint64(end))
                pieces.append(_last_of_each(self._refs.slots(ids), lens))
                end, chunks = int(ends[-1]), chunks + len(ends)
        except idx.IndexFormatError as e:
            raise stubs.StubError(f"{path}: {e}") from e
        size = stubs.stub_size(fd)
        if size is not None and size != end:
            raise stubs.StubError(f"{path}: size xattr {size} does not match index size {end}")
        info.size, info.chunks = end, chunks
        if len(pieces) <= 1:
            return pieces[0] if pieces else (NO_SLOTS, NO_SLOTS)
        seen = np.zeros(self._refs.n, bool)  # touched only where a slot is set
        wide = any(p[1].dtype != np.uint32 for p in pieces)
        # Room for every entry; only the distinct ones are written (the rest is never touched).
        slots = np.empty(sum(len(p[0]) for p in pieces), np.uint32)
        lengths = np.empty(len(slots), np.uint64 if wide else np.uint32)
        n = 0
        while pieces:  # each piece freed once copied
            piece, piece_lens = pieces.pop()
            fresh = ~seen[piece]
            seen[piece] = True
            k = int(np.count_nonzero(fresh))
            slots[n : n + k] = piece[fresh]
            lengths[n : n + k] = piece_lens[fresh]
            n += k
        return slots[:n], lengths[:n]

    def _tokens_of(self, fd: int, path: Path) -> tuple[array.array | None, str | None]:
        """The token prefix, from the first ``HEAD_ENTRIES`` entries of the index (the whole index
        only if the header reaches past them)."""

        def read(offset: int, size: int) -> bytes:
            return os.pread(fd, size, offset)

        length = os.fstat(fd).st_size
        index, n = idx.read_head(read, length, HEAD_ENTRIES)
        tokens, why, reached = self._tokens(index)
        if reached and n > len(index):  # the header may go on past the entries read
            index = stubs.decode_stub(stubs.read_stub(fd)[0], None, path)
            tokens, why, _ = self._tokens(index)
        return tokens, why

    def _tokens(self, index: Index) -> tuple[array.array | None, str | None, bool]:
        """(the token prefix, why there is none, whether reading it reached the end of ``index``),
        read once per change of the stub (later trees need no pack reads)."""
        assert self.read_chunks is not None
        reader = catalog.ChunkReader(index, self.read_chunks)
        try:
            tokens = array.array("i", prefixtree.read_tokens(reader))  # type: ignore[arg-type]
            return tokens, None, reader.pos + len(reader._buf) >= index.size
        except (OSError, ValueError, LookupError) as e:  # not a ggsq file, a missing or corrupt chunk
            return None, str(e) or type(e).__name__, reader.pos + len(reader._buf) >= index.size


def entries_in(path: Path) -> int:
    """How many entries the index at ``path`` has, going by its size (0 if it cannot be told)."""
    try:
        return max(0, os.lstat(path).st_size - idx.FIXED_BYTES) // idx.ITEM_BYTES
    except OSError:
        return 0


def _last_of_each(slots: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct slots as uint32, the length of each one's last entry): uint32 lengths unless one
    needs more."""
    distinct, last = np.unique(slots[::-1], return_index=True)
    lengths = lens[::-1][last]
    narrow = len(lengths) and int(lengths.max()) < 1 << 32
    return distinct.astype(np.uint32), lengths.astype(np.uint32) if narrow or not len(lengths) else lengths


def direct_reader(get_many: Callable[[list[bytes]], list[bytes]]) -> ReadChunks:
    """Read a byte range of a snapshot straight from the store (a catalog refresh must not count
    as a restore)."""

    def read_chunks(index: Index, offset: int, size: int) -> bytes:
        end = min(index.size, offset + size)
        if offset >= end:
            return b""
        first, last = index.find(offset), index.find(end - 1)
        data = b"".join(get_many(index.ids[first : last + 1]))
        start = index.start(first)
        return data[offset - start : end - start]

    return read_chunks
