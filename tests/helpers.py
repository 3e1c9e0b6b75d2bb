"""Shared test helpers: deterministic snapshot-like data and stub inspection."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from kvchunkfs import stubs


def rand_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def write_in_pieces(path: Path, data: bytes, piece: int, mode: str = "wb") -> None:
    with open(path, mode) as f:
        for i in range(0, len(data), piece):
            f.write(data[i : i + piece])


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def unique_chunk_bytes(stub: Path) -> tuple[int, int]:
    """(distinct chunks, their total bytes) named by a stub."""
    index = stubs.read_index(stub)
    seen: dict[bytes, int] = {}
    for i, cid in enumerate(index.ids):
        seen[cid] = index.length(i)
    return len(seen), sum(seen.values())
