"""The memory tier's directory and its life: one no other user can pre-empt, sized from the
machine, freed or kept at a clean stop as the operator chose, and given back once its store is
gone. Daemons here use the default directory (``--whole-files-dir ""``)."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MOUNTED, SRC, Mount
from helpers import rand_bytes

MiB = 1 << 20
RUN = Path("/run/kv-chunk-fs")
DEFAULT_DIR = ["--whole-files-dir", ""]


def tier_of(m: Mount) -> Path:
    found = re.findall(r"memory tier (\S+): staged saves", m.log())
    assert found, m.log()[-3000:]
    return Path(found[-1])


@pytest.fixture
def default_tier(tmp_path: Path) -> Iterator[list[Mount]]:
    """Mounts whose tiers are in the default place; each tier freed at the end."""
    from kvchunkfs.store import tierdir

    made: list[Mount] = []
    yield made
    for m in made:
        m.stop()
        with open(m.log_path) as f:
            for root in set(re.findall(r"memory tier (\S+): staged saves", f.read())):
                tierdir.free(Path(root))


def mount(tmp_path: Path, name: str, extra: list[str], made: list[Mount]) -> Mount:
    m = Mount(tmp_path / f"{name}-store", tmp_path / f"{name}-mnt", tmp_path / f"{name}.log", DEFAULT_DIR + extra)
    made.append(m)
    m.start()
    return m


def test_the_default_tier_is_sized_from_the_machine_and_shown(tmp_path: Path, default_tier: list[Mount]) -> None:
    from kvchunkfs.store import membudget, memfs, tierdir

    m = mount(tmp_path, "a", [], default_tier)
    root = tier_of(m)
    assert root.parent == tierdir.RUN
    st = m.stats()
    machine = membudget.machine_memory(membudget.own_cgroup())
    assert st["tier_size"] == machine // 4
    assert st["hot_budget"] == st["tier_size"]
    assert 0 < st["tier_fs_size"] <= 2 * st["tier_size"]
    assert memfs.own_mount(root)
    sv = os.statvfs(root)
    assert st["tier_size"] <= sv.f_blocks * sv.f_frsize <= 2 * st["tier_size"] + 4096, "sized from the budget"
    data = rand_bytes(4 * MiB, 1)
    m.path("s").write_bytes(data)
    m.ingested()
    st = m.stats()
    assert (st["hot_files"], st["hot_bytes"], st["staged_bytes"]) == (1, 4 * MiB, 0)


def test_a_clean_stop_frees_the_tier_or_keeps_it_as_chosen(tmp_path: Path, default_tier: list[Mount]) -> None:
    from kvchunkfs.store import membudget, memfs, tierdir

    data = rand_bytes(6 * MiB, 2)
    freed = mount(tmp_path, "free", ["--memory-tier-on-stop", "free"], default_tier)
    kept = mount(tmp_path, "keep", ["--memory-tier-on-stop", "keep"], default_tier)
    for m in (freed, kept):
        m.path("s").write_bytes(data)
        m.ingested()
        assert m.path("s").read_bytes() == data
        m.stop()
    root = tier_of(freed)
    assert not root.exists() and not memfs.own_mount(root), "nothing held by a stopped daemon"
    assert f"the memory tier {root} is freed" in freed.log()
    root = tier_of(kept)
    held = tierdir.held_bytes(root)
    assert 6 * MiB <= held <= membudget.default_tier_size(membudget.own_cgroup()), "no more than the tier's size"
    assert "free-memory-tiers --all" in kept.log() and memfs.own_mount(root)
    kept.start()  # the next daemon reads its hot copy
    before = kept.stats()["hot_hits"]
    assert kept.path("s").read_bytes() == data
    assert kept.stats()["hot_hits"] == before + 1
    kept.stop()
    r = subprocess.run([sys.executable, "-m", "kvchunkfs.cli", "free-memory-tiers", "--all"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(SRC)))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert str(root) in r.stdout and not root.exists() and not memfs.own_mount(root)


def test_the_tier_of_a_deleted_store_is_freed_by_the_next_daemon(tmp_path: Path, default_tier: list[Mount]) -> None:
    from kvchunkfs.store import memfs, tierdir

    old = mount(tmp_path, "old", ["--memory-tier-on-stop", "keep"], default_tier)
    old.path("s").write_bytes(rand_bytes(5 * MiB, 3))
    old.ingested()
    old.stop()
    orphan = tier_of(old)
    assert tierdir.held_bytes(orphan) >= 5 * MiB and memfs.own_mount(orphan)
    shutil.rmtree(old.store)
    new = mount(tmp_path, "new", [], default_tier)
    assert not orphan.exists() and not memfs.own_mount(orphan)
    assert f"freed the memory tier {orphan}" in new.log() and "is gone" in new.log()


def test_a_tier_a_live_daemon_serves_is_never_freed(tmp_path: Path, default_tier: list[Mount]) -> None:
    a = mount(tmp_path, "a", [], default_tier)
    a.path("s").write_bytes(rand_bytes(3 * MiB, 4))
    a.ingested()
    mount(tmp_path, "b", [], default_tier)
    r = subprocess.run([sys.executable, "-m", "kvchunkfs.cli", "free-memory-tiers", "--all"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(SRC)))  # fmt: skip
    assert r.returncode == 0 and str(tier_of(a)) not in r.stdout
    assert a.stats()["hot_files"] == 1 and (tier_of(a) / "owner.json").exists()


# -- a directory another user made first -----------------------------------------------------------


def _nobody() -> tuple[int, int]:
    pw = pwd.getpwnam("nobody")
    return pw.pw_uid, pw.pw_gid


def test_a_directory_another_user_made_at_the_old_default_path_does_not_stop_the_mount(tmp_path: Path) -> None:
    """/dev/shm is world-writable and empty after a boot: a user's cron job makes
    /dev/shm/kv-chunk-fs-0 first. The daemon (in a mount namespace of its own, with a /dev/shm of
    its own, so the machine's is untouched) mounts anyway, and what it stages no other user can read."""
    uid, gid = _nobody()
    store, mnt, log = tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log"
    mnt.mkdir()
    script = (
        "set -e; mount --make-rprivate /; mount -t tmpfs -o mode=1777 shm /dev/shm; "
        f"setpriv --reuid={uid} --regid={gid} --clear-groups mkdir -m 0777 /dev/shm/kv-chunk-fs-0; "
        f"exec {sys.executable} -m kvchunkfs.cli mount --store {store} --whole-files-dir '' {mnt}"
    )
    env = dict(os.environ, PYTHONPATH=str(SRC))
    with open(log, "wb") as out:
        proc = subprocess.Popen(["unshare", "--mount", "sh", "-c", script], stdout=out, stderr=out, env=env)
    try:
        deadline = time.monotonic() + 60
        while MOUNTED not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        text = log.read_text()
        if proc.poll() is not None:  # refusing is allowed: exit 2 with one line, no traceback
            assert proc.returncode == 2 and "Traceback" not in text, text
            return
        assert "Traceback" not in text, text

        def inside(cmd: str, user: bool = False) -> subprocess.CompletedProcess[str]:
            drop = f"setpriv --reuid={uid} --regid={gid} --clear-groups " if user else ""
            return subprocess.run(["nsenter", "-t", str(proc.pid), "-m", "sh", "-c", drop + cmd],
                                  capture_output=True, text=True)  # fmt: skip

        data = rand_bytes(2 * MiB, 5)
        (tmp_path / "src").write_bytes(data)
        assert inside(f"cp {tmp_path / 'src'} {mnt / 's'} && cmp {tmp_path / 'src'} {mnt / 's'}").returncode == 0
        root = Path(re.findall(r"memory tier (\S+): staged saves", text)[-1])
        assert root.parent == RUN
        assert "/dev/shm/kv-chunk-fs-0 is not this user's own private directory" in text
        listing = inside(f"ls -la {root} {root}/hot {root}/staged").stdout
        assert listing.count("drwx------") >= 3, listing
        r = inside(f"ls {root}/hot {root}/staged", user=True)
        assert r.returncode != 0 and "Permission denied" in r.stderr
        r = inside(f"ls {RUN}", user=True)
        assert r.returncode != 0 and "Permission denied" in r.stderr
        assert json.loads(inside(f"cat {root}/owner.json").stdout)["store"] == str(store)
    finally:
        if proc.poll() is None:
            subprocess.run(["nsenter", "-t", str(proc.pid), "-m", "fusermount3", "-u", str(mnt)], check=False)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert not root.exists(), "a clean stop freed it"


def test_a_whole_files_dir_of_another_user_is_one_line_and_exit_2(tmp_path: Path) -> None:
    uid, gid = _nobody()
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, uid, gid)
    (tmp_path / "mnt").mkdir()
    r = subprocess.run([sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(tmp_path / "store"),
                        "--whole-files-dir", str(theirs), str(tmp_path / "mnt")], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(SRC)), timeout=120)  # fmt: skip
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    refusals = [line for line in r.stderr.splitlines() if line.startswith("kv-chunk-fs: ")]
    assert len(refusals) == 1 and str(theirs) in refusals[0] and "uid" in refusals[0], r.stderr


