"""Unusual but plausible input: times set before close, a store whose saves all fit in one pack, a
file that starts with a hole, labels that do not fit, rename flags the filesystem does not honour."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import SRC, Mount
from helpers import rand_bytes, wait_closed

MiB, GiB = 1 << 20, 1 << 30
T = 1_600_000_000_123_456_789  # 2020-09-13, a time no save would give


def stub(m: Mount, name: str) -> Path:
    return m.store / "snapshots" / name


def test_times_set_on_a_file_with_unsaved_writes_are_kept(kvfs: Mount) -> None:
    """cp -a and tar -x write, set the times with futimens, then close: the save keeps them."""
    fd = os.open(kvfs.path("f"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, rand_bytes(3 * MiB, 1))
    os.utime(fd, ns=(T, T))
    os.close(fd)
    assert stub(kvfs, "f").stat().st_mtime_ns == T
    # A write after the times were set moves mtime on, as on any filesystem.
    fd = os.open(kvfs.path("g"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, rand_bytes(MiB, 2))
    os.utime(fd, ns=(T, T))
    os.write(fd, b"more")
    os.close(fd)
    assert stub(kvfs, "g").stat().st_mtime_ns != T
    kvfs.remount()
    assert kvfs.path("f").stat().st_mtime_ns == T  # (atime: the host moves it when the stub is read)
    assert kvfs.path("g").stat().st_mtime_ns != T


def pack_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in (store / "packs").glob("*.pack"))


def test_walking_gc_reclaims_the_pack_saves_append_to(kvfs: Mount) -> None:
    """Every save of a small store fits in one pack, the one saves append to: once every snapshot
    is deleted a walking GC gives its space back, without a remount."""
    for i in range(3):
        kvfs.path(f"s{i}").write_bytes(rand_bytes(2 * MiB, 10 + i))
    assert pack_bytes(kvfs.store) > 6 * MiB
    for i in range(3):
        kvfs.path(f"s{i}").unlink()
    wait_closed(kvfs)
    env = dict(os.environ, PYTHONPATH=str(SRC))
    r = subprocess.run(
        [sys.executable, "-m", "kvchunkfs.cli", "gc", "--walk", "--store", str(kvfs.store)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert pack_bytes(kvfs.store) < 64 << 10, r.stdout
    data = rand_bytes(MiB, 20)  # saves go on, into a new pack
    kvfs.path("after").write_bytes(data)
    assert kvfs.path("after").read_bytes() == data


@pytest.mark.parametrize("chunker", ["relayout", "format"])
def test_a_hole_at_the_start_of_a_new_file_is_not_cut(tmp_path: Path, chunker: str) -> None:
    """A write 2 GiB past the end of a new file: the format decision reads the first zeros, then the
    hole is one zero chunk repeated, not 2 GiB of zeros cut and hashed."""
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", ["--chunker", chunker])
    m.start()
    try:
        at = 2 * GiB + 12345
        fd = os.open(m.path("sparse"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(fd, b"tail", at)
        os.close(fd)
        stats = m.stats()
        assert stats["bytes_deduped"] < 64 * MiB, f"the hole was cut and hashed: {stats}"
        with open(m.path("sparse"), "rb") as f:
            assert f.read(MiB) == bytes(MiB)
            f.seek(at - 3)
            assert f.read() == bytes(3) + b"tail"
    finally:
        m.stop()


def test_labels_that_do_not_fit_are_the_request_s_fault(kvfs: Mount) -> None:
    """Labels past the stub's xattr space (one 4 KiB block on ext4): 413, and none of them is set."""
    kvfs.path("s").write_bytes(b"x" * 1000)
    transport = httpx.HTTPTransport(uds=str(kvfs.store / "api.sock"))
    with httpx.Client(transport=transport, base_url="http://kvcfs", timeout=60) as http:
        labels = {f"k{i}": "v" * 1000 for i in range(12)}
        r = http.patch("/snapshots/s", json={"labels": labels})
        assert r.status_code == 413, (r.status_code, r.text)
        assert not [n for n in os.listxattr(kvfs.path("s")) if n.startswith("user.kvcfs.label.")]
        r = http.patch("/snapshots/s", json={"labels": {"model": "llama"}})
        assert r.status_code == 200, r.text
    assert os.getxattr(kvfs.path("s"), "user.kvcfs.label.model") == b"llama"


RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4
AT_FDCWD = -100


def renameat2(old: Path, new: Path, flags: int) -> int:
    """The errno of renameat2(2), 0 on success."""
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags)
    return ctypes.get_errno() if rc else 0


def test_rename_flags_the_filesystem_does_not_honour_are_einval(kvfs: Mount) -> None:
    kvfs.path("a").write_bytes(b"a")
    kvfs.path("b").write_bytes(b"b")
    assert renameat2(kvfs.path("a"), kvfs.path("c"), RENAME_WHITEOUT) == errno.EINVAL
    assert renameat2(kvfs.path("a"), kvfs.path("b"), RENAME_EXCHANGE) == errno.EINVAL
    assert renameat2(kvfs.path("a"), kvfs.path("b"), RENAME_NOREPLACE) == errno.EEXIST
    assert sorted(p.name for p in kvfs.mnt.iterdir()) == ["a", "b"]
    assert renameat2(kvfs.path("a"), kvfs.path("c"), RENAME_NOREPLACE) == 0
    assert kvfs.path("c").read_bytes() == b"a"
