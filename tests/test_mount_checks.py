"""What ``kv-chunk-fs mount`` refuses before it mounts, each with one line and exit status 2: a
mountpoint that is already a live mount (or inside one), named with the daemon that serves it, and a
store path that is not a directory (the other commands taking ``--store`` too)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SRC, TESTS, Mount, is_mounted
from helpers import rand_bytes


def kv_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    cmd = [sys.executable, "-m", "kvchunkfs.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def refused_mount(store: Path, mountpoint: Path) -> str:
    """``kv-chunk-fs mount`` that must be refused: its stderr. A mount that goes ahead instead is
    stopped and its mount taken down again before the test fails."""
    before = len(mounts_at(mountpoint))
    env = dict(os.environ, PYTHONPATH=str(SRC))
    cmd = [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(store), str(mountpoint)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        if len(mounts_at(mountpoint)) > before:
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
        raise AssertionError(f"mounted over a live mount: {err[-2000:]}") from None
    assert proc.returncode == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def mounts_at(path: Path) -> list[str]:
    """The mount table's lines for ``path`` (source, type)."""
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    return [" ".join(r[r.index("-", 6) + 1 :][:2]) for r in rows if r[4] == str(path)]


def test_the_mount_table_names_the_store(kvfs: Mount) -> None:
    assert mounts_at(kvfs.mnt) == [f"fuse.kv-chunk-fs kv-chunk-fs:{kvfs.store}"]


@pytest.mark.parametrize("holding", [False, True], ids=["empty", "with-snapshots"])
def test_a_live_mountpoint_is_refused_naming_its_daemon(kvfs: Mount, tmp_path: Path, holding: bool) -> None:
    data = rand_bytes(1 << 20, 1)
    if holding:
        kvfs.path("a").write_bytes(data)
    assert kvfs.proc is not None
    err = refused_mount(tmp_path / "second", kvfs.mnt)
    line = f"{kvfs.mnt} is already the kv-chunk-fs mount at {kvfs.mnt} (daemon pid {kvfs.proc.pid}, store {kvfs.store})"
    assert line in err and "--nonempty" not in err, err
    assert len(mounts_at(kvfs.mnt)) == 1  # nothing stacked over it
    assert not (tmp_path / "second").exists()  # refused before the store was touched
    if holding:
        assert kvfs.path("a").read_bytes() == data


def test_a_directory_inside_a_live_mount_is_refused(kvfs: Mount, tmp_path: Path) -> None:
    kvfs.path("sub").mkdir()
    err = refused_mount(tmp_path / "second", kvfs.path("sub"))
    assert f"{kvfs.path('sub')} is inside the kv-chunk-fs mount at {kvfs.mnt}" in err, err
    assert mounts_at(kvfs.path("sub")) == []


def test_another_fuse_file_system_is_refused(tmp_path: Path) -> None:
    """Any live FUSE mount, not only ours: here the tests' power-loss layer (tests/powerfs.py)."""
    (tmp_path / "backing").mkdir()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with open(tmp_path / "powerfs.log", "wb") as log:
        other = subprocess.Popen([sys.executable, str(TESTS / "powerfs.py"), str(tmp_path / "backing"), str(mnt), "1"],
                                 stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not is_mounted(mnt):
            assert other.poll() is None and time.monotonic() < deadline, (tmp_path / "powerfs.log").read_text()
            time.sleep(0.02)
        err = refused_mount(tmp_path / "store", mnt)
        assert f"{mnt} is already a fuse mount (powerfs) at {mnt}; unmount it first" in err, err
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
        other.wait(timeout=60)


def test_a_store_path_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    store = tmp_path / "store"
    store.write_bytes(b"not a store")
    for args in (["mount", str(tmp_path / "mnt")], ["export-store", str(tmp_path / "out")], ["gc"], ["fsck"],
                 ["ls"]):  # fmt: skip
        for where in (store, store / "sub"):  # the file itself, and a path through it
            r = kv_cli(*args, "--store", str(where))
            assert r.returncode == 2, (args, where, r.stderr)
            assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, (args, r.stderr)
            assert str(where) in r.stderr and "not a directory" in r.stderr.lower(), r.stderr
    assert mounts_at(tmp_path / "mnt") == []
    assert store.read_bytes() == b"not a store"
