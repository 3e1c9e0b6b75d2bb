"""The memory tier's pure pieces: budgets from the host and its cgroup (v1 and v2 layouts made
here), shortage readings, and which hot copies go first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvchunkfs.store import membudget
from kvchunkfs.store.membudget import Cgroup, Memory, own_cgroup
from kvchunkfs.store.wholefiles import WholeFiles

MiB = 1 << 20


def v1_tree(tmp_path: Path, limit: int, usage: int = 0, cache: int = 0, shmem: int = 0) -> tuple[Path, Path]:
    root = tmp_path / "cg"
    group = root / "memory" / "a" / "b"
    group.mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (root / "memory" / "a" / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (group / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited: the parent's counts
    (root / "memory" / "a" / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (root / "memory" / "a" / "memory.stat").write_text(f"cache {cache}\nrss 1\ntotal_cache {cache}\n"
                                                       f"total_shmem {shmem}\n")  # fmt: skip
    proc = tmp_path / "cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/a/b\n1:cpu:/\n0::/\n")
    return proc, root


def test_a_v1_limit_is_found_on_the_nearest_limited_ancestor(tmp_path: Path) -> None:
    proc, root = v1_tree(tmp_path, 1 << 30, usage=700 * MiB, cache=500 * MiB, shmem=300 * MiB)
    group = own_cgroup(str(proc), root)
    assert group is not None and group.path == root / "memory" / "a" and not group.v2
    assert group.limit == 1 << 30
    assert group.in_use() == 700 * MiB - (500 - 300) * MiB, "tmpfs pages count as in use, other file pages not"
    assert membudget.machine_memory(group) == 1 << 30
    assert membudget.default_tier_size(group) == 256 * MiB


def test_a_v2_limit(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    group = root / "svc"
    group.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("memory\n")
    (group / "memory.max").write_text(f"{2 << 30}\n")
    (group / "memory.current").write_text(f"{1 << 30}\n")
    (group / "memory.stat").write_text(f"anon 1\nfile {600 * MiB}\nshmem {100 * MiB}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/svc\n")
    found = own_cgroup(str(proc), root)
    assert found == Cgroup(group, True) and found.limit == 2 << 30
    assert found.in_use() == (1 << 30) - 500 * MiB
    (group / "memory.max").write_text("max\n")
    assert own_cgroup(str(proc), root) is None, "no limit anywhere: the host's memory counts"


def test_no_limit_means_the_hosts_memory(tmp_path: Path) -> None:
    total = membudget.meminfo()["MemTotal"]
    assert membudget.machine_memory(None) == total
    assert membudget.default_tier_size(None) == total // 4
    proc, root = v1_tree(tmp_path, 1 << 62)
    assert own_cgroup(str(proc), root) is None


def test_a_cgroup_near_its_limit_is_short(tmp_path: Path) -> None:
    proc, root = v1_tree(tmp_path, 1 << 30, usage=950 * MiB)
    psi = tmp_path / "psi"
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    memory = Memory(own_cgroup(str(proc), root), psi)
    reading = memory.reading()
    assert reading.need == 128 * MiB - 74 * MiB and "cgroup 950 of 1024" in reading.why
    (root / "memory" / "a" / "memory.usage_in_bytes").write_text(f"{800 * MiB}\n")
    assert memory.reading().need == 0
    psi.write_text("some avg10=35.00 avg60=3.00 avg300=1.00 total=9\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    reading = memory.reading()
    assert reading.need > 0 and "PSI" in reading.why


# -- the hot tier ------------------------------------------------------------------------------------


def tier(tmp_path: Path, budget: int, tier_size: int) -> WholeFiles:
    root = tmp_path / "whole"
    return WholeFiles(root, budget, create_parents=False, tier_size=tier_size)


def put(whole: WholeFiles, key: str, size: int, rel: str | None = None) -> None:
    path, fd = whole.new_part()
    os.ftruncate(fd, size)
    os.close(fd)
    whole.hot_commit(path, key, size, rel=rel)


def test_staged_saves_push_hot_copies_out_of_the_tier(tmp_path: Path) -> None:
    whole = tier(tmp_path, 100 * MiB, 10 * MiB)
    for k in "abc":
        put(whole, k, 3 * MiB)
    assert whole.hot_usage() == (3, 9 * MiB)
    path, fd = whole.new_staged()
    os.pwrite(fd, b"x" * (5 * MiB), 0)
    os.close(fd)
    whole.evict()
    assert whole.hot_usage() == (1, 3 * MiB), "staged 5 MiB + hot 3 MiB within the 10 MiB tier"
    assert whole.hot_open("c") is not None and whole.hot_open("a") is None
    assert whole.room() == 5 * MiB
    whole.short = True
    assert whole.room() == 0
    put(whole, "d", MiB)
    assert whole.hot_open("d") is None, "while memory is short no copy is kept"


def test_a_copy_no_snapshot_names_goes_first(tmp_path: Path) -> None:
    whole = tier(tmp_path, 10 * MiB, 100 * MiB)
    stubs_dir = tmp_path / "stubs"
    stubs_dir.mkdir()
    whole.stub_path = lambda rel: stubs_dir / rel
    put(whole, "a1", 3 * MiB, rel="a")
    put(whole, "b", 3 * MiB, rel="b")
    put(whole, "c", 3 * MiB, rel="c")
    assert whole.hot_open("a1", "a") is not None  # a is the most recently used now: b is the LRU
    put(whole, "a2", 3 * MiB, rel="a")  # a saved again: its old version goes first, not b
    assert whole.hot_open("b", "b") is not None and whole.hot_open("a1") is None
    assert whole.stats.superseded == 1
    whole.changed("c")  # c deleted (no stub): its copy goes before the least recently used
    whole.hot_open("a2", "a")
    whole.hot_open("b", "b")
    put(whole, "d", 3 * MiB, rel="d")
    assert whole.hot_open("c") is None and whole.hot_open("a2") is not None and whole.hot_open("b") is not None


@pytest.mark.parametrize("limit", [None, 64 * MiB])
def test_a_cgroup_limit_bounds_the_tiers_budget(tmp_path: Path, limit: int | None) -> None:
    proc, root = v1_tree(tmp_path, limit or (1 << 62))
    group = own_cgroup(str(proc), root)
    expected = (limit or membudget.meminfo()["MemTotal"]) // 4
    assert membudget.default_tier_size(group) == expected


def test_without_a_runtime_directory_the_name_is_random_and_recorded(tmp_path: Path) -> None:
    from kvchunkfs.store import tierdir

    store = tmp_path / "store"
    store.mkdir()
    first = tierdir._recorded(store)
    try:
        assert first.parent == tierdir.SHM and first.name.startswith(f"kv-chunk-fs-{os.geteuid()}-")
        assert len(first.name.rpartition("-")[2]) == 32, "128 random bits"
        assert (store / tierdir.RECORD).read_text().strip() == str(first)
        assert tierdir._recorded(store) == first, "the next daemon finds it again"
        os.chmod(first, 0o777)  # no longer private (as if swapped): a new one is made
        second = tierdir._recorded(store)
        assert second != first and (second.stat().st_mode & 0o777) == 0o700
        second.rmdir()
    finally:
        first.rmdir()
