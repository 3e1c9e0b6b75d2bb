"""Opens' turns: passthrough's one file per inode (fuse/backing.py) and the retries of stale opens
(fuse/retries.py), driven on a trio loop whose clock jumps ahead whenever every task waits (no
wall-clock time)."""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from kvchunkfs.fuse.api import FUSEError
from kvchunkfs.fuse.backing import BUSY_WAIT, Backings

INODE = 5


@pytest.fixture
def fds(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """Descriptors of two files: an old version and a writer's own copy."""
    out = []
    for name in ("old", "new"):
        (tmp_path / name).write_bytes(name.encode())
        out.append(os.open(tmp_path / name, os.O_RDONLY))
    yield out[0], out[1]
    for fd in out:
        os.close(fd)


def run(main: Callable[[], Awaitable[None]]) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


class Kernel:
    """Hands out backing ids, as FUSE_DEV_IOC_BACKING_OPEN does; ``refuse``: as for a file it cannot pass through."""

    def __init__(self, refuse: bool = False) -> None:
        self.ids = iter(range(7, 100))
        self.refuse = refuse
        self.registered: list[int] = []

    def register(self, fd: int) -> int:
        self.registered.append(fd)
        return 0 if self.refuse else next(self.ids)


def test_a_writer_waits_only_for_earlier_opens_and_later_readers_share_its_file(fds: tuple[int, int]) -> None:
    old, new = fds
    b, kernel, events = Backings(), Kernel(), []

    async def main() -> None:
        first = await b.arrive(INODE, False, lambda: False)
        assert await b.attach(first, 1, old, kernel.register) == (7, True)
        b.turn_over(first)
        own = [False]  # the writer's open makes the content a file of its own

        async def writer() -> None:
            w = await b.arrive(INODE, True, lambda: own[0])
            events.append("writer's turn")
            own[0] = True
            events.append(await b.attach(w, 2, new, kernel.register))
            b.turn_over(w)

        async def later_reader(fh: int) -> None:
            r = await b.arrive(INODE, False, lambda: own[0])
            events.append(f"reader {fh}")
            events.append(await b.attach(r, fh, new, kernel.register))
            b.turn_over(r)

        async with trio.open_nursery() as n:
            n.start_soon(writer)
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(later_reader, 3)  # came after the writer: queues behind it
            n.start_soon(later_reader, 4)
            await trio.sleep(BUSY_WAIT / 2)
            assert events == [], "the writer waits for the open before it, the readers for the writer"
            assert b.opens(INODE) == 4
            assert b.released(INODE, 1) == 7  # the first open's release: its backing id is closed
        assert events[:2] == ["writer's turn", (8, True)]
        assert sorted(map(str, events[2:])) == ["(8, False)", "(8, False)", "reader 3", "reader 4"]
        assert kernel.registered == [old, new]

    run(main)


def test_a_writer_gets_ebusy_after_the_bound_and_readers_never_do(fds: tuple[int, int]) -> None:
    old, _ = fds
    b, kernel, got = Backings(), Kernel(), []

    async def main() -> None:
        held = await b.arrive(INODE, False, lambda: False)
        await b.attach(held, 1, old, kernel.register)
        b.turn_over(held)

        async def writer() -> None:
            start = trio.current_time()
            with pytest.raises(FUSEError) as e:
                await b.arrive(INODE, True, lambda: False)
            assert e.value.errno == errno.EBUSY
            got.append(("writer", trio.current_time() - start))

        async def reader() -> None:
            r = await b.arrive(INODE, False, lambda: False)
            got.append(("reader", await b.attach(r, 2, old, kernel.register)))
            b.turn_over(r)

        async with trio.open_nursery() as n:
            n.start_soon(writer)
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(reader)
        assert got == [("writer", BUSY_WAIT), ("reader", (7, False))]
        assert b.opens(INODE) == 2  # the held open and the reader's; the writer's is over

    run(main)


def test_a_writer_of_the_file_the_others_use_does_not_wait(fds: tuple[int, int]) -> None:
    _, new = fds
    b, kernel = Backings(), Kernel()

    async def main() -> None:
        first = await b.arrive(INODE, True, lambda: True)  # another writer's own file: joined
        await b.attach(first, 1, new, kernel.register)
        b.turn_over(first)
        with trio.fail_after(0.001):
            second = await b.arrive(INODE, True, lambda: True)
        assert await b.attach(second, 2, new, kernel.register) == (7, False)

    run(main)


def test_an_open_of_another_file_waits_for_the_answered_opens_then_registers_its_own(fds: tuple[int, int]) -> None:
    """The compare after the wait: once the opens of the other file are gone, the file registered
    is the one this open needs, not whatever was there."""
    old, new = fds
    b, kernel, got = Backings(), Kernel(), []

    async def main() -> None:
        a = await b.arrive(INODE, False, lambda: False)
        await b.attach(a, 1, old, kernel.register)
        b.turn_over(a)

        async def other() -> None:
            r = await b.arrive(INODE, False, lambda: False)
            got.append(await b.attach(r, 2, new, kernel.register))
            b.turn_over(r)

        async with trio.open_nursery() as n:
            n.start_soon(other)
            await trio.sleep(10 * BUSY_WAIT)  # no bound: a reader never fails for this
            assert got == []
            b.released(INODE, 1)
        assert got == [(8, True)] and kernel.registered == [old, new]

    run(main)


def test_a_file_the_kernel_refuses_is_served_for_every_open_of_it(fds: tuple[int, int]) -> None:
    old, _ = fds
    b, kernel = Backings(), Kernel(refuse=True)

    async def main() -> None:
        for fh in (1, 2, 3):
            op = await b.arrive(INODE, False, lambda: False)
            assert await b.attach(op, fh, old, kernel.register) == (0, False)
            b.turn_over(op)
        assert kernel.registered == [old]  # asked once
        for fh in (1, 2, 3):
            assert b.released(INODE, fh) == 0
        assert b.opens(INODE) == 0

    run(main)


# -- fuse/retries.py: a rename over a name lets the kernel's retries of its stale opens in first --


def test_a_rename_over_a_name_waits_for_the_retried_opens_of_it() -> None:
    from kvchunkfs.fuse.retries import RETRY_WAIT, StaleRetries

    r, events = StaleRetries(), []

    async def main() -> None:
        before = r.arrival()  # an open already under way: not a retry
        r.expect("s")
        r.expect("s")  # two readers got ESTALE

        async def rename() -> None:
            await r.let_in("s")
            events.append(("rename", trio.current_time()))

        async with trio.open_nursery() as n:
            n.start_soon(rename)
            await trio.sleep(0.1)
            r.opened("s", before)
            r.opened("s", r.arrival())
            await trio.sleep(0.1)
            assert events == []
            r.opened("s", r.arrival())
        assert events == [("rename", 0.2)]
        r.expect("t")
        await r.let_in("t")  # a retry that never comes: the rename waits its bound, no longer
        assert trio.current_time() == pytest.approx(0.2 + RETRY_WAIT)
        await r.let_in("t")  # and only once

    run(main)
