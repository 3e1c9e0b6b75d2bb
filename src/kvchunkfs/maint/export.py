"""Export chunks as a loose casync/desync store: ``DEST/<first 4 hex>/<64 hex>``, uncompressed."""

from __future__ import annotations

import os
from pathlib import Path

from kvchunkfs.store.layout import loose_chunk_name
from kvchunkfs.store.repository import Repository


def export_store(repo: Repository, dest: Path) -> tuple[int, int]:
    """Write every mapped chunk that DEST lacks; returns (chunks written, bytes written)."""
    dest.mkdir(parents=True, exist_ok=True)
    n = total = 0
    for pack in repo.store.pack_ids():
        for cid, offset, length in repo.store.chunks_in_pack(pack):
            path = dest / loose_chunk_name(cid)
            if path.exists():
                continue
            data = repo.store.read_run(pack, offset, length)
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.rename(tmp, path)
            n += 1
            total += length
    return n, total
