"""Ingestion: a staged save becomes chunks and a new stub, behind the client's close.

A save's last close names its staged file on the stub (``Repository.set_staged``: from then on
that file is the snapshot) and queues it here. A worker thread, at low CPU priority, reads and
stores the file (file/chunking.py: format-aware, only the chunks the store lacks written), writes
the new stub under ``tmp/`` and asks the save service to install it (``Saves``): on the thread that
orders namespace changes, and only if the stub still names this staged file (a later save, an
unlink or a rename over it wins), once the file still hashes to the checksum just stored (else it
was written after its close, and is stored again). The installed file then joins the hot tier
(file/adopt.py), so a later restore of it is a plain read.

The backlog is bounded in bytes (``ingest_backlog``, by default half the memory tier) and in time:
with ``durability = close`` a power cut loses the acknowledged saves not yet stored (their staged
files are memory), so a close waits while the oldest save not yet stored, plus the time the
queue needs at the rate ingestion has been going, is more than ``WINDOW`` seconds behind
(``backlogged``: the mount's close looks again until it is not): whatever the save rate, a cut
loses about the last ``WINDOW`` seconds of saves plus the checkpoint interval of those stored.

If the daemon dies meanwhile, the staged file and the stub's name of it remain: the next mount
queues it again (``pending``). A failure leaves both too: the store cannot take the save now (no
space, an I/O error, a read-only disk), so it is logged and tried again after a growing pause
(``RETRY_FIRST`` doubling up to ``RETRY_MAX``); meanwhile the store is *degraded*
(``degraded``): new saves are refused at their open (file/room.py), and what is staged stays only
in memory, which a stop says (``unstored``).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvchunkfs.file.adopt import same_sum, to_hot_tier
from kvchunkfs.file.files import Files, PendingSave
from kvchunkfs.store.packs import ChunkCorrupt, ChunkMissing

ChunkError = (ChunkCorrupt, ChunkMissing)

log = logging.getLogger(__name__)

NICE = 10  # the workers' CPU priority: below the client whose next request waits on the daemon
WINDOW = 5.0  # seconds: how far behind its saves ingestion may fall before closes wait
RATE_WEIGHT = 0.3  # the weight of the latest job in the ingestion rate's moving average
HOLD_ENV = "KVCFS_INGEST_HOLD"  # tests: while the file it names exists, no job starts (a crash before ingestion)
RETRY_FIRST = 1.0  # seconds before a failed save is tried again; doubled at each failure
RETRY_MAX = 30.0
REPORTED = 100  # unstored saves named one by one at a stop


class Outcome(enum.Enum):
    INSTALLED = "installed"
    SUPERSEDED = "superseded"  # the stub names another save, or is gone: this one is dropped
    LATER = "later"  # the mount is stopping: left for the next one


@dataclass(eq=False)
class Job:
    path: Path  # the staged file
    size: int
    where: Callable[[], str | None]  # the file's path now, for the metadata its new stub carries
    closed_ms: float = 0.0  # how long the close took
    adopt: bool = True  # may become a hot copy (False: a client may still write the file)
    queued: float = field(default_factory=time.monotonic)
    due: float = 0.0  # monotonic time before which a failed job is not tried again
    failures: int = 0
    claim: Claim | None = None  # the room it holds on the store's disk (file/room.py): released once stored

    @property
    def name(self) -> str:
        return self.path.name


class Claim(Protocol):
    """Room a save holds on the store's disk until its chunks are written (file/room.py)."""

    size: int

    def release(self) -> None: ...


class Saves(Protocol):
    """What ingestion tells the mount's save service (file/saves.py ``SaveService``), from its workers."""

    def install(self, job: Job, pending: PendingSave) -> Outcome:
        """Install the job's new stub if its name still names this staged save."""
        ...

    def done(self, job: Job, outcome: Outcome, new_bytes: int, seconds: float) -> None:
        """The job is over (``seconds``: from queued to stored)."""
        ...