def test_closes_wait_once_ingestion_falls_seconds_behind(kvfs: Mount, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """With durability=close a power cut loses the saves not yet stored: closes wait once the oldest
    is more than the window behind, long before the byte bound. Ingestion is held here (a slow
    store), then let go: every save completes and reads back."""
    hold = tmp_path / "hold-ingestion"
    monkeypatch.setenv("KVCFS_INGEST_HOLD", str(hold))
    hold.touch()
    kvfs.remount()
    sums: dict[str, bytes] = {}
    errors: list[BaseException] = []

    def saves() -> None:
        try:
            for i in range(40):
                data = rand_bytes(2 * MiB, 100 + i)
                kvfs.path(f"s{i}").write_bytes(data)
                sums[f"s{i}"] = data
                time.sleep(0.25)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    import threading

    writer = threading.Thread(target=saves)
    writer.start()
    while writer.is_alive() and not kvfs.stats()["ingest_waits"]:
        time.sleep(0.1)
    st = kvfs.stats()
    waited = st["ingest_waits"]
    hold.unlink()
    writer.join()
    assert not errors, errors
    assert waited >= 1, "a close waited for ingestion"
    assert st["ingest_queue_bytes"] < st["ingest_backlog_limit"] // 8, "for time, not bytes"
    assert len(sums) == 40, "every save completed once ingestion caught up"
    kvfs.ingested()
    for name, data in sums.items():
        assert kvfs.path(name).read_bytes() == data


def test_more_waiting_closes_than_worker_threads_do_not_stall_the_mount(
    kvfs: Mount, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closes waiting for ingestion to catch up do not take the daemon's worker threads (trio has
    40): ingestion's install needs one, so 48 waiting closes would otherwise wait for ever."""
    import threading

    hold = tmp_path / "hold-ingestion"
    monkeypatch.setenv("KVCFS_INGEST_HOLD", str(hold))
    hold.touch()
    kvfs.remount()
    kvfs.path("first").write_bytes(rand_bytes(MiB, 200))  # staged, not stored: ingestion falls behind
    time.sleep(6)  # past the 5 s window: every close from now on waits
    errors: list[BaseException] = []
    sums: dict[str, bytes] = {}

    def save(i: int) -> None:
        try:
            data = rand_bytes(MiB, 300 + i)
            kvfs.path(f"c{i}").write_bytes(data)
            sums[f"c{i}"] = data
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    writers = [threading.Thread(target=save, args=(i,), daemon=True) for i in range(48)]
    for w in writers:
        w.start()
    time.sleep(3)  # every close is waiting now
    hold.unlink()
    for w in writers:
        w.join(timeout=300)
    assert not any(w.is_alive() for w in writers), "closes still waiting: the mount stalled"
    assert not errors, errors
    kvfs.ingested()
    for name, data in sums.items():
        assert kvfs.path(name).read_bytes() == data
