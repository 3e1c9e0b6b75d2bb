"""The shared tier's read-through: snapshots and chunks this host lacks, fetched from the bucket.

**Read-through.** A lookup or listing miss consults the bucket's index listing (reused for
``remote_list_ttl`` seconds) and fetches the index into a local stub (create-if-absent: a local
file always wins). Opening a snapshot fetches the chunks the local packs lack (parallel GETs,
hashes checked) into local packs; later restores read local packs only. In the packed layout the
chunks come from packs in coalesced range GETs, each chunk checked against its id."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from kvchunkfs.store import remotepacks as rp
from kvchunkfs.store.packs import ChunkCorrupt, ChunkMissing
from kvchunkfs.store.remotecore import Deliver
from kvchunkfs.store.remoteheal import Healing
from kvchunkfs.store.remotesync import Synced
from kvchunkfs.store.s3 import ObjectInfo

log = logging.getLogger(__name__)

_FETCH_BATCH = 8 << 20  # fetched bytes stored per pack append
_FETCH_IDS = 1 << 15  # distinct chunk ids a fetch looks up and fetches at a time
_FIRST_LIST_WAIT = 2.0  # seconds a lookup waits for the daemon's first listing of the bucket


class ReadThrough(Healing):
    # -- read-through -------------------------------------------------------------------------

    def listing(self, wait: bool = True) -> dict[str, ObjectInfo]:
        """The bucket's snapshots. Only calls before the first LIST has answered wait for it, at
        most 2 s (none with ``wait=False``: the FUSE thread); later ones get the last listing and,
        if it is older than ``list_ttl``, start a refresh in the background (so a listing is at most
        ``list_ttl`` plus one LIST old, and a dead bucket never stalls a lookup)."""
        with self._list_lock:
            cached = self._listing
            stale = cached is None or time.monotonic() - cached[0] >= self.list_ttl
            start = stale and not self._refreshing
            if start:
                self._refreshing = True
        if start:
            self._fetches.submit(self._refresh)
        if cached is None and wait:  # right after mount; a dead bucket costs one lookup this long
            self._listed.wait(_FIRST_LIST_WAIT)
        with self._list_lock:
            return self._listing[1] if self._listing is not None else {}

    def _refresh(self) -> None:
        try:
            self.check_format()  # a refused bucket lists nothing: no lookup brings its snapshots
            names = self.bucket.list_indexes()
            with self._list_lock:
                self._listing = (time.monotonic(), names)
        except OSError as e:
            log.warning("remote: listing %s failed: %s", self.bucket.url, e)
            with self._list_lock:
                if self._listing is None:
                    self._listing = (time.monotonic(), {})  # tried again after list_ttl
        finally:
            with self._list_lock:
                self._refreshing = False
            self._listed.set()

    def lookup(self, rel: str) -> bool:
        """Bring ``rel`` from the bucket if it is a snapshot or a directory there; True if now local."""
        names = self.listing()
        if rel in names:
            return self._materialize(rel)
        prefix = rel + "/"
        if any(r.startswith(prefix) for r in names):
            with contextlib.suppress(FileExistsError):
                os.makedirs(self.repo.path(rel), 0o755)
            return True
        return False

    def fill_dir(self, rel: str) -> None:
        """Bring the bucket's entries directly below the directory ``rel`` that it lacks (blocking)."""
        prefix = rel + "/" if rel else ""
        files, dirs = [], set()
        for name in self.listing():
            if not name.startswith(prefix):
                continue
            head, sep, _ = name[len(prefix) :].partition("/")
            if sep:
                dirs.add(prefix + head)
            else:
                files.append(name)
        for d in dirs:
            with contextlib.suppress(FileExistsError):
                os.makedirs(self.repo.path(d), 0o755)
        missing = [f for f in files if not os.path.lexists(self.repo.path(f))]
        for f in [self._fetches.submit(self._materialize, r) for r in missing]:
            try:
                f.result()
            except OSError as e:  # listed but unreadable now (deleted meanwhile, bucket down)
                log.warning("remote: %s", e)

    def _materialize(self, rel: str) -> bool:
        """Fetch ``rel``'s index into a new local stub; False if the bucket no longer has it, or if
        this host deleted or renamed it and has not told the bucket yet (synced, stub gone: the
        uploader is about to delete it there; fetching it back would undo the unlink)."""
        if self.db.get(rel) is not None:
            return False
        self.check_format()
        fetched = self._fetch_stub(rel, None)
        if fetched is None:
            return False
        path = self.repo.path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        ctime_ns = os.lstat(fetched.tmp).st_ctime_ns  # a link changes it: read again below
        if not self.repo.install_new(fetched.tmp, rel):
            return True  # a local file won the race
        self.mark_partial(rel)  # its chunks come at the first open
        with contextlib.suppress(OSError):
            ctime_ns = os.lstat(path).st_ctime_ns
        self.db.put(rel, Synced(fetched.sha, fetched.obj.etag, ctime_ns))
        self.fetched_indexes += 1
        log.info("remote: fetched the index of %s", rel)
        return True

    def fetch_missing(self, ids: Iterable[bytes], owner: object, deliver: Deliver | None = None) -> int:
        """Store the chunks of ``ids`` the local packs lack, fetched from the bucket (pinned for
        ``owner``: the caller unpins once its own pins hold them). Returns the number fetched.

        ``deliver`` gets every fetched chunk as it arrives, checked against its id, on the fetch
        workers (a restore writes them into its whole file meanwhile); no call of it is running or
        to come once this returns or raises."""
        fetched = 0
        it = iter(ids)
        # A window of ids at a time: what a fetch holds per chunk (ids, locations, runs) stays
        # bounded however many chunks the snapshot has; a chunk a window fetched is local for the next.
        while wanted := list(dict.fromkeys(itertools.islice(it, _FETCH_IDS))):
            fetched += self._fetch_some(wanted, owner, deliver)
        return fetched

    def _fetch_some(self, wanted: list[bytes], owner: object, deliver: Deliver | None) -> int:
        store = self.repo.store
        have = store.has(wanted)
        missing = [c for c in wanted if c not in have]
        del have
        if not missing:
            return 0
        self.check_format()
        if self.layout >= 2:
            loose = self._fetch_packed(missing, owner, deliver)
            if not loose:
                self._poke()
                return len(missing)
            fetched = len(missing) - len(loose)
            return fetched + self._fetch_loose(loose, owner, deliver)
        return self._fetch_loose(missing, owner, deliver)

    def _fetch_loose(self, missing: list[bytes], owner: object, deliver: Deliver | None = None) -> int:
        """One GET per chunk (the loose layout, and chunks of a bucket from before packs)."""
        store = self.repo.store
        pending: collections.deque[tuple[bytes, Future[bytes]]] = collections.deque()
        batch: list[tuple[bytes, bytes | memoryview]] = []
        size = 0
        it = iter(missing)
        try:
            while True:
                while len(pending) < self._fetch_window and (cid := next(it, None)) is not None:
                    pending.append((cid, self._fetches.submit(self.bucket.get_chunk, cid)))
                if not pending:
                    break
                cid, fut = pending.popleft()
                data = fut.result()
                if hashlib.sha256(data).digest() != cid:
                    self._report_corrupt(cid)
                    raise ChunkCorrupt(f"chunk {cid.hex()} from {self.bucket.url} fails its checksum")
                if deliver is not None:
                    deliver(memoryview(data), [(cid, 0, len(data))])
                batch.append((cid, data))
                self.fetched_chunks += 1
                size += len(data)
                if size >= _FETCH_BATCH:
                    store.put_many(batch, owner)
                    batch, size = [], 0
            if batch:
                store.put_many(batch, owner)
        except FileNotFoundError as e:
            raise ChunkMissing(str(e)) from None
        finally:
            for _, fut in pending:
                fut.cancel()
        self._poke()  # the packs grew: maybe past local_cache_size
        return len(missing)

    def _fetch_run(
        self, run: rp.Run, gone: set[bytes], deliver: Deliver | None = None
    ) -> list[tuple[bytes, memoryview]] | None:
        """One range GET, its chunks checked against their ids (here, in the worker: hashing runs
        in parallel), then handed to ``deliver`` if given; None if the pack is gone (added to
        ``gone``). The chunks are views of the response, never copied."""
        try:
            blob = self.bucket.get_ranges(run.pack, [(run.start, run.end)])[0]
        except FileNotFoundError:
            gone.add(run.pack)  # set.add: atomic under the GIL
            return None
        out = []
        for cid, off, n in run.parts:
            data = blob[off : off + n]
            if hashlib.sha256(data).digest() != cid:
                self._report_corrupt(cid)
                raise ChunkCorrupt(f"chunk {cid.hex()} from {self.bucket.url} fails its checksum")
            out.append((cid, data))
        if deliver is not None:
            deliver(blob, run.parts)
        return out

    def _fetch_packed(self, missing: list[bytes], owner: object, deliver: Deliver | None = None) -> list[bytes]:
        """Store the chunks of ``missing`` that the bucket's packs hold (coalesced range GETs, in
        parallel, each chunk checked against its id); the ids no pack holds (loose, legacy)."""
        self._learn()
        known = self.db.locate(missing)
        if len(known) < len(missing):
            self._learn(force=True)  # saved moments ago by another host
            known = self.db.locate(missing)
        gone: set[bytes] = set()
        runs = rp.coalesce((cid, loc) for cid, (loc, _) in known.items())
        store = self.repo.store
        pending: set[Future[list[tuple[bytes, memoryview]] | None]] = set()
        it = iter(runs)
        try:
            while True:
                while len(pending) < self._fetch_window // 4 and (run := next(it, None)) is not None:
                    pending.add(self._fetches.submit(self._fetch_run, run, gone, deliver))
                if not pending:
                    break
                # As they complete, not in order: a slow GET does not hold back the next requests.
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    batch = f.result()
                    if batch:
                        store.put_many(batch, owner)  # while the workers fetch (and deliver) the next runs
                        self.fetched_chunks += len(batch)
        finally:
            _stop(pending, deliver is not None)
        for pack in gone:
            self.db.forget_pack(pack)
        rest = [c for c in missing if c not in known or known[c][0].pack in gone]
        if gone and rest:  # repacked or collected since: what the bucket says now
            self._learn(force=True)
            again = self.db.locate(rest)
            if again and not gone & {loc.pack for loc, _ in again.values()}:
                return self._fetch_packed(list(again), owner, deliver) + [c for c in rest if c not in again]
        return rest


def _stop(pending: Iterable[Future[Any]], running: bool) -> None:
    """Cancel the requests not started; with ``running``, wait for the others too: once a fetch
    that hands chunks over returns or raises, none of its workers still does (to a file its caller
    may have dropped already)."""
    futures = list(pending)
    for f in futures:
        f.cancel()
    if running:
        wait(futures)
