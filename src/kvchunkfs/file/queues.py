"""The data path's threads and queues: ``ChunkPool`` (the threads that run file workers' turns),
``prestart`` (a pool's threads started before they are needed), ``ByteQueue`` (a file's bytes
waiting for the chunker) and ``InFlight`` (clients' restores under way, which the warm-up waits for)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor


class ChunkPool:
    """The threads that run file workers' turns: a bounded number, however many files are written."""

    def __init__(self, workers: int = 0) -> None:
        self.workers = workers or os.cpu_count() or 2
        # Below the client's priority: a save is stored behind its close, while the client goes on.
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="chunker", initializer=lower_priority)

    def submit(self, turn: Callable[[], None]) -> None:
        self._executor.submit(turn)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


NICE = 10


def lower_priority() -> None:
    """The calling thread at nice ``NICE`` (Linux: per thread)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


def prestart(executor: ThreadPoolExecutor, n: int) -> None:
    """Start ``n`` of the executor's threads now. It starts them only as work comes, and a read
    waiting for the work would wait for the start too (a fresh thread's stack is faulted in)."""
    barrier = threading.Barrier(n + 1)  # each task holds its thread until all n run: n threads
    for _ in range(n):
        executor.submit(barrier.wait)
    barrier.wait()


class ByteQueue:
    """Bytes queued for the chunker, kept as the pieces FUSE handed us (no copy per write)."""

    def __init__(self) -> None:
        self.pieces: list[bytes | bytearray | memoryview] = []
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def append(self, data: bytes) -> None:
        self.pieces.append(data)
        self.size += len(data)

    def prepend(self, data: bytes) -> None:
        if data:
            self.pieces.insert(0, data)
            self.size += len(data)

    def drop(self, n: int) -> None:
        """Remove the first ``n`` bytes (at most all)."""
        n = min(n, self.size)
        self.size -= n
        while n:
            first = self.pieces[0]
            if len(first) <= n:
                self.pieces.pop(0)
                n -= len(first)
            else:
                self.pieces[0] = memoryview(first)[n:]
                n = 0

    def patch(self, offset: int, data: bytes) -> None:
        """Overwrite (and maybe extend) from ``offset``; rare, so it flattens the queue."""
        flat = bytearray(b"".join(self.pieces))
        flat[offset : offset + len(data)] = data
        self.pieces, self.size = [flat], len(flat)

    def take(self, keep: int = 0) -> list[bytes | bytearray | memoryview]:
        """Remove and return all but the last ``keep`` bytes; cheap, so callers may hold a lock.

        The kept bytes may span several pieces (a short write after an unaligned one): pieces are
        split from the end until exactly ``keep`` bytes remain queued.
        """
        keep = max(0, min(keep, self.size))
        taken = self.pieces
        kept: list[bytes | bytearray | memoryview] = []
        need = keep
        while need:
            last = taken.pop()
            if len(last) <= need:
                kept.append(last)
                need -= len(last)
            else:
                view = memoryview(last)
                kept.append(bytes(view[len(last) - need :]))  # at most one page: a small copy
                taken.append(view[: len(last) - need])
                need = 0
        kept.reverse()
        self.pieces, self.size = kept, keep
        return taken

    def join(self) -> bytes:
        return b"".join(self.pieces)


RESTORE_HOLD_ENV = "KVCFS_RESTORE_HOLD"  # tests: while the file it names exists, a restore under way waits


class InFlight:
    """Clients' restores under way (their loads and put-backs): background work that would compete
    with them for the disk, the CPU and the read workers (the warm-up) waits while any is."""

    def __init__(self) -> None:
        self._n = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def client(self) -> Iterator[None]:
        with self._cond:
            self._n += 1
        try:
            hold = os.environ.get(RESTORE_HOLD_ENV)
            while hold and os.path.exists(hold):
                time.sleep(0.02)
            yield
        finally:
            with self._cond:
                self._n -= 1
                self._cond.notify_all()

    def busy(self) -> bool:
        return self._n > 0

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no restore to be under way; whether none is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._n == 0, timeout)
