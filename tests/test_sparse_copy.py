"""Copies that keep a snapshot's holes (file/sparse.py): the room a copy takes, and its zeros unwritten."""

from __future__ import annotations

import os
from pathlib import Path

from kvchunkfs.file import sparse
from kvchunkfs.format.chunker import chunk_id
from kvchunkfs.format.index import Index

KiB = 1 << 10


def test_data_bytes_counts_the_chunks_that_are_not_zeros() -> None:
    data = b"\1" * (48 * KiB)
    zeros = bytes(64 * KiB)
    index = Index(16 * KiB, 64 * KiB, 256 * KiB, [64 * KiB, 112 * KiB, 176 * KiB, 177 * KiB],
                  [chunk_id(zeros), chunk_id(data), chunk_id(zeros), chunk_id(bytes(KiB))])  # fmt: skip
    assert sparse.data_bytes(index) == 48 * KiB
    assert sparse.data_bytes(Index(16 * KiB, 64 * KiB, 256 * KiB)) == 0


def test_write_nonzero_leaves_zeros_as_holes(tmp_path: Path) -> None:
    path = tmp_path / "copy"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        piece = bytearray(4 << 20)  # 4 MiB of zeros with 3 bytes set, one across a block boundary
        piece[sparse.BLOCK - 1 : sparse.BLOCK + 1] = b"ab"
        piece[3 << 20] = 7
        sparse.write_nonzero(fd, memoryview(piece), 5)  # an unaligned offset
        os.ftruncate(fd, 5 + len(piece))
        assert os.pread(fd, len(piece), 5) == piece
        assert os.fstat(fd).st_blocks * 512 <= 4 * sparse.BLOCK, "only the blocks with data were written"
    finally:
        os.close(fd)
