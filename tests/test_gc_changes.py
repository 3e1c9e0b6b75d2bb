"""GC without a walk: a run looks only at what changed since the last one.

The daemon's catalog counts the references every stub makes; ``gcchanges.collect_changes`` frees the ids
the store mapped since the last run and the ids whose last snapshot went, if no snapshot names them
now. It must never free a named chunk (whatever runs beside it) and must leave nothing a walk of
every stub would still free. These tests drive the store layer the way the daemon does (saves pin
their chunks until the stub is renamed), beside the real catalog; no FUSE.
"""

from __future__ import annotations

import hashlib
import random
import time

import pytest
from helpers import loop_beside
from test_scale import _random_op, _save
from test_scale import service as service  # noqa: F401 - the fixture

from kvchunkfs.maint import gc, gcchanges
from kvchunkfs.service import catalog
from kvchunkfs.service.api import Service
from kvchunkfs.store import stubs
from kvchunkfs.store.repository import Repository


def named_ids(repo: Repository) -> set[bytes]:
    out: set[bytes] = set()
    for rel in catalog.stub_paths(repo.snapshots):
        try:
            out.update(stubs.read_index(repo.path(rel)).ids)
        except stubs.StubError:
            pass  # a planted non-index (the walk keeps what it may name)
    return out


def mapped_ids(repo: Repository) -> set[bytes]:
    return set(repo.store.chunk_lengths())


def assert_nothing_named_is_missing(repo: Repository) -> None:
    missing = named_ids(repo) - mapped_ids(repo)
    assert not missing, f"{len(missing)} chunks named by a stub were freed"


def test_collecting_the_changes_frees_exactly_what_a_walk_would(service: Service) -> None:
    repo = service.repo
    rng = random.Random(3)
    freed = 0
    for step in range(300):
        _random_op(repo, rng, 20)
        if step % 7 == 0:
            report = gcchanges.collect_changes(repo, service.live, 0.5)
            assert report is not None and report.mode == "changes" and not report.errors
            freed += report.chunks_freed
            assert_nothing_named_is_missing(repo)
            assert mapped_ids(repo) == named_ids(repo), "garbage left behind"
    assert freed > 0
    report = gcchanges.collect_changes(repo, service.live, 0.5)
    assert report is not None
    walk = gc.run_gc(repo, 0.5)
    assert walk.chunks_freed == 0 and walk.missing_chunks == 0


def test_collecting_the_changes_while_saves_renames_and_unlinks_run(service: Service) -> None:
    """A collector looping beside a writer, slowed at random between asking the catalog and
    sweeping (the window a save or a rename could fall into), never frees a chunk a stub names."""
    repo = service.repo
    ask = service.live.unnamed
    slow = random.Random(5)

    def slow_unnamed(ids):  # type: ignore[no-untyped-def]
        answer = ask(ids)
        time.sleep(slow.random() * 0.003)
        return answer

    service.live.unnamed = slow_unnamed  # type: ignore[method-assign]
    runs = 0

    def collect() -> None:
        nonlocal runs
        report = gcchanges.collect_changes(repo, service.live, 0.5)
        assert report is not None
        runs += not report.errors

    def changes() -> None:
        rng = random.Random(9)
        for _ in range(400):
            _random_op(repo, rng, 15)
            time.sleep(rng.random() * 0.004)  # a busy server, not a loop of renames (see the endless-renames test)

    errors = loop_beside(collect, changes)
    assert not errors, errors
    assert runs > 10
    assert_nothing_named_is_missing(repo)
    assert gcchanges.collect_changes(repo, service.live, 0.5) is not None
    assert gc.run_gc(repo, 0.5).chunks_freed == 0, "a collection of the changes missed garbage"


def test_a_pinned_chunk_is_kept_and_freed_at_a_later_run(service: Service) -> None:
    repo = service.repo
    _save(repo, "a", ["x", "y"])
    owner = object()
    data = b"an aborted save's chunk" * 100
    cid = hashlib.sha256(data).digest()
    repo.store.put_many([(cid, data)], owner)  # written, pinned, never named (a save in progress)
    report = gcchanges.collect_changes(repo, service.live, 0.5)
    assert report is not None and report.chunks_freed == 0
    assert cid in mapped_ids(repo)
    repo.store.unpin(owner)  # the save gave up
    report = gcchanges.collect_changes(repo, service.live, 0.5)
    assert report is not None and report.chunks_freed == 1
    assert cid not in mapped_ids(repo)


def test_an_unreadable_stub_makes_the_collector_walk(service: Service) -> None:
    repo = service.repo
    collector = gc.GarbageCollector(repo, 0.5, 3600)
    collector.names = service.live
    _save(repo, "a", ["x"])
    assert collector.run().mode == "walk"  # the first run always walks
    _save(repo, "b", ["y"])
    repo.unlink("b")
    report = collector.run()
    assert report.mode == "changes" and report.chunks_freed == 1
    (repo.snapshots / "planted").write_bytes(b"not an index")  # behind the daemon's back
    repo.touched("planted")
    _save(repo, "c", ["z"])
    repo.unlink("c")
    report = collector.run()
    assert report.mode == "walk" and report.chunks_freed == 1
    assert collector.run(walk=True).mode == "walk"
    assert_nothing_named_is_missing(repo)


def test_a_walk_is_due_after_walk_interval(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    collector = gc.GarbageCollector(service.repo, 0.5, 3600, walk_interval=100)
    collector.names = service.live
    assert collector.run().mode == "walk"
    assert collector.run().mode == "changes"
    now = time.monotonic()
    monkeypatch.setattr(gc.time, "monotonic", lambda: now + 101)
    assert collector.run().mode == "walk"


def test_no_sweep_while_a_namespace_change_is_in_flight(service: Service) -> None:
    """Between a rename across directories and its report, a listing can see the old name gone and
    the new one not yet there: GC must not sweep then, walk or no walk."""
    repo = service.repo
    _save(repo, "d1/a", ["x"])
    _save(repo, "b", ["y"])
    repo.unlink("b")  # y is garbage
    with repo._changing("d2/a"):
        changes = gcchanges.collect_changes(repo, service.live, 0.5)
        walk = gc.run_gc(repo, 0.5)
    assert changes is not None and changes.chunks_freed == 0 and changes.errors
    assert walk.chunks_freed == 0 and walk.errors
    changes = gcchanges.collect_changes(repo, service.live, 0.5)
    assert changes is not None and changes.chunks_freed == 1 and not changes.errors
