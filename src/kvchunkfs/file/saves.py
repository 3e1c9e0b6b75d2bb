"""The save service: a save's life from the writer's close until its stub names stored chunks.

The mount calls it once per close (``commit``: at the writer's FLUSH, its last RELEASE, an fsync),
as s3ql's file system calls its block cache. A commit waits while ingestion is too far behind
(``Ingester.backlogged``), refuses a file past ``max_file_size`` or one a write may have failed for
room (file/room.py), and saves the file: a whole file of its own is sealed (or copied, if another
handle may still write it) and named on its stub as a staged save (``Repository.stage``: from then
on it is the snapshot), then queued for ingestion; any other save (``durability = fsync``, a
client's fsync, memory short, no memory tier) is stored before the close returns. Ingestion
(file/ingest.py) stores queued saves behind the close and comes back through ``install`` (the new
stub replaces the old one only if the name still names that staged save) and ``done``. At mount,
``resume_staged`` queues what a killed daemon left staged; at unmount, ``stop_ingestion`` stores
what it can in ``stop_timeout`` and names what is left only in memory.

It knows nothing of FUSE: the file a save is of is whatever the mount keeps per open file
(``SavedFile``), and what only the mount can do (a name's fresh identity after a failed save, a
file let go) it asks through ``Mount``. A refused save raises ``SaveRefused`` with the errno the
writer's close answers; the previous version of the snapshot stays. All of it runs on the mount's
trio thread except ``install`` and ``done``, which ingestion's workers call.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import trio

from kvchunkfs.file.adopt import same_sum
from kvchunkfs.file.content import FileContent
from kvchunkfs.file.files import Files, PendingSave
from kvchunkfs.file.ingest import Ingester, Job, Outcome
from kvchunkfs.file.room import Claim, Room, needed
from kvchunkfs.store.packs import ChunkCorrupt, ChunkMissing

log = logging.getLogger(__name__)

T = TypeVar("T")
BACKLOG_STEP = 0.05  # seconds between looks at ingestion's backlog while a close waits for it


class SaveRefused(Exception):
    """The save is not made: the writer's close answers ``errno``; the previous version stays."""

    def __init__(self, code: int) -> None:
        super().__init__(os.strerror(code))
        self.errno = code


class Gate(Protocol):
    """A file's path, held still while a save reads it (fuse/gate.py's ``PathGate``)."""

    async def settled(self) -> None: ...

    def use(self) -> contextlib.AbstractAsyncContextManager[None]: ...


class SavedFile(Protocol):
    """The mount's open file a save is of (its path now, its content, who may still write it)."""

    path: str | None  # None once unlinked
    content: FileContent | None
    writers: int  # open handles that may write
    ingesting: int  # its saves queued for ingestion (the mount keeps the file while any is)
    synced: bytes | None  # the checksum of the save a client's fsync stored, while open for writing
    # Times set on the open file: (atime, mtime, content generation, whole file's mtime) then.
    set_times: tuple[int | None, int | None, int, int] | None
    deferred: list[Job]  # saves sealed while the writer's file description could still write them

    @property
    def lock(self) -> trio.Lock: ...  # orders writes, truncates and saves of the file

    @property
    def gate(self) -> Gate: ...


class Mount(Protocol):
    """What the save service asks of the mount."""

    def file_at(self, rel: str) -> SavedFile:
        """The file at ``rel`` (kept while a save of it is queued)."""
        ...

    def let_go(self, file: SavedFile) -> None:
        """No save of ``file`` is queued any more."""
        ...

    async def forget_unsaved(self, file: SavedFile) -> None:
        """A save of ``file`` failed: whatever the mount caches of the unsaved version goes."""
        ...

    def passthrough(self) -> bool | None:
        """Whether a client may write an open file directly (passthrough); None: no kernel mount."""
        ...


class SaveObserver(Protocol):
    """Told about saves (metrics); called on the mount's thread, so it must be quick."""

    def on_save(self, seconds: float, size: int, new_bytes: int, closed: float | None = None) -> None: ...


