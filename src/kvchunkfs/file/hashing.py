"""Chunk ids of a batch hashed on every core, for the batch a ``close()`` waits for.

SHA-256 (the chunk id) is the largest cost of storing a batch, and a save's last batch is hashed
after the last byte arrived, while ``close()`` waits. ``hashlib`` lets go of the GIL while it
hashes more than a few KiB, so slices of the batch hashed on other threads run side by side. Batches
cut while the writer is still writing are hashed on their own thread: there the FUSE thread and the
writer need the other core. A batch taken just before the ``close()`` (a relayout group is cut once
its last byte is in, which is often the file's last byte) asks between steps whether a commit now
waits for it, and hashes the rest on every core from then on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvchunkfs.format.chunker import chunk_id

Buffer = bytes | memoryview

PARALLEL_MIN = 1 << 20  # smaller batches: the hand-off costs about what the other core would save
STEP = 1 << 20  # bytes hashed between two looks at ``hurry``

Hurry = Callable[[], bool]  # True once a commit waits for the batch being hashed

HELPERS = max(1, (os.cpu_count() or 2) - 1)  # threads beside the one that asks
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(HELPERS, thread_name_prefix="hash")
        return _pool


def _ids(pieces: Sequence[Buffer]) -> list[bytes]:
    return [chunk_id(p) for p in pieces]


def chunk_ids(pieces: Sequence[Buffer], parallel: bool | Hurry = False) -> list[bytes]:
    """The ids of ``pieces`` in order; with ``parallel``, slices of about equal bytes are hashed on
    the pool's threads and this one at once. ``parallel`` may be a ``Hurry``: pieces are hashed on
    this thread, ``STEP`` bytes at a time, until it returns True; the rest then on every core."""
    if callable(parallel):
        return _ids_until_hurried(pieces, parallel)
    total = sum(len(p) for p in pieces)
    if not parallel or len(pieces) < 2 or total < PARALLEL_MIN:
        return _ids(pieces)
    pool = _executor()
    ways = min(len(pieces), HELPERS + 1)
    bounds, acc, k = [0], 0, 1
    for i, p in enumerate(pieces):
        acc += len(p)
        if k < ways and acc >= total * k / ways:
            bounds.append(i + 1)
            k += 1
    bounds.append(len(pieces))
    slices = [pieces[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    futures: list[Future[list[bytes]]] = [pool.submit(_ids, s) for s in slices[1:]]
    out = _ids(slices[0])
    for f in futures:
        out.extend(f.result())
    return out


def _ids_until_hurried(pieces: Sequence[Buffer], hurry: Hurry) -> list[bytes]:
    out: list[bytes] = []
    i = 0
    while i < len(pieces):
        if hurry():
            return out + chunk_ids(pieces[i:], parallel=True)
        step = 0
        while i < len(pieces) and step < STEP:
            out.append(chunk_id(pieces[i]))
            step += len(pieces[i])
            i += 1
    return out
