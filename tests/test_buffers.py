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
    c = pool.take(3 * MiB)  # both idle now: the 5 MiB one (at most twice the size asked)
    d = pool.take(3 * MiB)  # the 8 MiB one is too big for it: a new one, kept
    assert pool.reused == 2 and pool.size == 16 * MiB
    assert len(c) == len(d) == 3 * MiB and not np.shares_memory(c, d)
    assert sorted(pool.sizes()) == [3 * MiB, 5 * MiB, 8 * MiB]


def test_the_pool_keeps_no_more_than_its_capacity() -> None:
    pool = BufferPool(10 * MiB)
    held = [pool.take(4 * MiB) for _ in range(4)]  # all busy: new ones, only two kept
    assert pool.size == 8 * MiB and len(held) == 4
    small = pool.take(1000)  # small buffers are not pooled
    assert len(small) == 1000 and pool.size == 8 * MiB


def test_a_mount_reserves_the_sizes_the_last_one_kept() -> None:
    pool = BufferPool(16 * MiB)
    pool.reserve([7 * MiB, 7 * MiB, 100, 9 * MiB])  # largest first, as far as they fit; tiny ones not pooled
    assert pool.sizes() == [9 * MiB, 7 * MiB]
    a, b = pool.take(6 * MiB), pool.take(5 * MiB)  # the 7 MiB one, then the 9 MiB one
    assert pool.reused == 2 and not np.shares_memory(a, b)


def test_a_brief_take_uses_a_bigger_idle_buffer() -> None:
    """A buffer given back within moments (a save's joined batch, a group re-laid out for storing)
    may be any idle one big enough: fresh memory would cost more than the copy into it. A take
    for a group kept for later reads still gets one of at most twice its size."""
    pool = BufferPool(16 * MiB)
    pool.reserve()  # 8, 4, 2, 1 and 1 MiB
    big = pool.take(3 * MiB, brief=True)  # the 4 MiB one
    bigger = pool.take(3 * MiB, brief=True)  # no idle one of 3-6 MiB left: the 8 MiB one
    assert pool.reused == 2 and len(big) == len(bigger) == 3 * MiB and not np.shares_memory(big, bigger)
    del big, bigger
    gc.collect()
    kept = pool.take(3 * MiB)  # the 4 MiB one again
    fresh = pool.take(3 * MiB)  # the 8 MiB one is too big for a kept group: a new one
    assert pool.reused == 3 and not np.shares_memory(kept, fresh)
