"""Unusual but plausible input: times set before close, a store whose saves all fit in one pack, a
file that starts with a hole, labels that do not fit, rename flags the filesystem does not honour,
special files and mknod, a caller's own errors in the log."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import SRC, Mount
from helpers import rand_bytes, wait_closed

from kvchunkfs.store import stubs

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
    kvfs.ingested()  # the saves are in the pack once they are stored
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


def errno_of(call: Callable[[], object]) -> int:
    with pytest.raises(OSError) as e:
        call()
    return e.value.errno or 0


def errno_or_0(call: Callable[[], object]) -> int:
    try:
        call()
    except OSError as e:
        return e.errno or 0
    return 0


def test_special_files_are_eperm_and_mknod_of_a_regular_file_makes_an_empty_snapshot(kvfs: Mount) -> None:
    """A snapshot is a regular file: symlinks, FIFOs, sockets and devices are refused with EPERM (as
    hard links are), while mknod(S_IFREG), as any filesystem has it, makes an empty snapshot."""
    kvfs.path("f").write_bytes(b"f")
    x = kvfs.path("x")
    refused = {
        "symlink": lambda: os.symlink("f", x),
        "link": lambda: os.link(kvfs.path("f"), x),
        "fifo": lambda: os.mkfifo(x),
        "socket": lambda: os.mknod(x, stat.S_IFSOCK | 0o600),
        "char device": lambda: os.mknod(x, stat.S_IFCHR | 0o600, os.makedev(1, 3)),
        "block device": lambda: os.mknod(x, stat.S_IFBLK | 0o600, os.makedev(7, 0)),
    }
    assert {what: errno_of(call) for what, call in refused.items()} == dict.fromkeys(refused, errno.EPERM)
    assert sorted(os.listdir(kvfs.mnt)) == ["f"]

    old_umask = os.umask(0o022)
    try:
        os.mknod(kvfs.path("m"), stat.S_IFREG | 0o640)
        os.mknod(kvfs.path("plain"))  # no type: a regular file too
    finally:
        os.umask(old_umask)
    assert errno_of(lambda: os.mknod(kvfs.path("m"), stat.S_IFREG | 0o600)) == errno.EEXIST
    st = os.stat(kvfs.path("m"))
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640 and st.st_size == 0
    assert stat.S_ISREG(os.stat(kvfs.path("plain")).st_mode)
    assert sorted(os.listdir(kvfs.mnt)) == ["f", "m", "plain"]
    assert kvfs.path("m").read_bytes() == b""
    assert stubs.read_index(stub(kvfs, "m")).size == 0  # a real snapshot in the store, not a bare file
    transport = httpx.HTTPTransport(uds=str(kvfs.store / "api.sock"))
    with httpx.Client(transport=transport, base_url="http://kvcfs", timeout=60) as http:
        r = http.get("/snapshots/m")
        assert r.status_code == 200 and r.json()["size"] == 0, r.text
    kvfs.remount()
    assert kvfs.path("m").read_bytes() == b""
    kvfs.path("m").write_bytes(b"written after mknod")
    assert kvfs.path("m").read_bytes() == b"written after mknod"
    assert "ERROR" not in kvfs.log()


def test_a_caller_s_own_errors_are_not_logged_as_errors(tmp_path: Path) -> None:
    """Sizes past max_file_size are the caller's mistake: EFBIG and a debug line, never an ERROR
    line (any local user could fill the log with them)."""
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", ["--log-level", "debug"])
    m.start()
    try:
        fd = os.open(m.path("big"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.write(fd, b"head")
            assert errno_of(lambda: os.ftruncate(fd, (1 << 63) - 1)) == errno.EFBIG
            assert errno_of(lambda: os.truncate(m.path("big"), 1 << 62)) == errno.EFBIG
        finally:
            os.close(fd)
        assert m.path("big").read_bytes() == b"head"
        # A write past the bound: refused by the write when served, by the save (the close) when
        # the kernel wrote it into the staged file itself; the previous version stays.
        fd = os.open(m.path("big"), os.O_RDWR)
        wrote = errno_or_0(lambda: os.pwrite(fd, b"x", 1 << 62))
        closed = errno_or_0(lambda: os.close(fd))
        assert errno.EFBIG in (wrote, closed), (wrote, closed)
        assert m.path("big").read_bytes() == b"head"
    finally:
        m.stop()
    lines = m.log().splitlines()
    assert not [line for line in lines if " ERROR " in line or " WARNING " in line], m.log()[-3000:]
    efbig = [line for line in lines if " DEBUG " in line and "max_file_size" in line]
    assert len(efbig) >= 3, m.log()[-3000:]  # each refusal is still named in the log
