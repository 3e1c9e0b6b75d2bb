"""``lower_priority`` (a background thread's nice), ``prestart`` (a pool's threads started before
they are needed) and ``InFlight`` (clients' restores under way, which the warm-up waits for)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

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
