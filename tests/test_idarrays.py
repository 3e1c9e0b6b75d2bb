"""Chunk ids as numpy arrays (format/idarrays.py) and the catalog's reference counts built on them.

The reference for every count is the plain-``dict`` one (``catalog.share``: a Counter over each
stub's distinct ids), run over the same stubs on disk.
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import numpy as np
import pytest

from kvchunkfs.format import idarrays
from kvchunkfs.format import index as idx
from kvchunkfs.format.idarrays import PrefixSet, RefCounts
from kvchunkfs.service import catalog
from kvchunkfs.service.live import LiveCatalog


def cid(n: int) -> bytes:
    return hashlib.sha256(n.to_bytes(8, "little", signed=True)).digest()


def same_prefix(n: int, prefix: bytes = b"\x42" * 8) -> bytes:
    """Ids that share their first 8 bytes (a collision a prefix cannot tell apart)."""
    return prefix + cid(n)[8:]


def test_ids_round_trip_and_prefixes_keep_id_order() -> None:
    ids = [cid(n) for n in range(50)] + [b"\x00" * 32, b"\xff" * 31 + b"\x00"]
    arr = idarrays.from_list(ids)
    assert idarrays.to_list(arr) == ids  # trailing zero bytes kept (not a C string)
    order = np.argsort(idarrays.prefixes(arr), kind="stable")
    assert [ids[i][:8] for i in order] == sorted(i[:8] for i in ids)
    with pytest.raises(ValueError):
        idarrays.from_list([b"short"])


def test_prefix_set_never_answers_no_for_an_id_it_holds() -> None:
    s = PrefixSet()
    held = [cid(n) for n in range(200_000)]
    for i in range(0, len(held), 7_000):  # many merges, duplicates across them
        s.add(idarrays.from_list(held[i : i + 9_000]))
    s.add(idarrays.from_list(held[:10]))
    assert len(s) == len(held)
    assert s.might_hold(idarrays.from_list(held)).all()
    absent = s.might_hold(idarrays.from_list([cid(n) for n in range(10**6, 10**6 + 1000)]))
    assert not absent.any()
    empty = PrefixSet()
    assert not empty.might_hold(idarrays.from_list([cid(1)])).any() and len(empty) == 0


def test_ref_counts_slots_are_one_per_distinct_id() -> None:
    refs = RefCounts()
    ids = [cid(n) for n in range(5000)] + [same_prefix(n) for n in range(300)]  # 300 ids, one prefix
    first = refs.slots(idarrays.from_list(ids + ids[:100]))  # repeated inside one call
    assert first[:100].tolist() == first[-100:].tolist()
    assert len(set(first.tolist())) == len(ids)
    again = refs.slots(idarrays.from_list(list(reversed(ids))))  # across calls: the same slots
    assert again.tolist() == list(reversed(first[: len(ids)].tolist()))
    assert refs.key_bytes(first[: len(ids)]) == [c[: idarrays.KEY_LEN] for c in ids]
    assert (refs.find(idarrays.from_list([cid(-n) for n in range(1, 50)])) == idarrays.NONE).all()
    assert (refs.find(idarrays.from_list([same_prefix(10**6)])) == idarrays.NONE).all()


def test_ref_counts_free_only_slots_counted_to_zero_and_reuse_them() -> None:
    refs = RefCounts()
    ids = [cid(n) for n in range(20_000)]
    slots = refs.slots(idarrays.from_list(ids))
    refs.count[slots] = 1
    refs.tidy()
    gone, kept = slots[:5000], slots[5000:]
    refs.count[gone] = 0
    refs.compact()
    assert (refs.find(idarrays.from_list(ids[:5000])) == idarrays.NONE).all()  # freed: not findable
    assert refs.find(idarrays.from_list(ids[5000:])).tolist() == kept.tolist()
    new = refs.slots(idarrays.from_list([cid(-n) for n in range(1, 3001)]))
    assert set(new.tolist()) <= set(gone.tolist())  # reused, the arrays did not grow
    assert refs.find(idarrays.from_list(ids[5000:])).tolist() == kept.tolist()
    assert len(refs) == 15_000


def test_ref_counts_agree_with_a_dict_under_random_changes() -> None:
    rng = random.Random(7)
    refs = RefCounts()
    model: dict[bytes, int] = {}
    slot_of: dict[bytes, int] = {}
    for _ in range(60):
        batch = [cid(rng.randrange(30_000)) for _ in range(rng.randrange(1, 3000))]
        distinct = list(dict.fromkeys(batch))
        slots = refs.slots(idarrays.from_list(distinct))
        for c, s in zip(distinct, slots.tolist(), strict=True):
            assert slot_of.setdefault(c, s) == s or model.get(c, 0) == 0
            slot_of[c] = s
        step = 1 if rng.random() < 0.6 else -1
        if step < 0:  # drop only what is counted
            keep = [i for i, c in enumerate(distinct) if model.get(c, 0) > 0]
            distinct, slots = [distinct[i] for i in keep], slots[keep]
        refs.count[slots] = refs.count[slots].astype(np.int64) + step
        for c in distinct:
            model[c] = model.get(c, 0) + step
        refs.tidy()
    live = [c for c, n in model.items() if n > 0]
    found = refs.find(idarrays.from_list(live))
    assert (found != idarrays.NONE).all()
    assert refs.count[found].tolist() == [model[c] for c in live]
    assert len(refs) == len(live)


# -- the catalog's counts against the dict reference ----------------------------------------------


def write_stub(snapshots: Path, rel: str, chunks: list[tuple[bytes, int]]) -> None:
    index = idx.Index(1, 2, 1 << 20)
    for c, n in chunks:
        index.append(c, n)
    path = snapshots / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(idx.encode(index))


def check_against_reference(snapshots: Path, live: LiveCatalog) -> None:
    reference = {r.path: (r.unique_bytes, r.shared_bytes, r.distinct_chunks) for r in catalog.snapshots(snapshots)}
    rows = {r.path: (r.unique_bytes, r.shared_bytes, r.distinct_chunks) for r in live.rows(None)}
    assert rows == reference
    assert live.recount() == {p: (u, s) for p, (u, s, _) in reference.items()}
    infos = catalog.scan(snapshots)
    assert live.totals()[2] == catalog.totals(infos, (0, 0), []).referenced_bytes


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Indexes read 7 entries at a time: ids repeat across pieces as well as inside them."""
    monkeypatch.setattr(idx, "PIECE_ENTRIES", 7)