def errno_of(e: BaseException) -> int:
    if isinstance(e, OSError) and e.errno:
        return e.errno
    return errno.EIO


class SaveService:
    """Saves of one mount (see the module's docstring)."""

    def __init__(self, files: Files, mount: Mount) -> None:
        self.files = files
        self.repo = files.repo
        self.mount = mount
        self.saves = 0  # saves stored (metrics)
        self.observer: SaveObserver | None = None
        # Staged saves (store/wholefiles.py): a writer's close hands its file to ingestion, which
        # the daemon starts (``start_ingestion``); None: every save is stored before its close returns.
        self.ingester: Ingester | None = None
        self.staged_saves = 0  # saves handed to ingestion
        self.deferred_saves = 0  # of them, waiting for their writer's last release (``SavedFile.deferred``)
        self.room: Room | None = None  # room for saves, checked at their open (file/room.py)
        self.stop_timeout = 60.0  # the daemon's: how long an unmount waits for staged saves to be stored
        self._of: dict[Job, SavedFile] = {}  # queued saves -> the file each is of
        self._deferring: set[SavedFile] = set()  # files with deferred saves

    async def _thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args)

    # -- staged saves ------------------------------------------------------------------------

    def start_ingestion(self, workers: int = 1) -> None:
        """Saves of whole files are stored behind their close from now on (on the trio thread,
        with a whole-file directory set up)."""
        self._token = trio.lowlevel.current_trio_token()
        self.ingester = Ingester(self.files, self, self.repo.settings.ingest_backlog, workers)
        # Passed through, a client's mapping may write a staged file after its close: hot copies are copies.
        self.ingester.fresh_hot_copies = lambda: self.mount.passthrough() is not False
        if self.repo.whole is not None:
            self.room = Room(self.repo.root, self.repo.whole, self.ingester)

    async def stop_ingestion(self) -> None:
        """At unmount: store what is staged, for up to ``stop_timeout`` seconds (a reboot after
        the stop would lose it); what is left is stored by the next mount."""
        ingester = self.ingester
        if ingester is None:
            return
        for node in list(self._deferring):  # the mount is gone: no release will come
            self._deferring.discard(node)
            jobs, node.deferred = node.deferred, []
            self.deferred_saves -= len(jobs)
            for job in jobs:
                job.adopt = False
                ingester.submit(job)
        count, size = ingester.backlog()
        if count:
            log.info("storing %d staged saves (%s) before stopping", count, mib(size))
        bound = self.stop_timeout
        if not await self._thread(ingester.drain, bound):
            log.warning("staged saves still not stored after %.0f s: the next mount stores them", bound)
        await self._thread(ingester.close)
        if self.repo.whole is not None:  # what the stop leaves only in memory, by name
            ingester.report_unstored(self.repo.whole.staged_dir)
        self.ingester = None

    async def resume_staged(self) -> int:
        """Queue the staged saves a previous daemon left (killed before storing them); clear the
        stubs' names of staged files that are gone (a reboot: the previous version stays) and
        delete staged files no stub names. Costs nothing when nothing is staged. The saves queued."""
        whole = self.repo.whole
        if whole is None:
            return 0
        kept = await self._thread(self.repo.adopt_kept)  # versions a lost staged save falls back to
        present = set(await self._thread(whole.staged_names))
        if not present and not whole.rebooted and not kept:
            return 0
        found, complete = await self._thread(self.repo.staged_saves)
        queued = 0
        for rel, staged in found:
            if staged.name in present and staged.boot == whole.boot:
                node = self.mount.file_at(rel)
                # Not made a hot copy: a mapping from before the restart may still write the file.
                self._queue_ingestion(node, whole.staged_path(staged.name), staged.size, 0.0, adopt=False)
                present.discard(staged.name)
                queued += 1
                continue
            why = "another boot" if staged.boot != whole.boot else "its staged copy is gone"
            try:
                done = await self._thread(self.repo.lose_staged, rel)
            except OSError as e:  # its stub names a file that is gone: reads of it fail (EIO) until then
                log.error("the lost save of %s (%s) is still named on its stub: %s", rel, why, e)
                continue
            log.warning(_LOST[done], rel, why)
        if not complete and present:
            log.warning("%d staged files kept: a stub that may name one could not be read", len(present))
            present.clear()
        for name in present:  # written but never closed, or superseded
            await self._thread(whole.drop_staged, whole.staged_path(name))
        if queued:
            log.info("%d saves staged before the last stop are being stored", queued)
        return queued

    # -- the commit at a writer's close ---------------------------------------------------

    async def commit(
        self, node: SavedFile, durable: bool = False, closing: bool = False, unless: Callable[[], bool] | None = None
    ) -> None:
        """Save the node's content as its stub if it changed (the atomic replace): stored now, or,
        a whole file handed to ingestion, its staged file named on the stub (``_stage``).
        ``closing``: a writer's own close (its handle still counts among the node's writers);
        ``unless``: a blocking check that, true, makes this close not a commit (in the save's thread)."""
        content = node.content
        if content is None or not (content.dirty or durable):
            return
        ingester = self.ingester
        if ingester is not None and ingester.backlogged():  # bounded: the client waits, the backlog does not grow
            # Not under the node's lock: ingestion takes it to install (the wait would never end). On
            # this thread, not a worker's: closes waiting in every worker would leave none for the
            # install that ends their wait.
            log.info("ingestion is %s behind: the close of %s waits", mib(ingester.backlog()[1]), node.path)
            ingester.waits += 1
            while ingester.backlogged() and self.ingester is ingester:
                await trio.sleep(BACKLOG_STEP)
        async with node.lock:
            if not content.dirty and not durable:
                return
            start = time.monotonic()
            others = node.writers - closing  # handles still open that may write on
            limit = self.repo.settings.max_file_size
            if content.whole is not None and content.size > limit:
                # Written past it through the backing file (passthrough): refused here, at the save.
                log.debug("saving %s refused: %d bytes, max_file_size is %d", node.path, content.size, limit)
                await self.mount.forget_unsaved(node)
                raise SaveRefused(errno.EFBIG)
            staged = not durable and not self.repo.durable and self.ingester is not None and content.own_file()
            inline = not durable and self._memory_short()  # counted: a save while memory is short
            claim = None  # the room on the store's disk this save holds until stored (file/room.py)
            if staged:  # a write to it may have failed for room: never committed, staged or stored now
                claim = await self._room_to_stage(node, content, unless)
            if staged and not inline:
                try:
                    if await self._stage(node, content, start, copy=others > 0, unless=unless, claim=claim) and others:
                        content.mark_changed()  # their close saves what they write (passthrough: unseen)
                finally:
                    if claim is not None and not claim.handed:  # not queued: nothing to hold room for
                        claim.release()
                return
            if claim is not None:  # stored now, before the close returns: its own failure refuses it
                claim.release()
            if unless is not None and await self._thread(unless):
                log.debug("flush of %s from another copy of the descriptor: not a commit", node.path)
                return
            try:
                pending = await self._thread(self.files.prepare_save, content, node.path, durable)
                await node.gate.settled()  # no rename of it in flight, and none starts before the install
                rel = node.path  # read at rename time: a rename of the open file meanwhile is honoured
                if not self.files.finish_save(pending, rel):
                    return  # unlinked while open: nothing to save
                assert rel is not None
                self._carry_set_times(node, pending.gen, rel)
                if pending.durable:
                    await self._thread(self.files.sync_dir, rel)
            except (ChunkMissing, ChunkCorrupt, OSError) as e:
                log.error("saving %s failed, previous version kept: %s", node.path, e)
                await self.mount.forget_unsaved(node)
                raise SaveRefused(errno_of(e)) from None
            self.saves += 1
            seconds, new_bytes = time.monotonic() - start, pending.new_bytes
            self._observe("on_save", seconds, pending.index.size, new_bytes)
            log.info("saved %s: %s, %s new, in %.0f ms", rel, mib(pending.index.size), mib(new_bytes),
                     seconds * 1000)  # fmt: skip
            if node.writers - closing > 0 and content.whole is not None:
                content.mark_changed()  # still open for writing: passthrough writes are unseen
                # A client's fsync: its close stores nothing again if the file is still this save
                # (ingesting it again would replace the durable stub by one a power cut can take).
                node.synced = pending.record.file_sum if durable and pending.record is not None else None

    async def _room_to_stage(
        self, node: SavedFile, content: FileContent, unless: Callable[[], bool] | None
    ) -> Claim | None:
        """A save of a staged file is not committed if a write to it may have failed for lack of
        room, nor if the store could not take it: ENOSPC (or the store's errno), the previous version
        kept. A FLUSH that ``unless`` says is not a commit is not refused (its writer's close is).
        The room the save claims on the store's disk (None: no room is checked)."""
        room = self.room
        if room is None:
            return None
        error, claim = await self._thread(room.at_close, content)
        if error is not None and unless is not None and await self._thread(unless):
            return None  # not a commit: the caller's own check says so again, and nothing is saved
        if error is not None:
            log.error("saving %s refused, previous version kept: %s", node.path, error.strerror)
            await self.mount.forget_unsaved(node)
            raise SaveRefused(error.errno or errno.EIO)
        return claim

    async def _stage(
        self,
        node: SavedFile,
        content: FileContent,
        start: float,
        copy: bool,
        unless: Callable[[], bool] | None = None,
        claim: Claim | None = None,
    ) -> bool:
        """A save by its staged file: the commit point is naming the file on the stub (from then
        on it is the snapshot, through a kill -9 too); ingestion stores it behind the close.
        False if ``unless`` said this is not a commit."""
        assert self.ingester is not None
        synced, node.synced = node.synced, None
        if synced is not None and (unless is None or not await self._thread(unless)):
            if await self._thread(same_sum, content.whole_fd(), synced):
                content.committed(content.gen)  # unchanged since the client's fsync stored it durably
                return True
        elif synced is not None:  # a FLUSH from another copy of the descriptor: not a commit
            node.synced = synced
            return False
        async with node.gate.use():
            rel = node.path
            try:
                staged = await self._thread(self._seal_and_stage, content, copy, rel, unless)
            except OSError as e:
                log.error("saving %s failed, previous version kept: %s", node.path, e)
                await self.mount.forget_unsaved(node)
                raise SaveRefused(errno_of(e)) from None
            if staged is None:
                log.debug("flush of %s from another copy of the descriptor: not a commit", node.path)
                return False
            path, size, gen = staged
            if rel is not None:
                self._carry_set_times(node, gen, rel)
        content.committed(gen)
        if rel is None:  # unlinked while open: nothing to save
            return True
        self.staged_saves += 1
        # Its own file (not a copy) may still be written after this close through another reference
        # to the writer's file description (a child's inherited descriptor: passed through, the
        # kernel writes it directly): stored at the last release, as the file is then.
        self._queue_ingestion(node, path, size, (time.monotonic() - start) * 1000, defer=not copy, claim=claim)
        return True

    def _memory_short(self) -> bool:
        """Memory is short (store/pressure.py): this save is stored now, not staged (counted)."""
        whole = self.repo.whole
        if whole is None or not whole.short or self.ingester is None or self.repo.durable:
            return False
        whole.stats.saves_inline += 1
        return True

    def _seal_and_stage(
        self, content: FileContent, copy: bool, rel: str | None, unless: Callable[[], bool] | None
    ) -> tuple[Path, int, int] | None:
        """A staged save's blocking part, one thread hop: the file sealed and named on the stub
        (dropped if the file was unlinked); None, nothing done, if ``unless()``."""
        if unless is not None and unless():
            return None
        whole = self.repo.whole
        assert whole is not None
        path, size, gen = content.seal(copy)
        try:
            if rel is not None:
                self.repo.stage(rel, path.name, size)
        except BaseException:
            whole.drop_staged(path)
            raise
        if rel is None:
            whole.drop_staged(path)
        return path, size, gen

    def _queue_ingestion(
        self,
        node: SavedFile,
        path: Path,
        size: int,
        closed_ms: float,
        defer: bool = False,
        adopt: bool = True,
        claim: Claim | None = None,
    ) -> None:
        assert self.ingester is not None
        node.ingesting += 1
        job = Job(path, size, lambda: node.path, closed_ms=closed_ms, adopt=adopt, claim=claim)
        if claim is not None:
            claim.handed = True  # held until ingestion has written its chunks
        self._of[job] = node
        if defer and node.writers > 0 and self.mount.passthrough() is True:
            node.deferred.append(job)
            self._deferring.add(node)
            self.deferred_saves += 1
        else:
            self.ingester.submit(job)

    async def ingest_deferred(self, node: SavedFile) -> None:
        """The writer's file description is released (a child's inherited descriptor kept it open
        until now): its sealed saves are stored as their files are now, writes made after the
        close included (the stub's staged size follows the file's)."""
        jobs, node.deferred = node.deferred, []
        self._deferring.discard(node)
        async with node.lock, node.gate.use():
            for job in jobs:
                try:
                    job.size = await self._thread(self._restage, node.path, job)
                    if job.claim is not None:  # grown since its close: it holds room for what it holds now
                        job.claim.size = max(job.claim.size, needed(await self._thread(os.stat, job.path)))
                except OSError as e:  # ingestion reads the file as it is all the same
                    log.warning("the save of %s grew after its close; its size not updated: %s", node.path, e)
                assert self.ingester is not None
                self.ingester.submit(job)
                self.deferred_saves -= 1  # counted until queued: ``Mount.ingested`` waits for it

    def _restage(self, rel: str | None, job: Job) -> int:
        """The staged file's size now; named on the stub if it changed and the stub still names it."""
        try:
            size = os.stat(job.path).st_size
        except FileNotFoundError:
            return job.size
        if rel is not None and size != job.size:
            staged = self.repo.staged(rel)
            if staged is not None and staged.name == job.name:
                self.repo.stage(rel, job.name, size)
        return size

    # -- ingestion's callbacks (worker threads) ---------------------------------------------

    def install(self, job: Job, pending: PendingSave) -> Outcome:
        """From an ingestion worker: install its new stub on the trio thread (``_install``)."""
        try:
            return trio.from_thread.run(self._install, job, pending, trio_token=self._token)
        except trio.RunFinishedError:
            _discard(pending)
            return Outcome.LATER

    async def _install(self, job: Job, pending: PendingSave) -> Outcome:
        node = self._of[job]
        # The node's lock orders it with the saves of the file (``_stage`` names a newer staged file
        # under it): a stub read as naming this save must still name it when it is replaced.
        async with node.lock, node.gate.use():
            rel = node.path
            try:
                current = None if rel is None else await self._thread(self.repo.staged, rel)
            except OSError:  # cannot tell: the staged file stays the snapshot (ingestion tries again)
                await self._thread(_discard, pending)
                raise
            if rel is None or current is None or current.name != job.name:
                await self._thread(_discard, pending)
                return Outcome.SUPERSEDED
            try:
                self.files.finish_staged(pending, rel)  # the stub replaced: no staged save named any more
            except OSError:  # ingestion logs it and tries again
                await self._thread(_discard, pending)
                raise
        return Outcome.INSTALLED

    def done(self, job: Job, outcome: Outcome, new_bytes: int, seconds: float) -> None:
        """From an ingestion worker: the job is over (metrics, the log line, the node let go)."""
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(self._ingested, job, outcome, new_bytes, seconds, trio_token=self._token)

    def _ingested(self, job: Job, outcome: Outcome, new_bytes: int, seconds: float) -> None:
        node = self._of.pop(job)
        node.ingesting -= 1
        self.mount.let_go(node)
        if outcome is not Outcome.INSTALLED:
            return
        self.saves += 1
        stored = job.closed_ms / 1000 + time.monotonic() - job.queued  # from the close's start until stored
        self._observe("on_save", stored, job.size, new_bytes, job.closed_ms / 1000)
        log.info("saved %s: %s, %s new, closed in %.0f ms, stored in %.0f ms", node.path or job.where() or job.name,
                 mib(job.size), mib(new_bytes), job.closed_ms, seconds * 1000)  # fmt: skip

    def _carry_set_times(self, node: SavedFile, gen: int, rel: str) -> None:
        """Give the saved stub the times set on the open file, if nothing was written after them."""
        times, node.set_times = node.set_times, None
        if times is None or times[2] != gen or times[3] != (node.content.whole_mtime() if node.content else -1):
            return
        try:
            self.repo.set_times(rel, times[0], times[1])
        except OSError as e:  # the save stands; only its times are the save's
            log.warning("times set on %s not kept: %s", rel, e)

    def _observe(self, event: str, *args: float) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, event)(*args)
        except Exception:  # metrics must never fail a save or a restore
            log.exception("observer %s failed", event)

    # -- metrics -----------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """The save service's counters (``saves``) and the staged saves' and the hot tier's."""
        return {"saves": self.saves} | self.whole_stats()

    def whole_stats(self) -> dict[str, int]:
        """The staged saves and the hot tier: ingestion's backlog, the tier's size and traffic."""
        whole, ingester = self.repo.whole, self.ingester
        if whole is None:
            return {}
        queued, queued_bytes = ingester.backlog() if ingester is not None else (0, 0)
        files, size = whole.hot_usage()
        h = whole.stats
        return {
            "staged_saves": self.staged_saves,
            "ingest_queue": queued + self.deferred_saves,
            "ingest_queue_bytes": queued_bytes,
            "ingest_waits": ingester.waits if ingester is not None else 0,
            "ingest_failures": ingester.failures if ingester is not None else 0,
            "ingest_behind_ms": int(ingester.lag() * 1000) if ingester is not None else 0,
            "ingest_backlog_limit": ingester.limit if ingester is not None else 0,
            **self._room_stats(),
            "hot_files": files,
            "hot_bytes": size,
            "hot_budget": whole.budget,
            "hot_hits": h.hits,
            "hot_misses": h.misses,
            "hot_put_backs": h.put_backs,
            "hot_evictions": h.evictions,
        } | whole.tier_stats()

    def _room_stats(self) -> dict[str, int]:
        """Whether the store is degraded (ingestion cannot store what is staged) and how much is
        not stored; the saves refused for it and the opens that waited for room."""
        ingester, room = self.ingester, self.room
        unstored = ingester.unstored() if ingester is not None else []
        return {
            "ingest_degraded": int(ingester is not None and ingester.degraded() is not None),
            "unstored_saves": len(unstored),
            "unstored_bytes": sum(j.size for j in unstored),
            "saves_refused": room.refused if room is not None else 0,
            "room_waits": room.waits if room is not None else 0,
        }


_LOST = {  # Repository.lose_staged's outcome -> the log line
    "index": "the save of %s was lost (%s): its previous version stays",
    "kept": "the save of %s was lost (%s): the version it replaced is back",
    "removed": "the first save of %s was lost (%s): the name is removed",
}


def mib(n: int) -> str:
    """A byte count for a log line: MiB with a decimal, or bytes below one."""
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"


def _discard(pending: PendingSave) -> None:
    """A prepared stub that is not installed (blocking)."""
    if pending.tmp is not None:
        with contextlib.suppress(FileNotFoundError):
            pending.tmp.unlink()
