"""The daemon's live catalog, paged listings, kept map counts, the clean-unmount mark (no FUSE).

The live catalog must always equal what a full read of every stub gives (``catalog.snapshots``),
whatever sequence of saves, renames (of files and directories), unlinks and metadata changes
came before, also while they run concurrently with listings.
"""

from __future__ import annotations

import hashlib
import os
import random
import resource
import struct
import threading
import time
from pathlib import Path

import pytest
from helpers import loop_beside

from kvchunkfs.config import Config
from kvchunkfs.file.files import Files
from kvchunkfs.fuse.daemon import raise_fd_limit
from kvchunkfs.maint.recovery import recover
from kvchunkfs.service import catalog, prefixtree
from kvchunkfs.service.api import Service
from kvchunkfs.store import stubs
from kvchunkfs.store.repository import Repository, StoreSettings

SETTINGS = StoreSettings(chunk_min=256, chunk_avg=512, chunk_max=1024)


def _chunk(key: str) -> tuple[bytes, bytes]:
    data = hashlib.sha512(key.encode()).digest() * 4
    return hashlib.sha256(data).digest(), data


def _save(repo: Repository, rel: str, keys: list[str], tokens: list[int] | None = None) -> None:
    """A snapshot of the chunks named by ``keys`` (shared keys: shared chunks), committed as a save is."""
    chunks = [_chunk(k) for k in keys]
    if tokens is not None:
        header = struct.pack(f"<3I{len(tokens)}i", prefixtree.MAGIC, 4, len(tokens), *tokens)
        chunks.insert(0, (hashlib.sha256(header).digest(), header))
    index = repo.empty_index()
    for cid, data in chunks:
        index.append(cid, len(data))
    owner = object()
    repo.store.put_many(chunks, owner)
    repo.path(rel).parent.mkdir(parents=True, exist_ok=True)
    repo.install(repo.prepare_stub(index, None, False), rel)
    repo.store.unpin(owner)


def _fields(row: catalog.Snapshot) -> tuple:
    return (row.path, row.size, row.chunks, row.distinct_chunks, row.unique_bytes, row.shared_bytes,
            row.use_count, row.last_use, row.labels, row.error is None)  # fmt: skip


def _assert_matches_full_scan(service: Service) -> None:
    live = [_fields(r) for r in service.snapshots()]
    full = [_fields(r) for r in catalog.snapshots(service.repo.snapshots)]
    assert live == full
    assert {p: (u, s) for p, u, s in ((r[0], r[4], r[5]) for r in live)} == service.live.recount()
    clock = ("age_hours", "idle_hours", "score")
    page, _ = service.live.page(None, "", 1 << 30)
    assert [{k: v for k, v in r.items() if k not in clock} for r in page] == [
        {k: v for k, v in r.to_dict().items() if k not in clock} for r in service.snapshots()
    ]
    live = service.live
    with live._lock:  # the neighbours' common prefixes kept beside the token order (prefix tree)
        order = live._token_order.order
        assert live._token_order.lcp == [0] * bool(order) + [prefixtree.common_prefix_len(order[i - 1][0], order[i][0])
                                   for i in range(1, len(order))]  # fmt: skip
    for prefix in ("", "d1/"):
        tokens = {p: list(e.tokens) for p, e in live.entries.items() if e.tokens is not None and p.startswith(prefix)}
        assert prefixtree.to_json(live.token_tree(prefix)[0]) == prefixtree.to_json(prefixtree.build_tree(tokens))
    totals = service.totals()
    expected = catalog.store_totals(service.repo.root)
    for name in ("snapshots", "logical_bytes", "referenced_bytes", "stored_bytes", "chunks", "broken"):
        assert totals[name] == getattr(expected, name), name


@pytest.fixture
def service(tmp_path: Path):
    repo = Repository(tmp_path / "store", SETTINGS)
    files = Files(repo)
    svc = Service(files, tmp_path / "mnt", Config())
    svc.live.wait()
    yield svc
    files.close()
    repo.close()


