"""``Operations`` driven in process, without a mount (as S3QL's t3_fs_api): races between requests
that a real mount only hits by luck are set up here exactly, in milliseconds.

Each test is a regression test for a bug of the architecture issue (#8): concurrent opens, a failed
O_TRUNC open, a bug in the chunker, lost counter updates, and the FUSE thread waiting on a lock a
worker holds across I/O.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
from helpers import prepare_commit, rand_bytes, write_content

from kvchunkfs.file.content import FileContent
from kvchunkfs.file.files import Files
from kvchunkfs.format.chunker import BATCH
from kvchunkfs.fuse import api as fuse
from kvchunkfs.fuse.operations import Operations
from kvchunkfs.store import stubs
from kvchunkfs.store.packs import StoreCounters
from kvchunkfs.store.repository import Repository

CTX = SimpleNamespace(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), umask=0o022)
MiB = 1 << 20


class Harness:
    def __init__(self, root: Path) -> None:
        self.repo = Repository(root)
        self.files = Files(self.repo)
        self.ops = Operations(self.files)

    async def create(self, name: str, data: bytes) -> int:
        info, attrs = await self.ops.create(fuse.ROOT_INODE, name.encode(), 0o644, os.O_WRONLY, CTX)
        if data:
            await self.ops.write(info.fh, 0, data)
        await self.ops.flush(info.fh)
        await self.ops.release(info.fh)
        return attrs.st_ino

    async def read_all(self, ino: int) -> bytes:
        info = await self.ops.open(ino, os.O_RDONLY, CTX)
        try:
            out = bytearray()
            while chunk := await self.ops.read(info.fh, len(out), MiB):
                out += chunk
            return bytes(out)
        finally:
            await self.ops.release(info.fh)

    def close(self) -> None:
        self.files.close()
        self.repo.close()


def run(root: Path, test: Callable[[Harness], Awaitable[None]]) -> None:
    h = Harness(root)
    try:
        trio.run(test, h)
    finally:
        h.close()


def pins(h: Harness) -> int:
    return len(h.repo.store.pins.keys() | h.repo.store.index_pins.keys())


# -- bug 2: concurrent opens, truncate by path --------------------------------------------------


def test_concurrent_opens_share_one_content(tmp_path: Path):
    async def test(h: Harness) -> None:
        ino = await h.create("a", rand_bytes(300_000, 1))
        fhs: list[int] = []

        async def open_one() -> None:
            fhs.append((await h.ops.open(ino, os.O_RDONLY, CTX)).fh)

        async with trio.open_nursery() as n:  # both await the load before either finishes it
            n.start_soon(open_one)
            n.start_soon(open_one)
        node = h.ops.nodes[ino]
        assert node.opens == 2 and pins(h) == 1, "a second content was loaded and pinned"
        for fh in fhs:
            await h.ops.release(fh)
        assert node.content is None and pins(h) == 0, "a content stayed pinned after the last release"
        assert h.ops.open_files == 0

    run(tmp_path, test)


def test_truncate_by_path_beside_an_open(tmp_path: Path):
    data = rand_bytes(300_000, 2)

    async def test(h: Harness) -> None:
        ino = await h.create("a", data)
        fields = SimpleNamespace(
            update_size=True, update_mode=False, update_uid=False, update_gid=False,
            update_atime=False, update_mtime=False, update_ctime=False,
        )  # fmt: skip
        attr = fuse.EntryAttributes()
        attr.st_size = 1000
        fh: list[int] = []

        async def open_one() -> None:
            fh.append((await h.ops.open(ino, os.O_RDONLY, CTX)).fh)

        async with trio.open_nursery() as n:
            n.start_soon(h.ops.setattr, ino, attr, fields, None, CTX)
            n.start_soon(open_one)
        node = h.ops.nodes[ino]
        assert node.content is not None
        assert await h.ops.read(fh[0], 0, 2000) == data[:1000], "the truncate closed the content the open uses"
        await h.ops.release(fh[0])
        assert pins(h) == 0
        assert await h.read_all(ino) == data[:1000]

    run(tmp_path, test)


# -- bug 3: a failed O_TRUNC open ---------------------------------------------------------------


def test_failed_o_trunc_open_leaves_nothing_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    data = rand_bytes(300_000, 3)

    def failing_truncate(self: FileContent, length: int) -> object:
        raise OSError(errno.ENOSPC, "no space (test)")

    async def test(h: Harness) -> None:
        ino = await h.create("a", data)
        monkeypatch.setattr(FileContent, "truncate", failing_truncate)
        with pytest.raises(fuse.FUSEError) as e:
            await h.ops.open(ino, os.O_WRONLY | os.O_TRUNC, CTX)
        assert e.value.errno == errno.ENOSPC
        monkeypatch.undo()
        node = h.ops.nodes.get(ino)
        assert node is None or (node.opens == 0 and node.content is None), "the kernel never releases it"
        assert not h.ops.handles and pins(h) == 0
        assert await h.read_all(ino) == data  # the old snapshot is intact

    run(tmp_path, test)


# -- bug 4: a bug in the chunker ------------------------------------------------------------------


def test_a_chunker_bug_fails_the_save_with_eio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    repo = Repository(tmp_path)
    files = Files(repo)
    content = files.content(repo.empty_index())

    def broken_cut(*args: object, **kwargs: object) -> list[memoryview]:
        raise ValueError("a bug in the chunker (test)")

    monkeypatch.setattr(repo.chunker, "cut", broken_cut)
    write_content(content, 0, rand_bytes(BATCH + 10, 4))
    outcome: list[BaseException | None] = []

    def commit() -> None:
        try:
            prepare_commit(content)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=commit, daemon=True)
    t.start()
    t.join(timeout=30)
    try:
        assert not t.is_alive(), "the save hangs"
        assert isinstance(outcome[0], OSError) and outcome[0].errno == errno.EIO
    finally:
        content.close()
        files.close()
        repo.close()


# -- bug 7: counters updated from many threads --------------------------------------------------


def test_counters_lose_no_updates():
    counters = StoreCounters()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: lost updates become likely
    try:
        threads = [
            threading.Thread(target=lambda: [counters.add(pack_reads=1, pack_bytes_read=3) for _ in range(20_000)])
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert counters.pack_reads == 160_000 and counters.pack_bytes_read == 480_000


# -- bug 1: the FUSE thread never waits on a lock a worker holds across I/O ---------------------


class LockHolder:
    """Holds the locks a GC sweep (or a chunker's batch) holds, until released or 20 s pass."""

    def __init__(self, repo: Repository) -> None:
        self.locks = [repo.store.lock, *([repo.ns_lock] if hasattr(repo, "ns_lock") else [])]
        self.held = threading.Event()
        self.release = threading.Event()
        self.timed_out = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for lock in self.locks:
            lock.acquire()
        self.held.set()
        self.timed_out = not self.release.wait(20)
        for lock in reversed(self.locks):
            lock.release()

    def __enter__(self) -> LockHolder:
        self.thread.start()
        self.held.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.thread.join()


def test_requests_are_answered_while_a_sweep_holds_the_store_lock(tmp_path: Path):
    data = rand_bytes(2 * MiB, 5)

    async def test(h: Harness) -> None:
        ino = await h.create("a", data)
        await h.create("b", b"x")
        info = await h.ops.open(ino, os.O_RDONLY, CTX)
        assert await h.ops.read(info.fh, 0, MiB) == data[:MiB]  # chunks now cached
        beats = 0

        async def heartbeat() -> None:
            nonlocal beats
            while True:
                beats += 1
                await trio.sleep(0.01)

        with LockHolder(h.repo) as holder:
            async with trio.open_nursery() as n:
                n.start_soon(heartbeat)
                # A cached read, a rename, an unlink and the last release of another file's handle.
                assert await h.ops.read(info.fh, 0, MiB) == data[:MiB]
                await h.ops.rename(fuse.ROOT_INODE, b"b", fuse.ROOT_INODE, b"c", 0, CTX)
                await h.ops.unlink(fuse.ROOT_INODE, b"c", CTX)
                before = beats
                release_done = trio.Event()

                async def release() -> None:
                    await h.ops.release(info.fh)  # unpins: waits for store.lock, in a thread
                    release_done.set()

                n.start_soon(release)
                await trio.sleep(0.3)
                assert beats > before, "the FUSE thread is blocked"
                assert not holder.timed_out, "requests waited for the held lock"
                holder.release.set()
                await release_done.wait()
                n.cancel_scope.cancel()
        assert not holder.timed_out
        assert pins(h) == 0

    run(tmp_path, test)


def test_a_slow_read_in_staging_mode_does_not_block_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Staged files: a read's pread on a worker thread runs outside the content lock."""
    repo = Repository(tmp_path)
    files = Files(repo)
    content = files.content(repo.empty_index())
    content.to_staging()
    content.write(0, b"a" * 1000)
    entered, leave = threading.Event(), threading.Event()
    real_pread = os.pread

    def slow_pread(fd: int, n: int, off: int) -> bytes:
        entered.set()
        leave.wait(20)
        return real_pread(fd, n, off)

    monkeypatch.setattr(os, "pread", slow_pread)
    reader = threading.Thread(target=content.read, args=(0, 1000, files.read_chunks), daemon=True)
    reader.start()
    try:
        assert entered.wait(20)
        writer = threading.Thread(target=content.write, args=(1000, b"b" * 10), daemon=True)
        writer.start()
        writer.join(20)  # the reader stays inside pread until ``leave`` is set below
        assert not writer.is_alive(), "the write waited for the reader's pread"
    finally:
        leave.set()
        reader.join()
        monkeypatch.undo()
        content.close()
        files.close()
        repo.close()


# -- the remembered loads (file/files.py, Files._checked_index) ------------------------------------


def test_reopen_sees_a_replaced_stub_and_appends_do_not_leak_into_the_remembered_index(tmp_path: Path):
    """A reopen skips decoding and the map lookup only while the stub's bytes are unchanged; the
    remembered index is a copy, so an append through one open never shows in the next."""
    a, b, tail = rand_bytes(300_000, 11), rand_bytes(300_000, 12), rand_bytes(5_000, 13)

    async def test(h: Harness) -> None:
        ino = await h.create("a", a)
        assert await h.read_all(ino) == a
        assert await h.read_all(ino) == a  # served from the remembered load
        first = await trio.to_thread.run_sync(h.files.load, "a")
        ids = list(first.index.ids)
        first.index.ids[0] = b"x" * 32  # an open file's index is its own to change (workers append to it)
        first.close()
        again = await trio.to_thread.run_sync(h.files.load, "a")
        assert again.index.ids == ids, "a change to one open's index leaked into the remembered load"
        again.close()
        info = await h.ops.open(ino, os.O_WRONLY | os.O_APPEND, CTX)
        await h.ops.write(info.fh, len(a), tail)
        await h.ops.flush(info.fh)
        await h.ops.release(info.fh)
        assert await h.read_all(ino) == a + tail
        ino_b = await h.create("b", b)
        await h.ops.rename(fuse.ROOT_INODE, b"b", fuse.ROOT_INODE, b"a", 0, CTX)
        assert await h.read_all(ino_b) == b
        os.replace(h.repo.path("a"), h.repo.path("c"))  # the stub is gone behind the mount's back
        with pytest.raises(fuse.FUSEError):
            await h.read_all(ino_b)

    run(tmp_path, test)


def test_an_o_trunc_open_does_not_read_the_old_snapshot(tmp_path: Path):
    """A next-turn save (an open with O_TRUNC) replaces the snapshot whole: the old stub's chunks are
    neither loaded nor pinned meanwhile. The old snapshot stays readable until the commit, and its
    labels survive it (the commit copies the stub's metadata)."""
    old, new = rand_bytes(300_000, 7), rand_bytes(200_000, 8)

    async def test(h: Harness) -> None:
        ino = await h.create("a", old)
        stub = h.repo.path("a")
        os.setxattr(stub, "user.kvcfs.label.k", b"v")
        old_ids = set(stubs.read_index(stub).ids)
        info = await h.ops.open(ino, os.O_WRONLY | os.O_TRUNC, CTX)
        assert not h.repo.store.pinned() & old_ids, "the old snapshot was loaded and pinned"
        assert set(stubs.read_index(stub).ids) == old_ids  # the old stub is untouched until the commit
        await h.ops.write(info.fh, 0, new)
        await h.ops.flush(info.fh)
        await h.ops.release(info.fh)
        assert await h.read_all(ino) == new
        assert os.getxattr(stub, "user.kvcfs.label.k") == b"v"

    run(tmp_path, test)


# -- a rename that waits in the file system -----------------------------------------------------


def test_a_slow_rename_stalls_only_its_own_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A rename waiting in the file system (its journal behind another's fsyncs) runs in a thread:
    reads and stats of other files are answered meanwhile; a stat, an open and the save of the
    renamed file itself wait for it and then see the new name, never the old path half-gone."""
    data, other = rand_bytes(300_000, 21), rand_bytes(300_000, 22)
    gate = threading.Event()
    entered = threading.Event()

    async def test(h: Harness) -> None:
        ino = await h.create("a.tmp", data)
        ino_b = await h.create("b", other)
        info_b = await h.ops.open(ino_b, os.O_RDONLY, CTX)
        assert bytes(await h.ops.read(info_b.fh, 0, MiB)) == other
        real = h.repo.rename

        def slow_rename(old: str, new: str) -> None:
            entered.set()
            assert gate.wait(30), "the test never let the rename go on"
            real(old, new)

        monkeypatch.setattr(h.repo, "rename", slow_rename)
        seen: dict[str, object] = {}
        async with trio.open_nursery() as n:
            n.start_soon(h.ops.rename, fuse.ROOT_INODE, b"a.tmp", fuse.ROOT_INODE, b"a", 0, CTX)
            await trio.to_thread.run_sync(entered.wait)

            async def stat_renamed() -> None:
                seen["size"] = (await h.ops.getattr(ino)).st_size

            async def open_renamed() -> None:
                fh = (await h.ops.open(ino, os.O_RDONLY, CTX)).fh
                seen["bytes"] = bytes(await h.ops.read(fh, 0, MiB))
                await h.ops.release(fh)

            n.start_soon(stat_renamed)
            n.start_soon(open_renamed)
            # Meanwhile the loop answers the other file (with the old code the rename blocked it).
            with trio.fail_after(10):
                assert bytes(await h.ops.read(info_b.fh, 0, MiB)) == other
                assert (await h.ops.getattr(ino_b)).st_size == len(other)
            await trio.sleep(0.05)
            assert not seen, "a call on the file being renamed did not wait for the rename"
            gate.set()
        assert seen == {"size": len(data), "bytes": data}
        assert h.ops.nodes[ino].path == "a" and h.repo.exists("a") and not h.repo.exists("a.tmp")
        await h.ops.release(info_b.fh)

    run(tmp_path, test)


def test_a_rename_onto_itself_returns(tmp_path: Path):
    """A name renamed onto itself is a no-op (POSIX), not the node detached from its own name, nor
    a gate changed twice over (the second change would wait for the first forever)."""

    async def test(h: Harness) -> None:
        ino = await h.create("a", b"x" * 1000)
        with trio.fail_after(10):
            await h.ops.rename(fuse.ROOT_INODE, b"a", fuse.ROOT_INODE, b"a", 0, CTX)
        assert h.repo.exists("a") and (await h.ops.getattr(ino)).st_size == 1000

    run(tmp_path, test)


def test_a_path_gate_orders_changes_and_uses():
    """``PathGate``: a change waits for the users in flight, users arriving meanwhile wait behind
    it, and a change cancelled while it waits lets them go on."""
    from kvchunkfs.fuse.gate import PathGate

    async def hold_use(g: PathGate, log: list[str], name: str, inside: trio.Event, leave: trio.Event) -> None:
        async with g.use():
            log.append(f"{name} in")
            inside.set()
            await leave.wait()
            log.append(f"{name} out")

    async def line_up(
        n: trio.Nursery,
        g: PathGate,
        log: list[str],
        inside: trio.Event,
        leave: trio.Event,
        changer: Callable[[], Awaitable[None]],
        late: Callable[[], Awaitable[None]],
    ) -> None:
        """A user holding the path, then a change, then a later user (each a task of ``n``)."""
        n.start_soon(hold_use, g, log, "u1", inside, leave)
        await inside.wait()
        n.start_soon(changer)
        await trio.sleep(0.01)
        n.start_soon(late)
        await trio.sleep(0.01)

    async def ordered() -> None:
        g, log = PathGate(), []
        inside, leave = trio.Event(), trio.Event()

        async def change() -> None:
            async with g.change():
                log.append("change")
                await trio.sleep(0.01)

        async def user() -> None:
            async with g.use():
                log.append("u2")

        async with trio.open_nursery() as n:
            await line_up(n, g, log, inside, leave, change, user)
            assert log == ["u1 in"], log  # the change waits for u1; u2 waits behind the change
            leave.set()
        assert log == ["u1 in", "u1 out", "change", "u2"], log

    async def cancelled() -> None:
        g, log = PathGate(), []
        inside, leave, passed = trio.Event(), trio.Event(), trio.Event()
        scope = trio.CancelScope()

        async def doomed_change() -> None:
            with scope:
                async with g.change():
                    raise AssertionError("a change ran while a user held the path")

        async def late_user() -> None:
            await g.settled()
            passed.set()

        async with trio.open_nursery() as n:
            await line_up(n, g, log, inside, leave, doomed_change, late_user)
            assert not passed.is_set()  # behind the waiting change
            scope.cancel()
            with trio.fail_after(5):
                await passed.wait()  # the cancelled change holds it back no longer
            leave.set()
        assert not g.moving and g.waiting == 0 and g.users == 0

    trio.run(ordered)
    trio.run(cancelled)
