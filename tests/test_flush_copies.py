"""Only the writer's own close commits: a FLUSH from another copy of its descriptor (a ``dup()``
closed, a child's close-on-exec) must not install a prefix or a mix of versions, neither as the stub
nor after a kill -9; the writer's own ``close()`` still commits before it returns."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Callable

import pytest
from conftest import Mount
from helpers import rand_bytes

from kvchunkfs.store import stubs

MiB = 1 << 20


def stub_of(m: Mount, name: str) -> tuple[bytes, int | None, str | None]:
    """The stub as the store holds it, what a crash right now would leave: its index, the size of
    the content (its staged save's if it names one) and the staged save's file."""
    path = m.store / "snapshots" / name
    data, size = stubs.read_stub(path)
    staged = stubs.read_staged(path)
    return (data, size, None) if staged is None else (data, staged.size, staged.name)


def write_all(fd: int, data: bytes, offset: int = 0) -> None:
    view = memoryview(data)
    for i in range(0, len(data), MiB):
        os.pwrite(fd, view[i : i + MiB], offset + i)


def run_child() -> None:
    subprocess.run(["true"], check=True)  # its copy of the fd is closed at exec (or by close_fds)


def close_a_dup(fd: int) -> None:
    os.close(os.dup(fd))


def crash_and_remount(m: Mount, fd: int) -> None:
    m.kill()
    with contextlib.suppress(OSError):  # the daemon is gone
        os.close(fd)
    m.start_settled()


@pytest.mark.parametrize("other_close", [run_child, close_a_dup], ids=["child", "dup"])
def test_other_copy_closed_during_o_trunc_rewrite_commits_nothing(
    kvfs: Mount, other_close: Callable[[int], None]
) -> None:
    old, new = rand_bytes(6 * MiB, 1), rand_bytes(5 * MiB, 2)
    kvfs.path("s").write_bytes(old)
    kvfs.ingested()
    before = stub_of(kvfs, "s")
    assert before[1] == len(old)
    fd = os.open(kvfs.path("s"), os.O_WRONLY | os.O_TRUNC)
    write_all(fd, new)
    if other_close is run_child:
        run_child()
    else:
        close_a_dup(fd)
    assert stub_of(kvfs, "s") == before, "a FLUSH from another copy installed the half-written file"
    crash_and_remount(kvfs, fd)
    assert kvfs.path("s").read_bytes() == old


def test_other_copy_closed_during_in_place_rewrite_commits_nothing(kvfs: Mount) -> None:
    old, patch = rand_bytes(6 * MiB, 3), rand_bytes(3 * MiB, 4)
    kvfs.path("s").write_bytes(old)
    kvfs.ingested()
    before = stub_of(kvfs, "s")
    fd = os.open(kvfs.path("s"), os.O_WRONLY)
    write_all(fd, patch, 2 * MiB)  # not yet the whole new version: the writer goes on after the child
    run_child()
    close_a_dup(fd)
    assert stub_of(kvfs, "s") == before
    crash_and_remount(kvfs, fd)
    assert kvfs.path("s").read_bytes() == old


def test_dup_closed_by_another_thread_after_the_opening_thread_ended(kvfs: Mount) -> None:
    """FUSE names the thread that opened the file; its process's table is the one that counts."""
    old, new = rand_bytes(2 * MiB, 5), rand_bytes(3 * MiB, 6)
    kvfs.path("s").write_bytes(old)
    kvfs.ingested()
    before = stub_of(kvfs, "s")
    fds: list[int] = []
    opener = threading.Thread(target=lambda: fds.append(os.open(kvfs.path("s"), os.O_WRONLY | os.O_TRUNC)))
    opener.start()
    opener.join()
    write_all(fds[0], new)
    close_a_dup(fds[0])
    assert stub_of(kvfs, "s") == before
    crash_and_remount(kvfs, fds[0])
    assert kvfs.path("s").read_bytes() == old


def test_writers_own_close_commits_before_it_returns(kvfs: Mount) -> None:
    """After copies were closed (a child, a dup), the writer's close() still commits at once: a kill -9
    right after it keeps the new version."""
    old, new = rand_bytes(6 * MiB, 7), rand_bytes(5 * MiB, 8)
    kvfs.path("s").write_bytes(old)
    fd = os.open(kvfs.path("s"), os.O_WRONLY | os.O_TRUNC)
    write_all(fd, new)
    run_child()
    close_a_dup(fd)
    child = subprocess.Popen(["sleep", "30"], pass_fds=[fd])  # a copy that outlives the writer's close
    try:
        os.close(fd)
        assert stub_of(kvfs, "s")[1] == len(new)
        kvfs.kill()
    finally:
        child.kill()
        child.wait()
    kvfs.start_settled()
    assert kvfs.path("s").read_bytes() == new


def test_fsync_through_a_copy_still_commits(kvfs: Mount) -> None:
    """An explicit fsync is the client's own commit, whichever copy it goes through."""
    new = rand_bytes(3 * MiB, 9)
    fd = os.open(kvfs.path("s"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    write_all(fd, new)
    dup = os.dup(fd)
    os.fsync(dup)
    os.close(dup)
    assert stub_of(kvfs, "s")[1] == len(new)
    crash_and_remount(kvfs, fd)
    assert kvfs.path("s").read_bytes() == new