@pytest.mark.parametrize("pieces", ["whole", "small"])
def test_catalog_counts_equal_the_dict_reference(tmp_path: Path, request: pytest.FixtureRequest, pieces: str) -> None:
    if pieces == "small":
        request.getfixturevalue("small_pieces")
    rng = random.Random(3)
    snaps = tmp_path / "snapshots"
    snaps.mkdir()
    write_stub(snaps, "empty", [])
    write_stub(snaps, "repeats", [(cid(1), 100), (cid(2), 200), (cid(1), 100), (cid(1), 100)])
    write_stub(snaps, "shares", [(cid(2), 200), (cid(3), 300)])
    for n in range(12):
        chunks = [(cid(1000 + rng.randrange(80)), 0) for _ in range(rng.randrange(1, 40))]
        write_stub(snaps, f"d/s{n}", [(c, 1 + c[0]) for c, _ in chunks])  # one length per id
    (snaps / "broken").write_bytes(b"not an index")
    live = LiveCatalog(snaps)
    live.load()
    check_against_reference(snaps, live)
    # Changes as the daemon reports them: a replaced stub, a deleted one, one made anew.
    write_stub(snaps, "shares", [(cid(3), 300), (cid(4), 400)])
    os.unlink(snaps / "d/s3")
    write_stub(snaps, "d/new", [(cid(2), 200), (cid(200), 5)])
    live.changed("shares", "d/s3", "d/new")
    check_against_reference(snaps, live)
    freed, chunks, missing = live.freed_together(["repeats", "shares", "nope"])
    assert missing == ["nope"]
    assert (freed, chunks) == (100 + 300 + 400, 3)  # not cid(2): d/new names it too


def test_unnamed_never_reports_an_id_a_snapshot_names(tmp_path: Path) -> None:
    """GC's collection of the changes frees what ``unnamed`` returns: an id some stub names must
    never be in it, one whose last stub went must be."""
    snaps = tmp_path / "snapshots"
    snaps.mkdir()
    write_stub(snaps, "a", [(cid(1), 10), (cid(2), 20)])
    write_stub(snaps, "b", [(cid(2), 20), (cid(3), 30)])
    mapped = [cid(n) for n in range(1, 10)]  # the store's ids (the catalog keeps keys)
    live = LiveCatalog(snaps, ids_with_keys=lambda keys: [c for c in mapped if c[: idarrays.KEY_LEN] in keys])
    live.load()
    assert live.unnamed([cid(1), cid(2), cid(3), cid(9)]) == {cid(9)}
    os.unlink(snaps / "a")
    live.changed("a")
    assert live.unnamed([]) == {cid(1)}  # its last snapshot went; cid(2) is still b's
    assert live.unnamed([cid(2), cid(3)]) == set()
    write_stub(snaps, "c", [(cid(1), 10)])  # named again
    live.changed("c")
    assert live.unnamed([cid(1)]) == set()