class Ingester:
    def __init__(self, files: Files, saves: Saves, backlog: int, workers: int = 1) -> None:
        self.files = files
        self.install = saves.install
        self.done = saves.done
        whole = files.repo.whole
        default = whole.tier_size // 2 if whole is not None else 4 << 30
        self.limit = backlog or default  # staged bytes queued beyond which a close waits
        self.window = WINDOW  # seconds of saves not yet stored beyond which a close waits
        self.rate = 0.0  # bytes a second ingestion stores (a moving average; 0: not known yet)
        self.queue: deque[Job] = deque()
        self._inflight: dict[int, float] = {}  # id(job) -> when it was queued, queued or running
        self.cond = threading.Condition()
        self.pending_bytes = 0
        self.running = 0
        self.waits = 0  # closes that waited for the backlog
        self.ingested = 0
        self.failures = 0
        self.changed = 0  # saves stored again: written after their close while being stored
        # Whether hot copies are fresh copies (file/adopt.py): the mount says False when no client
        # writes a staged file directly (served mode).
        self.fresh_hot_copies: Callable[[], bool] = lambda: True
        self.failing: dict[Job, OSError] = {}  # saves the store could not take, waiting for a retry
        self.active: set[Job] = set()  # being stored
        self._stop = False
        self._threads = [
            threading.Thread(target=self._run, name=f"ingest-{i}", daemon=True) for i in range(max(1, workers))
        ]
        for t in self._threads:
            t.start()

    # -- the mount's side -------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self.cond:
            self.queue.append(job)
            self._inflight[id(job)] = job.queued
            self.pending_bytes += job.size
            self.cond.notify_all()

    def behind(self) -> float:
        """Seconds the oldest save not yet stored will have waited once the queue is stored, at
        the rate ingestion has been going (0 with nothing queued). Under ``cond``."""
        if not self._inflight:
            return 0.0
        oldest = min(self._inflight.values())
        drain = self.pending_bytes / self.rate if self.rate > 0 else 0.0
        return time.monotonic() - oldest + drain

    def lag(self) -> float:
        """``behind``, for stats: how far behind its saves ingestion is, in seconds."""
        with self.cond:
            return self.behind()

    def _over(self) -> bool:
        if self.failing:  # the store cannot take saves now: a close is refused (file/room.py), not held
            return False
        return self.pending_bytes > self.limit or self.behind() > self.window

    def backlogged(self) -> bool:
        with self.cond:
            return self._over()

    def backlog(self) -> tuple[int, int]:
        """(saves queued or being stored, their bytes)."""
        with self.cond:
            return len(self.queue) + self.running, self.pending_bytes

    def drain(self, timeout: float) -> bool:
        """Wait until nothing is queued or running; False on timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.queue and not self.running, timeout)

    def close(self) -> None:
        """Stop: a job under way finishes or is left for the next mount."""
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        for t in self._threads:
            t.join(timeout=30)

    # -- the workers ------------------------------------------------------------------------

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        while True:
            with self.cond:
                job = None
                while not self._stop and (job := self._next_due()) is None:
                    due = min((j.due for j in self.queue), default=None)
                    self.cond.wait(None if due is None else max(0.0, due - time.monotonic()))
                if job is None:  # stopping
                    return
                self.queue.remove(job)
                self.running += 1
                self.active.add(job)
            hold = os.environ.get(HOLD_ENV)
            while hold and os.path.exists(hold) and not self._stop:
                time.sleep(0.02)
            started = time.monotonic()
            failed = False
            try:
                self._ingest(job)
            except Exception as e:  # the staged file stays the snapshot: tried again after a pause
                failed = True
                self._failed(job, e)
            finally:
                with self.cond:
                    self.running -= 1
                    self.active.discard(job)
                    if failed:
                        self.queue.append(job)  # still unstored: counted in pending_bytes, its age kept
                    else:
                        self.failing.pop(job, None)
                        self.pending_bytes -= job.size
                        if job not in self.queue:  # not queued again (written after its close)
                            self._inflight.pop(id(job), None)
                            if job.claim is not None:  # its chunks written: the disk's free space shows them
                                job.claim.release()
                        self._note_rate(job.size, time.monotonic() - started)
                    self.cond.notify_all()

    def _note_rate(self, size: int, seconds: float) -> None:
        """The rate of the job just stored joins the moving average (under ``cond``): with
        several workers, each one's rate times their number."""
        if size < 1 << 20 or seconds <= 0:
            return
        rate = size / seconds * len(self._threads)
        self.rate = rate if self.rate <= 0 else self.rate + RATE_WEIGHT * (rate - self.rate)

    def _next_due(self) -> Job | None:
        """The first queued job whose retry time has come (under ``cond``)."""
        now = time.monotonic()
        return next((j for j in self.queue if j.due <= now), None)

    def _failed(self, job: Job, e: Exception) -> None:
        """Log a failure (the store's trouble: one line; anything else: a bug, its traceback once)
        and schedule the job again."""
        self.failures += 1
        job.failures += 1
        pause = min(RETRY_MAX, RETRY_FIRST * 2 ** (job.failures - 1))
        job.due = time.monotonic() + pause
        store_trouble = isinstance(e, (OSError, ChunkError))
        error = e if isinstance(e, OSError) else OSError(errno.EIO, f"{type(e).__name__}: {e}")
        with self.cond:
            self.failing[job] = error
        level = logging.ERROR if job.failures == 1 else logging.WARNING
        log.log(level, "storing the save of %s failed (attempt %d); its staged copy stays the snapshot, only in "
                "memory, and is tried again in %.0f s: %s: %s", job.where() or job.name, job.failures, pause,
                type(e).__name__, e, exc_info=not store_trouble and job.failures == 1)  # fmt: skip

    def degraded(self) -> OSError | None:
        """The store's latest trouble taking a staged save, while one still waits for a retry."""
        with self.cond:
            return next(reversed(self.failing.values()), None) if self.failing else None

    def unstored(self) -> list[Job]:
        """The saves not stored yet (queued, failing or being stored)."""
        with self.cond:
            return [*self.active, *self.queue]

    def report_unstored(self, where: Path) -> None:
        """Say loudly what is not stored: it stays only in ``where`` (memory), and a reboot or a
        power cut before the next mount stores it loses it."""
        jobs = self.unstored()
        if not jobs:
            return
        total = sum(j.size for j in jobs)
        trouble = self.degraded()
        log.error("%d saves (%.1f MiB) are not stored%s: they stay only in %s until the next mount stores them; "
                  "a reboot or a power cut before then loses them", len(jobs), total / (1 << 20),
                  f" ({trouble.strerror})" if trouble is not None else "", where)  # fmt: skip
        for job in jobs[:REPORTED]:
            log.warning("not stored, only in memory (a reboot loses it): %s (%.1f MiB)", job.where() or job.name,
                        job.size / (1 << 20))  # fmt: skip
        if len(jobs) > REPORTED:
            log.warning("... and %d more saves not stored", len(jobs) - REPORTED)

    def _ingest(self, job: Job) -> None:
        files = self.files
        whole = files.repo.whole
        assert whole is not None
        try:
            fd = os.open(job.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            log.error("the staged save %s is gone: %s keeps its previous version", job.name, job.where())
            self.done(job, Outcome.SUPERSEDED, 0, 0.0)
            return
        sparse = _has_hole(fd)  # a hole (written past its end): no fresh hot copy of it (its zeros)
        content = files.content(files.repo.empty_index())
        try:
            rel = job.where()
            if rel is None:
                whole.drop_staged(job.path)
                self.done(job, Outcome.SUPERSEDED, 0, 0.0)
                return
            if os.fstat(fd).st_size:  # an empty file stays the empty index (no record: as it always was)
                content.use_whole(os.dup(fd), None)
            pending = files.prepare_save(content, rel, durable=False)
            record = pending.record
            if record is not None and not same_sum(fd, record.file_sum):
                # Written since it was read (a mapping kept after the close: passed through, nothing
                # tells the daemon): what was read is no version the file had. Stored again as it is.
                if pending.tmp is not None:
                    pending.tmp.unlink(missing_ok=True)
                log.info("the save of %s changed after its close: stored again", rel)
                self.changed += 1
                job.queued = time.monotonic()  # its age starts again: another save's closes do not wait on it
                self.submit(job)  # counted once: the worker uncounts this run
                return
            outcome = self.install(job, pending)
            seconds = time.monotonic() - job.queued
            if outcome is Outcome.INSTALLED:
                self.ingested += 1
                try:
                    self._to_hot_tier(job, fd, pending, sparse)
                except OSError as e:  # the save is stored: only its hot copy is missing
                    log.warning("no hot copy of %s: %s", rel, e)
                    with contextlib.suppress(OSError):
                        whole.drop_staged(job.path)
            elif outcome is Outcome.SUPERSEDED:
                whole.drop_staged(job.path)
            self.done(job, outcome, pending.new_bytes, seconds)
        finally:
            content.close()
            os.close(fd)

    def _to_hot_tier(self, job: Job, fd: int, pending: PendingSave, sparse: bool) -> None:
        """The installed save's staged file becomes a hot copy (file/adopt.py): renamed if no client
        can write it, else a fresh copy of it (its holes would be copied as zeros: none then)."""
        whole = self.files.repo.whole
        assert whole is not None
        record = pending.record
        fresh = not job.adopt or self.fresh_hot_copies()
        if record is None or (fresh and sparse):
            whole.drop_staged(job.path)
            return
        to_hot_tier(whole, job.path, fd, record.file_sum, job.size, fresh, rel=job.where())


def _has_hole(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.lseek(fd, 0, os.SEEK_HOLE) < size
