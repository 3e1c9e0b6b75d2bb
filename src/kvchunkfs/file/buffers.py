"""Big byte buffers for put-backs and saves, faulted in once and handed out again.

A put-back reads its pieces into a ring of buffers, a save joins its batches and re-lays out its
groups into one; in a daemon just started, every page of a fresh buffer is a page fault, and on a
virtual machine whose freed memory goes back to the host (free page reporting, ballooning) each
such fault is far dearer than the copy itself. The pool keeps the buffers it handed out and gives
one out again once nothing refers to it any more.

A buffer is reused only when the pool holds the last reference to it: every view, slice or
memoryview of it refers to it, so bytes still in use are never overwritten.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

_MIN = 1 << 20  # smaller buffers are cheap to fault: not pooled


class BufferPool:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # bytes of idle and busy buffers the pool keeps
        self._bufs: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again (a metric for tests and profiles)

    @property
    def size(self) -> int:
        return sum(len(b) for b in self._bufs)

    def sizes(self) -> list[int]:
        """The sizes of the buffers kept: what the restores of this store needed (remembered
        across restarts, so the next mount reserves them)."""
        with self._lock:
            return sorted((len(b) for b in self._bufs), reverse=True)

    def reserve(self, sizes: list[int] | None = None) -> None:
        """Fault in buffers now (a daemon at mount, before the first restore waits for them): of
        ``sizes`` (those a previous mount kept), else half the capacity, a quarter, and so on down
        to ``_MIN``, twice the smallest."""
        if sizes is None:
            sizes, n = [], self.capacity // 2
            while n >= _MIN:
                sizes.append(n)
                n //= 2
            if sizes:
                sizes.append(sizes[-1])
        for n in sorted(sizes, reverse=True):
            if n < _MIN:
                continue
            if self.size + n <= self.capacity:
                buf = np.empty(n, np.uint8)
                buf[::4096] = 0  # one write per page faults it in
                with self._lock:
                    self._bufs.append(buf)

    def take(self, n: int, brief: bool = False) -> np.ndarray:
        """An uninitialised ``n``-byte array: the smallest pooled buffer nothing else refers to of
        ``n`` to ``2 * n`` bytes (``brief``: of at least ``n``), else a new one, kept if the pool
        has room once idle ones are dropped (the pool follows the sizes put-backs and saves really
        need).

        ``brief``: the buffer is given back within moments (a save's batch joined, a group re-laid
        out for storing), so a bigger idle one does: fresh memory costs more than the copy into it."""
        if n < _MIN or n > self.capacity:
            return np.empty(n, np.uint8)
        top = self.capacity if brief else 2 * n
        with self._lock:
            # At most twice the size asked: a small request must not hold a big buffer that a
            # big one will need (a new buffer of the right size is kept instead).
            fits = [i for i in self._idle() if n <= len(self._bufs[i]) <= top]
            if fits:
                self.reused += 1
                return self._bufs[min(fits, key=lambda i: len(self._bufs[i]))][:n]
        fresh = np.empty(n, np.uint8)
        with self._lock:
            for i in sorted(self._idle(), key=lambda i: len(self._bufs[i])):  # smallest first
                if self.size + n <= self.capacity:
                    break
                self._bufs[i] = _GONE
            self._bufs = [b for b in self._bufs if b is not _GONE]
            if self.size + n <= self.capacity:
                self._bufs.append(fresh)
        return fresh

    def _idle(self) -> list[int]:
        """Under the lock: the buffers nothing outside the pool refers to."""
        out = []
        for i in range(len(self._bufs)):
            buf = self._bufs[i]
            # References: the list, ``buf`` and getrefcount's argument. Anything more is a view.
            if sys.getrefcount(buf) <= 3:
                out.append(i)
            del buf
        return out


_GONE = np.empty(0, np.uint8)
