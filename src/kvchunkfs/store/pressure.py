"""Memory pressure wins: the memory tier gives its hot copies back when the machine is short.

tmpfs pages are never reclaimed without swap, so under pressure the kernel would drop the page
cache of the model's weights, or OOM-kill a process (llama-server is the largest), before a
single cached copy went. A thread (``PressureWatcher``) looks at the machine several times a
second (``INTERVAL``), and at once when the kernel reports a memory stall (a PSI trigger on
``/proc/pressure/memory``, where it may set one): while ``membudget.Memory`` says the host or
the daemon's cgroup is short, hot copies are evicted (copies no snapshot names any more first,
then least recently used) until it is not, and ``WholeFiles.short`` is set: no copy is kept,
and a save is stored as it closes instead of staged in memory (the mount's choice), so the tier
does not grow. Nothing is lost: a hot copy is a cache, and staged saves are never evicted.

An episode ends once the machine has not been short for ``CALM`` seconds. Each episode is
counted and logged once when it begins (why, and what was evicted at once) and once when it
ends (what it evicted in all, how many saves were stored inline).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time

from kvchunkfs.store.membudget import PSI, Memory, own_cgroup
from kvchunkfs.store.wholefiles import WholeFiles

log = logging.getLogger(__name__)

INTERVAL = 0.1  # seconds between looks at the machine's memory
CALM = 2.0  # seconds without shortage that end an episode
TRIGGER = b"some 100000 1000000"  # wake at once when tasks stall on memory 100 ms in a second
SLACK_SHARE = 16  # each eviction frees this share of the hot copies beyond the shortfall


class PressureWatcher:
    def __init__(self, whole: WholeFiles, memory: Memory | None = None, interval: float = INTERVAL) -> None:
        self.whole = whole
        self.memory = memory or Memory(own_cgroup())
        self.interval = interval
        self.episode_start: float | None = None
        self.last_short = 0.0
        self.episode_freed = 0
        self.episode_inline = 0
        self._stop = threading.Event()
        self._trigger_fd = _psi_trigger()
        self._thread = threading.Thread(target=self._run, name="memory-pressure", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._trigger_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._trigger_fd)

    def _run(self) -> None:
        poller = None
        if self._trigger_fd is not None:
            poller = select.poll()
            poller.register(self._trigger_fd, select.POLLPRI)
        while not self._stop.is_set():
            if poller is not None:
                with contextlib.suppress(OSError):
                    poller.poll(self.interval * 1000)
            else:
                self._stop.wait(self.interval)
            try:
                self.check()
            except Exception:  # never let the watcher die: log and look again
                log.exception("checking memory pressure failed")
                self._stop.wait(1.0)

    def check(self) -> None:
        """One look: evict while short, begin or end an episode."""
        whole = self.whole
        now = time.monotonic()
        reading = self.memory.reading()
        if not reading.need:
            if self.episode_start is not None and now - self.last_short >= CALM:
                self._end(now)
            return
        self.last_short = now
        if self.episode_start is None:
            self.episode_start = now
            self.episode_freed = 0
            self.episode_inline = whole.stats.saves_inline
            whole.short = True
            whole.stats.pressure_episodes += 1
            first = self._evict(reading.need)
            whole.stats.pressure_reaction_us = int((time.monotonic() - now) * 1e6)
            _, hot = whole.hot_usage()
            log.warning("memory is short (%s): %d MiB of hot copies evicted, %d MiB left; new saves are "
                        "stored as they close until it is not", reading.why, first >> 20, hot >> 20)  # fmt: skip
            return
        self._evict(reading.need)

    def _evict(self, need: int) -> int:
        """Evict until the machine is not short or no hot copy is left; the bytes freed."""
        whole = self.whole
        freed = 0
        for _ in range(64):
            _, hot = whole.hot_usage()
            if not hot:
                break
            n = whole.shrink(need + hot // SLACK_SHARE)
            freed += n
            if not n:
                break
            need = self.memory.reading().need
            if not need:
                break
        self.episode_freed += freed
        return freed

    def _end(self, now: float) -> None:
        whole = self.whole
        start = self.episode_start or now
        self.episode_start = None
        whole.short = False
        _, hot = whole.hot_usage()
        log.info("memory is no longer short: over %.1f s, %d MiB of hot copies evicted, %d saves stored as they "
                 "closed; the tier holds %d MiB of hot copies", now - start, self.episode_freed >> 20,
                 whole.stats.saves_inline - self.episode_inline, hot >> 20)  # fmt: skip


def _psi_trigger() -> int | None:
    """An fd that polls POLLPRI when tasks stall on memory (None where PSI triggers are not allowed)."""
    try:
        fd = os.open(PSI, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        os.write(fd, TRIGGER + b"\0")
    except OSError:
        os.close(fd)
        return None
    return fd
