"""The restore buffer pool: a buffer is handed out again only once nothing refers to it."""

from __future__ import annotations

import gc

import numpy as np

from kvchunkfs.file.buffers import BufferPool

MiB = 1 << 20


def test_a_buffer_with_a_live_view_is_never_handed_out() -> None:
    """Views, slices and memoryviews of a buffer (a decoded group kept for later reads, a FUSE
    reply being sent) keep it busy; only when the last is gone is it reused, and for a fitting size."""
    pool = BufferPool(16 * MiB)
    pool.reserve()  # 8, 4, 2, 1 and 1 MiB
    assert pool.size == 16 * MiB
    a = pool.take(5 * MiB)
    a[:] = 1
    view = memoryview(a)[100:200]
    del a
    b = pool.take(5 * MiB)  # the 8 MiB one is still referred to by ``view``: a new one, idle small ones dropped
    b[:] = 2
    assert bytes(view) == b"\x01" * 100
    del view, b
    gc.collect()
    c = pool.take(3 * MiB)  # both idle now: the smaller that fits
    d = pool.take(3 * MiB)  # the other one
    assert pool.reused == 3
    assert len(c) == len(d) == 3 * MiB and not np.shares_memory(c, d)
    assert pool.size == 13 * MiB


def test_the_pool_keeps_no_more_than_its_capacity() -> None:
    pool = BufferPool(10 * MiB)
    held = [pool.take(4 * MiB) for _ in range(4)]  # all busy: new ones, only two kept
    assert pool.size == 8 * MiB and len(held) == 4
    small = pool.take(1000)  # small buffers are not pooled
    assert len(small) == 1000 and pool.size == 8 * MiB
