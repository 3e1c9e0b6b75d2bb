"""What an operator can get wrong is one line naming the path and the fix, exit status 2, never a
traceback: a read-only store (a read-only bind mount of a real one), a store of another owner, a
whole-file directory another user could read (fixed when it is an empty one of ours)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SRC, WHOLE_ROOT, Mount, remove_whole_files

CLI = [sys.executable, "-m", "kvchunkfs.cli"]
EMPTY_CONFIG = Path(tempfile.gettempdir()) / "kvcfs-empty-config.toml"
EMPTY_CONFIG.write_text("")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KV_CHUNK_FS_")}
    env.update(PYTHONPATH=str(SRC), KV_CHUNK_FS_CONFIG=str(EMPTY_CONFIG))
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=120)


def one_line(r: subprocess.CompletedProcess[str], *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for word in words:
        assert word in r.stderr, (word, r.stderr)


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[Mount]:
    """A store with one snapshot, unmounted."""
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log")
    m.start()
    try:
        m.path("slot0.bin").write_bytes(os.urandom(200_000))
    finally:
        m.stop()
        remove_whole_files(m.whole)
    yield m


@pytest.fixture
def read_only(stored: Mount, tmp_path: Path) -> Iterator[Path]:
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(stored.store), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        yield ro
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="a bind mount needs root")
@pytest.mark.parametrize("command", [["mount", "MNT"], ["fsck"], ["stats"], ["gc"], ["tree"]])
def test_a_read_only_store_is_one_line(read_only: Path, tmp_path: Path, command: list[str]) -> None:
    (tmp_path / "mnt2").mkdir()
    args = [str(tmp_path / "mnt2") if a == "MNT" else a for a in command]
    one_line(run(*args, "--store", str(read_only)), str(read_only), "read-only", "remount")
    assert run("ls", "--store", str(read_only)).returncode == 0, "listing needs no write"


def _as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    """The command as uid 65534, through the system's Python (the tests' interpreter may live in a
    directory only root can enter) with the same packages, if it is the same minor version."""
    site = next(p for p in sys.path if p.endswith("site-packages"))
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "PYTHONPATH": f"{SRC}:{site}", "KV_CHUNK_FS_CONFIG": str(EMPTY_CONFIG)}
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-m",
                           "kvchunkfs.cli", *args], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


def test_a_store_of_another_user_is_one_line(stored: Mount, tmp_path: Path) -> None:
    probe = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                           text=True)  # fmt: skip
    if os.geteuid() != 0 or probe.stdout.strip() != str(sys.version_info[:2]):
        pytest.skip("needs root and a system Python of the tests' version to run as another user")
    EMPTY_CONFIG.chmod(0o644)
    hidden = _as_nobody("stats", "--store", str(stored.store))  # behind pytest's 0700 directories
    one_line(hidden, str(tmp_path), "Permission denied", "run as the owner")
    for path in (tmp_path, tmp_path.parent, tmp_path.parent.parent):  # now only the store's own mode stops it
        path.chmod(path.stat().st_mode | 0o011)
    for command in ("stats", "fsck", "gc", "ls"):
        r = _as_nobody(command, "--store", str(stored.store))
        one_line(r, str(stored.store), "run as the owner")
    assert "owner uid 0" in _as_nobody("stats", "--store", str(stored.store)).stderr


def _whole_dir(mode: int) -> Path:
    WHOLE_ROOT.mkdir(mode=0o700, exist_ok=True)
    path = WHOLE_ROOT / uuid.uuid4().hex
    path.mkdir()
    path.chmod(mode)
    return path


def test_a_whole_files_dir_others_can_read_is_one_line(tmp_path: Path) -> None:
    whole = _whole_dir(0o755)
    (whole / "theirs").write_bytes(b"x")
    (tmp_path / "mnt").mkdir()
    try:
        r = run("mount", "--store", str(tmp_path / "store"), "--whole-files-dir", str(whole), str(tmp_path / "mnt"))
        one_line(r, str(whole), "chmod 700")
        assert stat.S_IMODE(whole.stat().st_mode) == 0o755, "a directory holding files is the operator's to fix"
    finally:
        remove_whole_files(whole)


def test_an_empty_whole_files_dir_of_ours_gets_mode_0700(tmp_path: Path) -> None:
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log")
    m.whole = _whole_dir(0o755)
    m.start()
    try:
        m.path("a").write_bytes(b"y" * 100_000)
        assert m.path("a").read_bytes() == b"y" * 100_000
        assert stat.S_IMODE(m.whole.stat().st_mode) == 0o700
        assert "set to 0700" in m.log()
    finally:
        m.stop()
        remove_whole_files(m.whole)


def test_a_missing_store_and_a_bad_setting_are_one_line(tmp_path: Path) -> None:
    for command in ("ls", "stats", "fsck", "gc"):
        one_line(run(command, "--store", str(tmp_path / "nothing")), str(tmp_path / "nothing"))
    one_line(run("stats", "--hot-tier-size", "lots"), "hot_tier_size")
