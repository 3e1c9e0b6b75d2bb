"""Victim selection of local_cache_size eviction (maint/evict.py): pure functions."""

from __future__ import annotations

from kvchunkfs.maint.evict import choose_victims, rank


def cid(n: int) -> bytes:
    return n.to_bytes(32, "big")


def test_rank_puts_least_recently_used_first_and_drops_protected() -> None:
    uses = {cid(1): (30.0, 0, 10), cid(2): (10.0, 0, 20), cid(3): (20.0, 0, 30), cid(4): (10.0, 0, 5)}
    assert rank(uses, [cid(3)]) == [(cid(2), 20), (cid(4), 5), (cid(1), 10)]  # ties by id


def test_rank_takes_a_snapshot_from_its_end() -> None:
    uses = {cid(9): (10.0, 0, 1), cid(8): (10.0, -1, 1), cid(7): (10.0, -2, 1), cid(1): (5.0, 0, 1)}
    assert [c for c, _ in rank(uses, [])] == [cid(1), cid(7), cid(8), cid(9)]


def test_choose_victims_stops_once_enough_bytes_and_skips_pinned() -> None:
    ranked = [(cid(1), 10), (cid(2), 10), (cid(3), 10), (cid(4), 10)]
    assert choose_victims(ranked, set(), 15) == [cid(1), cid(2)]
    assert choose_victims(ranked, {cid(1)}, 15) == [cid(2), cid(3)]
    assert choose_victims(ranked, set(), 0) == []
    assert choose_victims(ranked, set(), 1000) == [c for c, _ in ranked]
