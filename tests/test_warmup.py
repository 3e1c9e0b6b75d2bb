"""The warm-up: a mount that finds the memory tier empty (here: a reboot, a new boot id) puts the
most recently used snapshots back into the hot tier within its budget, in the background; it waits
while a client's restore is under way, and stops when memory is short.

The warm-up is slowed where a test needs it mid-way (``KVCFS_WARM_UP_HOLD``: it waits after a given
number of pieces while the file exists), and a client's restore is held in flight the same way
(``KVCFS_RESTORE_HOLD``): every ordering below is observed through counters, never timed."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import Mount
from helpers import rand_bytes, wait_for_log
from test_pressure import ALLOCATOR, LIMIT, cgroup, finished, in_cgroup  # noqa: F401 - cgroup: a fixture

MiB = 1 << 20
DONE = "kvchunkfs.file.warmup: warm-up "  # its last line: "warm-up done: ..." or "warm-up stopped: ..."


def wait_until(m: Mount, what: Callable[[dict[str, int]], bool], timeout: float = 60) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        st = m.stats()
        if what(st):
            return st
        assert time.monotonic() < deadline, f"not reached: {st}\n{m.log()[-3000:]}"
        time.sleep(0.01)


@pytest.fixture
def boot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "boot_id"
    path.write_text("boot-1\n")
    monkeypatch.setenv("KVCFS_BOOT_ID_FILE", str(path))
    return path


@pytest.fixture
def warm(tmp_path: Path, boot: Path) -> Iterator[Mount]:
    """A 64 MiB memory tier: the warm-up's budget is half of it (32 MiB)."""
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log",
              ["--memory-tier-size", "64MiB", "--warm-up", "0.5"])  # fmt: skip
    m.start()
    try:
        yield m
    finally:
        m.stop()


def save_all(m: Mount, names: list[str], size: int, seed: int) -> dict[str, bytes]:
    """Save each (in order: the last is the most recently saved) and wait until stored."""
    out = {}
    for i, name in enumerate(names):
        data = rand_bytes(size, seed + i)
        m.path(name).write_bytes(data)
        out[name] = data
        time.sleep(0.01)  # distinct modification times
    m.ingested()
    return out


def reboot(m: Mount, boot: Path, n: int, extra: list[str] | None = None) -> int:
    """As after a reboot: another boot id, so the next mount finds the memory tier wiped; the count
    of warm-ups ended before (the first mount's, on an empty store, ended at once)."""
    m.stop()
    done = m.log().count(DONE)
    boot.write_text(f"boot-{n}\n")
    m.start(extra)
    return done


def hot_names(m: Mount) -> list[str]:
    return [p.name for p in (m.whole / "hot").iterdir()]


def test_after_a_reboot_the_most_recently_used_are_put_back_within_the_budget(warm: Mount, boot: Path) -> None:
    """Six 8 MiB snapshots, one restored after all were saved: the warm-up's 32 MiB take that one and
    the three saved last; their restores are hot hits (no put-back), the others are put back."""
    names = [f"s{i}" for i in range(6)]
    data = save_all(warm, names, 8 * MiB, 10)
    assert warm.path("s1").read_bytes() == data["s1"]  # its last use is now the latest
    done = reboot(warm, boot, 2)
    wait_for_log(warm, DONE, done + 1)
    st = warm.stats()
    assert st["warm_up_budget"] == 32 * MiB, st
    assert st["warm_up_planned"] == 4 and st["warm_up_files"] == 4 and st["warm_up_bytes"] == 32 * MiB, st
    assert st["warm_up_warming"] == 0 and st["hot_put_backs"] == 0 and st["hot_files"] == 4, st
    assert "warm-up done: 4 of 4 snapshots (32 MiB)" in warm.log()
    for name in ("s1", "s5", "s4", "s3"):  # most recently used first
        before = warm.stats()
        assert warm.path(name).read_bytes() == data[name], name
        after = warm.stats()
        assert after["hot_hits"] == before["hot_hits"] + 1 and after["hot_put_backs"] == before["hot_put_backs"], name
    for name in ("s2", "s0"):  # outside the budget: put back at their open
        before = warm.stats()
        assert warm.path(name).read_bytes() == data[name], name
        assert warm.stats()["hot_put_backs"] == before["hot_put_backs"] + 1, name
    # A mount that finds copies in the tier (a restart that kept it) does not warm up.
    warm.remount()
    assert warm.stats()["warm_up_planned"] == 0 and warm.log().count(DONE) == done + 1