def _random_op(repo: Repository, rng: random.Random, n: int) -> None:
    files = [r for r in catalog.stub_paths(repo.snapshots)]
    op = rng.choice(["save", "save", "rename", "unlink", "dir", "meta"]) if files else "save"
    if op == "save":
        rel = f"d{rng.randrange(3)}/s{rng.randrange(n)}"
        keys = [f"shared{rng.randrange(12)}" for _ in range(rng.randrange(1, 6))]
        keys += [f"own{rng.random()}" for _ in range(rng.randrange(3))]
        _save(repo, rel, keys, [rng.randrange(3)] * rng.randrange(1, 5))
    elif op == "rename":
        old = rng.choice(files)
        new = f"d{rng.randrange(3)}/s{rng.randrange(n)}"
        repo.path(new).parent.mkdir(parents=True, exist_ok=True)
        if not repo.path(new).is_dir():
            repo.rename(old, new)
    elif op == "unlink":
        repo.unlink(rng.choice(files))
    elif op == "dir":
        src, dst = f"d{rng.randrange(3)}", f"d{rng.randrange(3, 6)}"
        if repo.path(src).is_dir() and not repo.path(dst).exists():
            repo.rename(src, dst)
    else:
        rel = rng.choice(files)
        stubs.note_use(repo.path(rel))
        os.setxattr(repo.path(rel), stubs.LABEL_PREFIX + "k", str(rng.random()).encode())
        repo.touched(rel)


def test_live_catalog_equals_full_scan_after_any_changes(service: Service) -> None:
    rng = random.Random(7)
    for step in range(300):
        _random_op(service.repo, rng, 25)
        if step % 10 == 0:
            _assert_matches_full_scan(service)
    _assert_matches_full_scan(service)


def test_live_catalog_right_while_changes_race_listings(service: Service) -> None:
    def list_both() -> None:
        service.snapshots()
        service.prefix_tree_body("", "json")

    def changes() -> None:
        rng = random.Random(11)
        for _ in range(200):
            _random_op(service.repo, rng, 15)

    assert not loop_beside(list_both, changes)
    _assert_matches_full_scan(service)


def test_catalog_loaded_at_start_sees_existing_snapshots(tmp_path: Path) -> None:
    repo = Repository(tmp_path / "store", SETTINGS)
    _save(repo, "a", ["x", "y"], [1, 2, 3])
    _save(repo, "sub/b", ["x", "z"], [1, 2, 4])
    files = Files(repo)
    try:
        svc = Service(files, tmp_path / "mnt", Config())
        _assert_matches_full_scan(svc)
        tree, skipped = svc.prefix_tree("")
        assert not skipped and tree.snapshots == ["a", "sub/b"]
        assert [c.depth for c in tree.children] == [2]  # both start with tokens 1, 2
    finally:
        files.close()
        repo.close()


def test_catalog_notices_stubs_changed_behind_its_back(service: Service) -> None:
    """Files planted in or removed from snapshots/ directly (not through the mount) are noticed by
    their directory's mtime."""
    _save(service.repo, "d/a", ["x"])
    service.repo.path("d/e").mkdir()
    _assert_matches_full_scan(service)
    (service.repo.snapshots / "junk").write_bytes(b"not an index")
    (service.repo.snapshots / "d" / "e" / "junk2").write_bytes(b"nor this")
    _assert_matches_full_scan(service)
    (service.repo.snapshots / "junk").unlink()
    os.rename(service.repo.path("d/a"), service.repo.path("d/e/a"))
    _assert_matches_full_scan(service)


def test_prefix_tree_follows_saves(service: Service) -> None:
    _save(service.repo, "a", ["x"], [5, 6])
    first = service.prefix_tree_body("", "json")
    assert service.prefix_tree_body("", "json") is first  # unchanged store: the kept answer
    _save(service.repo, "b", ["y"], [5, 7])
    assert b'"b"' in service.prefix_tree_body("", "json")
    service.repo.unlink("a")
    tree, _ = service.prefix_tree("")
    assert tree.snapshots == ["b"]


