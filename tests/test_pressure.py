"""Memory pressure wins: in a memory cgroup of 1 GiB made here, the daemon, a full hot tier and a
process allocating memory step by step. The allocator is never OOM-killed, the tier shrinks, every
snapshot reads back exactly, and no save fails, also with saves running during the squeeze.

Pages are charged to the cgroup of the process that first touches them: the daemon (moved into the
cgroup once mounted: what it puts back) and the writers (started in it: with passthrough, a save's
staged pages are the writer's)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SRC, Mount

MiB = 1 << 20
LIMIT = 1 << 30
V1 = Path("/sys/fs/cgroup/memory")
SIZE = 24 * MiB  # each snapshot
FILL = 8  # snapshots that fill the hot tier (a quarter of the cgroup: 256 MiB)


@pytest.fixture
def cgroup() -> Iterator[Path]:
    if not (V1 / "memory.limit_in_bytes").exists():
        v2 = Path("/sys/fs/cgroup")
        if not (v2 / "cgroup.controllers").exists():
            pytest.fail("no memory cgroup controller (v1 or v2) on this host")
        group = v2 / f"kvcfs-pt-{uuid.uuid4().hex[:8]}"
        group.mkdir()
        (group / "memory.max").write_text(str(LIMIT))
        (group / "memory.swap.max").write_text("0")
    else:
        group = V1 / f"kvcfs-pt-{uuid.uuid4().hex[:8]}"
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(LIMIT))
        with contextlib.suppress(OSError):
            (group / "memory.swappiness").write_text("0")
    try:
        yield group
    finally:
        parent = group.parent
        procs = (group / "cgroup.procs").read_text().split()
        for pid in procs:  # whatever is left goes back to where the test runs
            with open(parent / "cgroup.procs", "w") as f:
                f.write(pid)
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def in_cgroup(group: Path, code: str, *args: str) -> subprocess.Popen[str]:
    """A Python process started inside ``group`` (it joins before running ``code``)."""
    prologue = f"open({str(group / 'cgroup.procs')!r}, 'w').write(str(__import__('os').getpid()))\n"
    return subprocess.Popen([sys.executable, "-c", prologue + textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(SRC)))  # fmt: skip


WRITER = """
import hashlib, json, os, random, sys
mnt, first, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out = {}
for i in range(first, first + count):
    data = random.Random(i).randbytes(size)
    with open(os.path.join(mnt, f"s{i}"), "wb") as f:
        for k in range(0, len(data), 1 << 20):
            f.write(data[k:k + (1 << 20)])
    out[f"s{i}"] = hashlib.sha256(data).hexdigest()
print(json.dumps(out))
"""

ALLOCATOR = """
import os, sys, time
target, step = int(sys.argv[1]), 8 << 20
held = []
while sum(len(b) for b in held) < target:
    b = bytearray(step)
    for k in range(0, step, 4096):
        b[k] = 1
    held.append(b)
    time.sleep(0.02)
time.sleep(1.0)
while len(sys.argv) > 2 and os.path.exists(sys.argv[2]):  # held until the test lets go
    time.sleep(0.05)
