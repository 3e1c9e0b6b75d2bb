"""``prestart``: a thread pool's threads started before they are needed."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


def prestart(executor: ThreadPoolExecutor, n: int) -> None:
    """Start ``n`` of the executor's threads now. It starts them only as work comes, and a read
    waiting for the work would wait for the start too (a fresh thread's stack is faulted in)."""
    barrier = threading.Barrier(n + 1)  # each task holds its thread until all n run: n threads
    for _ in range(n):
        executor.submit(barrier.wait)
    barrier.wait()
