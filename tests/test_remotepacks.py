"""The packed bucket layout's pure pieces (store/remotepacks.py): pack indexes and range coalescing."""

from __future__ import annotations

import hashlib

import pytest

from kvchunkfs.store import remotepacks as rp


def cid(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "little")).digest()


def test_a_pack_index_round_trips_and_implies_offsets() -> None:
    packs = [rp.PackDesc(cid(100), [(cid(1), 10), (cid(2), 5)]), rp.PackDesc(cid(101), [(cid(3), 7)])]
    back = rp.decode(rp.encode(packs))
    assert [(d.pack, d.chunks) for d in back] == [(d.pack, d.chunks) for d in packs]
    assert list(back[0].locs()) == [(cid(1), rp.Loc(cid(100), 0, 10)), (cid(2), rp.Loc(cid(100), 10, 5))]


@pytest.mark.parametrize("damage", ["flip", "cut", "extend", "huge"])
def test_a_damaged_pack_index_is_refused(damage: str) -> None:
    data = bytearray(rp.encode([rp.PackDesc(cid(100), [(cid(1), 10)])]))
    if damage == "flip":
        data[20] ^= 1
    elif damage == "cut":
        del data[-40:]
    elif damage == "extend":
        data += b"\0" * 36
    else:
        data = bytearray(rp.MAX_PIDX_BYTES + 1)
    with pytest.raises(rp.PackIndexError):
        rp.decode(bytes(data))


def test_a_pack_index_past_its_limits_is_not_written() -> None:
    with pytest.raises(ValueError):
        rp.encode([rp.PackDesc(cid(i), []) for i in range(rp.MAX_PACKS + 1)])


def test_coalesce_joins_neighbours_of_one_pack_and_splits_far_ones() -> None:
    p, q = cid(100), cid(101)
    wanted = [(cid(1), rp.Loc(p, 100, 10)), (cid(2), rp.Loc(p, 0, 50)), (cid(3), rp.Loc(p, 1000, 10)),
              (cid(4), rp.Loc(q, 0, 5))]  # fmt: skip
    runs = rp.coalesce(wanted, gap=100, max_range=10_000)
    assert [(r.pack, r.start, r.end) for r in runs] == [(p, 0, 110), (p, 1000, 1010), (q, 0, 5)]
    assert runs[0].parts == [(cid(2), 0, 50), (cid(1), 100, 10)]
    # a run stops at max_range bytes
    runs = rp.coalesce([(cid(i), rp.Loc(p, i * 10, 10)) for i in range(10)], gap=0, max_range=30)
    assert [(r.start, r.end) for r in runs] == [(0, 30), (30, 60), (60, 90), (90, 100)]


def test_packs_hold_at_least_their_size_so_a_save_puts_at_most_ceil_bytes_over_size() -> None:
    packer = rp.Packer(100)
    sealed = [full for i in range(25) if (full := packer.add(cid(i), bytes(30)))]  # 750 bytes
    last = packer.flush()
    assert last is not None and packer.flush() is None
    sizes = [d.size for d, _ in sealed] + [last[0].size]
    assert sum(sizes) == 750 and len(sizes) <= -(-750 // 100) and all(s >= 100 for s in sizes[:-1])
    for d, data in [*sealed, last]:
        assert d.pack == hashlib.sha256(data).digest() and len(data) == d.size


def test_a_pack_of_tiny_chunks_is_sealed_at_what_one_pack_index_may_list() -> None:
    """Chunks far smaller than any chunker cuts (a pack's bytes never reached): every pack still
    fits a pack index."""
    packer = rp.Packer(16 << 20)
    sealed = [full for i in range(rp.MAX_ENTRIES + 5) if (full := packer.add(cid(i), bytes(8)))]
    last = packer.flush()
    assert last is not None and len(sealed) == 1
    assert [len(d.chunks) for d, _ in [*sealed, last]] == [rp.MAX_ENTRIES, 5]
    for group in rp.groups([d for d, _ in [*sealed, last]]):
        assert rp.decode(rp.encode(group))