print("held", sum(len(b) for b in held) >> 20)
"""


def write(group: Path, m: Mount, first: int, count: int) -> subprocess.Popen[str]:
    return in_cgroup(group, WRITER, str(m.mnt), str(first), str(count), str(SIZE))


def finished(p: subprocess.Popen[str], what: str) -> str:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, f"{what} exited {p.returncode} (-9: OOM-killed): {err[-2000:]}"
    return out


def cgroup_in_use(group: Path) -> int:
    from kvchunkfs.store.membudget import Cgroup

    used = Cgroup(group, not str(group).startswith(str(V1))).in_use()
    assert used is not None
    return used


@pytest.fixture
def squeezed(tmp_path: Path, cgroup: Path) -> Iterator[tuple[Mount, Path, dict[str, str]]]:
    """A daemon in the cgroup with a full hot tier (its default budget: a quarter of 1 GiB)."""
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", ["--cache-size", "16MiB"])
    procs = str(cgroup / "cgroup.procs")

    def join() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    m.preexec = join  # the daemon starts in the cgroup: its budget follows the cgroup's limit
    m.start()
    try:
        sums = json.loads(finished(write(cgroup, m, 0, FILL), "writer"))
        m.ingested()
        st = m.stats()
        assert st["tier_size"] == LIMIT // 4, "the budget follows the cgroup's limit"
        assert st["hot_bytes"] >= (FILL - 2) * SIZE, st
        yield m, cgroup, sums
    finally:
        m.stop()


def check_all(m: Mount, sums: dict[str, str]) -> None:
    for name, digest in sums.items():
        assert hashlib.sha256(m.path(name).read_bytes()).hexdigest() == digest, name


def squeeze(group: Path, m: Mount, hold: Path | None = None) -> subprocess.Popen[str]:
    """An allocator that needs half of the hot tier's memory beyond what the cgroup has left (and
    holds it while ``hold`` exists)."""
    hot = m.stats()["hot_bytes"]
    target = LIMIT - cgroup_in_use(group) + hot // 2
    return in_cgroup(group, ALLOCATOR, str(target), *([str(hold)] if hold else []))


def test_an_allocator_beside_a_full_hot_tier_is_never_oom_killed(
    squeezed: tuple[Mount, Path, dict[str, str]],
) -> None:
    m, group, sums = squeezed
    before = m.stats()
    finished(squeeze(group, m), "allocator")
    after = m.stats()
    assert after["pressure_episodes"] > before["pressure_episodes"]
    assert after["pressure_evictions"] > 0 and after["hot_bytes"] < before["hot_bytes"]
    assert "memory is short (cgroup" in m.log()
    print(
        f"\npressure: {after['pressure_evictions']} copies ({after['pressure_evicted_bytes'] >> 20} MiB) evicted, "
        f"hot {before['hot_bytes'] >> 20} -> {after['hot_bytes'] >> 20} MiB; first eviction done "
        f"{after['pressure_reaction_us'] / 1000:.1f} ms after memory was found short (looks every 100 ms)"
    )
    assert m.proc is not None and m.proc.poll() is None, "the daemon lives"
    check_all(m, sums)
    assert "ERROR" not in m.log(), m.log()[-3000:]


def test_saves_during_the_squeeze_all_succeed(squeezed: tuple[Mount, Path, dict[str, str]], tmp_path: Path) -> None:
    """Saves from inside the cgroup race the allocator; more arrive while memory stays short (the
    allocator holds its memory): those are stored as they close, the tier does not grow."""
    m, group, sums = squeezed
    hold = tmp_path / "hold"
    hold.touch()
    allocator = squeeze(group, m, hold)
    writers = [write(group, m, 100 + 10 * k, 3) for k in range(2)]
    for w in writers:
        sums |= json.loads(finished(w, "writer"))
    while not m.stats()["memory_short"] and allocator.poll() is None:
        time.sleep(0.05)
    staged_before = m.stats()["staged_saves"]
    for i in range(3):  # from outside the cgroup: only what the daemon does is charged to it
        data = os.urandom(SIZE)
        m.path(f"late{i}").write_bytes(data)
        sums[f"late{i}"] = hashlib.sha256(data).hexdigest()
    st = m.stats()
    hold.unlink()
    finished(allocator, "allocator")
    assert st["memory_short"] and st["saves_inline"] >= 3 and st["staged_saves"] == staged_before, st
    m.ingested()
    st = m.stats()
    assert st["pressure_episodes"] >= 1 and st["pressure_evictions"] > 0
    print(
        f"\nsaves during the squeeze: {len(sums) - FILL} saved, {st['saves_inline']} stored as they closed, "
        f"{st['pressure_evictions']} copies evicted"
    )
    assert m.proc is not None and m.proc.poll() is None
    check_all(m, sums)
    assert "ERROR" not in m.log(), m.log()[-3000:]