def test_listing_pages_cover_the_listing(service: Service) -> None:
    for i in range(23):
        _save(service.repo, f"p/{i:02d}", [f"c{i}", "shared"], [i])
    _save(service.repo, "q/other", ["c99"])
    everything = [r["path"] for r in service.listing({})["snapshots"]]
    for order in ("asc", "desc"):
        seen: list[str] = []
        params = {"limit": "5", "prefix": "p/", "order": order}
        while True:
            page = service.listing(params)
            seen += [r["path"] for r in page["snapshots"]]
            if "next" not in page:
                break
            params = {**params, "after": page["next"]}
        expected = [p for p in everything if p.startswith("p/")]
        assert seen == (expected if order == "asc" else expected[::-1])
    # The same page through the general path (a filter) agrees with the fast one.
    fast = service.listing({"limit": "4", "after": "p/03"})["snapshots"]
    slow = service.listing({"limit": "4", "after": "p/03", "min_size": "0"})["snapshots"]
    assert [r["path"] for r in fast] == [r["path"] for r in slow] == ["p/04", "p/05", "p/06", "p/07"]
    with pytest.raises(catalog.QueryError):
        service.listing({"sort": "size", "after": "p/03"})


def test_map_counts_kept_by_writes_and_gc(tmp_path: Path) -> None:
    repo = Repository(tmp_path / "store", SETTINGS)
    try:
        store = repo.store
        assert store.stats() == (0, 0)
        _save(repo, "a", ["x", "y", "z"])
        _save(repo, "b", ["x", "w"])
        fresh = store.db.execute("SELECT count(*), sum(length) FROM chunks").fetchone()
        assert store.cached_stats() == store.stats() == tuple(fresh)
        gone = [_chunk("y")[0], _chunk("nope")[0]]
        with store.lock:
            assert store.delete_chunks(gone) == 1
        fresh = store.db.execute("SELECT count(*), sum(length) FROM chunks").fetchone()
        assert store.stats() == tuple(fresh)
    finally:
        repo.close()


def test_metrics_scrape_does_not_wait_for_the_map_lock(service: Service) -> None:
    """Regression: a scrape counted the map under its lock, so it queued behind every save."""
    _save(service.repo, "a", ["x"])
    done = threading.Event()
    with service.repo.store._db_lock:  # a save holds it while it commits
        threading.Thread(target=lambda: (service.metrics.render(), done.set()), daemon=True).start()  # type: ignore[union-attr]
        assert done.wait(30)


def _reopen(root: Path, clean_at: float | None, checked_at: float | None) -> Repository:
    """The store as a daemon left it: unmounted cleanly at ``clean_at`` (None: killed), its stubs
    last checked at ``checked_at``. (ctime cannot be set back: the times are moved instead.)"""
    repo = Repository(root, SETTINGS)
    meta = "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)"
    repo.store._commit([("DELETE FROM meta WHERE key IN ('clean_unmount', 'snapshots_checked_at')", [()])])
    rows = [(k, repr(t)) for k, t in (("clean_unmount", clean_at), ("snapshots_checked_at", checked_at)) if t]
    repo.store._commit([(meta, rows)])
    repo.close()
    return Repository(root, SETTINGS)


def test_recovery_checks_only_stubs_changed_since_the_last_check(tmp_path: Path) -> None:
    root = tmp_path / "store"
    repo = Repository(root, SETTINGS)
    _save(repo, "a", ["x"])
    repo.store.set_clean_mark()
    repo.close()
    later = time.time() + 3600
    repo = Repository(root, SETTINGS)
    report = recover(repo)
    assert report.clean and report.snapshots == 1  # changed within the clock slack: checked
    repo.close()
    for clean_at, checked_at, expected in ((later, None, 0), (None, later, 0), (None, None, 1)):
        repo = _reopen(root, clean_at, checked_at)
        report = recover(repo)
        assert (report.clean, report.snapshots) == (clean_at is not None, expected)
        repo.close()
    for pack in (root / "packs").iterdir():  # damage while unmounted: every stub is checked
        pack.unlink()
    repo = _reopen(root, later, later)
    report = recover(repo)
    assert not report.clean and report.missing == {"a": 1}
    repo.close()


def test_fd_soft_limit_raised_to_hard() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256, hard), hard))
        assert raise_fd_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