def test_a_warm_up_of_0_puts_nothing_back(warm: Mount, boot: Path) -> None:
    data = save_all(warm, ["a", "b"], 4 * MiB, 20)
    done = reboot(warm, boot, 2, ["--memory-tier-size", "64MiB", "--warm-up", "0"])
    warm.catalog_loaded()
    st = warm.stats()
    assert st["warm_up_budget"] == 0 and st["warm_up_planned"] == 0 and st["warm_up_files"] == 0, st
    assert st["hot_files"] == 0 and hot_names(warm) == [], st
    assert warm.path("b").read_bytes() == data["b"]
    assert warm.stats()["hot_put_backs"] == 1
    assert warm.log().count(DONE) == done


def test_a_clients_restore_goes_first(warm: Mount, boot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up held after its first piece; a client's restore of a snapshot outside its plan is
    then held in flight, and the warm-up let go: it waits (counted) and writes no piece until that
    restore is done, which completes while the warm-up is still mid-way, put back by the client
    itself, byte-exact. Then the warm-up finishes, and its snapshots are hot hits."""
    data = save_all(warm, ["cold", "w0", "w1", "w2", "w3"], 8 * MiB, 30)  # "cold" is the least recent
    warm_hold, restore_hold = tmp_path / "warm-hold", tmp_path / "restore-hold"
    warm_hold.write_text("1")  # after its first piece
    restore_hold.touch()
    monkeypatch.setenv("KVCFS_WARM_UP_HOLD", str(warm_hold))
    monkeypatch.setenv("KVCFS_RESTORE_HOLD", str(restore_hold))
    done = reboot(warm, boot, 2)
    st = wait_until(warm, lambda s: s["warm_up_pieces"] >= 1)
    assert st["warm_up_warming"] == 1 and st["warm_up_files"] == 0 and st["warm_up_planned"] == 4, st
    pieces = st["warm_up_pieces"]

    got: dict[str, bytes] = {}
    client = threading.Thread(target=lambda: got.__setitem__("cold", warm.path("cold").read_bytes()))
    client.start()
    try:
        wait_until(warm, lambda s: s["restores_loading"] == 1)
        warm_hold.unlink()  # the warm-up may go on: it meets the client's restore
        st = wait_until(warm, lambda s: s["warm_up_yields"] >= 1)
        assert st["warm_up_pieces"] == pieces and st["warm_up_files"] == 0, "no piece while a client restores"
    finally:  # a failure above leaves nothing held (the unmount would wait for the client)
        warm_hold.unlink(missing_ok=True)
        restore_hold.unlink()
    client.join(timeout=60)
    assert not client.is_alive()
    assert hashlib.sha256(got["cold"]).digest() == hashlib.sha256(data["cold"]).digest()
    st = warm.stats()
    assert st["hot_put_backs"] == 1, "the client put its snapshot back itself"
    wait_for_log(warm, DONE, done + 1)
    st = warm.stats()
    assert st["warm_up_files"] == 4 and st["warm_up_yields"] >= 1, st
    wait_for_log(warm, "restored cold: 8.0 MiB in", 1)  # at its close, after the linger
    assert [line for line in warm.log().splitlines() if "restored cold:" in line][0].endswith(
        "from local packs (1 open)"
    )
    for name in ("w3", "w0"):
        before = warm.stats()
        assert warm.path(name).read_bytes() == data[name]
        assert warm.stats()["hot_hits"] == before["hot_hits"] + 1


def test_a_clients_open_of_the_snapshot_being_warmed_does_not_wait_for_it(
    warm: Mount, boot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up held mid-way through a snapshot; a client opens that very snapshot: it puts it
    back itself (byte-exact), and the warm-up's copy, once done, is dropped for the client's."""
    data = save_all(warm, ["a", "b"], 8 * MiB, 40)
    hold = tmp_path / "warm-hold"
    hold.write_text("2")
    monkeypatch.setenv("KVCFS_WARM_UP_HOLD", str(hold))
    done = reboot(warm, boot, 2)
    wait_until(warm, lambda s: s["warm_up_pieces"] >= 2)
    assert warm.path("b").read_bytes() == data["b"]  # "b": the first in its plan, being put back
    st = warm.stats()
    assert st["hot_put_backs"] == 1 and st["warm_up_files"] == 0 and st["warm_up_warming"] == 1, st
    hold.unlink()
    wait_for_log(warm, DONE, done + 1)
    st = warm.stats()
    assert st["hot_files"] == 2 and not [n for n in hot_names(warm) if n.endswith(".part")], st
    before = st["hot_hits"]
    assert warm.path("a").read_bytes() == data["a"]
    assert warm.stats()["hot_hits"] == before + 1, "the warm-up's copy"


SIZE = 16 * MiB


def test_the_warm_up_stops_when_memory_is_short(tmp_path: Path, cgroup: Path, boot: Path,  # noqa: F811
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The daemon in a 1 GiB cgroup (a 256 MiB tier: the warm-up's budget 128 MiB, eight 16 MiB
    snapshots). The warm-up is held mid-way through its third snapshot while an allocator takes the
    cgroup's memory and holds it: memory is short, the watcher evicts the two warmed copies; let go,
    the warm-up stops at once, drops its part copy and puts nothing more back. The allocator is never
    OOM-killed, and every snapshot reads back exactly."""
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log",
              ["--cache-size", "16MiB", "--warm-up", "0.5"])  # fmt: skip
    procs = str(cgroup / "cgroup.procs")

    def join() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    m.preexec = join
    m.start()
    try:
        data = save_all(m, [f"s{i}" for i in range(8)], SIZE, 50)
        # A first warm-up, not held: how many pieces a snapshot's put-back takes here.
        done = reboot(m, boot, 2)
        wait_for_log(m, DONE, done + 1)
        st = m.stats()
        assert st["warm_up_files"] == 8, st
        third = st["warm_up_pieces"] * 5 // 16  # mid-way through the third snapshot
        hold = tmp_path / "warm-hold"
        hold.write_text(str(third))
        monkeypatch.setenv("KVCFS_WARM_UP_HOLD", str(hold))
        done = reboot(m, boot, 3)
        st = wait_until(m, lambda s: s["warm_up_pieces"] >= third)
        assert st["warm_up_budget"] == LIMIT // 8 and st["warm_up_files"] == 2 and st["warm_up_warming"] == 1, st
        assert st["hot_bytes"] == 2 * SIZE, st
        keep = tmp_path / "keep"
        keep.touch()
        from test_pressure import cgroup_in_use

        allocator = in_cgroup(cgroup, ALLOCATOR, str(LIMIT - cgroup_in_use(cgroup) + SIZE), str(keep))
        try:
            st = wait_until(m, lambda s: s["memory_short"] == 1 and s["hot_bytes"] == 0, timeout=120)
            hold.unlink()
            wait_for_log(m, DONE, done + 1)
            st = m.stats()
        finally:
            keep.unlink()
            finished(allocator, "allocator")
        assert st["warm_up_stopped_short"] == 1 and st["warm_up_files"] == 2 and st["warm_up_warming"] == 0, st
        assert "warm-up stopped: memory is short: 2 of" in m.log()
        assert st["pressure_evictions"] >= 2 and st["hot_bytes"] == 0, "the warmed copies were given back"
        assert not [n for n in hot_names(m) if n.endswith(".part")], "its part copy was dropped"
        for name, want in data.items():
            assert m.path(name).read_bytes() == want, name
        assert m.stats()["warm_up_files"] == 2, "nothing more put back once stopped"
    finally:
        m.stop()
