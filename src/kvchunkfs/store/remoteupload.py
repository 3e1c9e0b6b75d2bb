"""The shared tier's upload queue: write-behind upload of snapshots to the bucket.

**Upload (write-behind).** The local save is untouched: ``Repository`` reports every committed
namespace change (install, rename, unlink) to ``changed``, which only adds the path to an in-memory
set (a list operation: the FUSE thread never waits). The upload thread then makes the bucket agree
with the local stub: the chunks first (``remote_upload_workers`` threads), the index last, so an
index in the bucket never names a missing chunk. A stub that is gone deletes the index this host
put there (if it is still that version).

**The queue is durable by construction.** ``STORE/remote.db`` records, per path, the sha256 of the
index this host last put in (or fetched from) the bucket and the stub's ctime then. At every mount
the upload thread compares it with ``snapshots/`` (one ``lstat`` per stub, a read only for changed
ones): whatever differs is queued again. So a kill -9 at any point loses nothing, and nothing is
written on the save path.

**Chunk freshness (the GC grace rule).** ``gc --remote`` deletes a chunk only if no index names it
and it is older than ``remote_grace``. An upload therefore treats a chunk as present only if its
modification time is within half the grace; an older one is touched (copied onto itself) so that
it is young again before the index naming it goes up."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import time

from kvchunkfs.format import index as idx
from kvchunkfs.store import stubs
from kvchunkfs.store.bucketformat import FormatMismatch
from kvchunkfs.store.packs import ChunkCorrupt, ChunkMissing
from kvchunkfs.store.remoteheal import Healing
from kvchunkfs.store.remoteindex import record_meta
from kvchunkfs.store.remotesync import Synced

log = logging.getLogger(__name__)

_MAX_BACKOFF = 5.0  # seconds between retries of a failing upload


class UploadQueue(Healing):
    # -- the queue ----------------------------------------------------------------------------

    def changed(self, *rels: str) -> None:
        """Paths whose stub changed, appeared or went away (after the change). Never blocks."""
        with self._cond:
            for rel in rels:
                self._queue.pop(rel, None)
                self._queue[rel] = None  # to the end: the newest change is handled last
            self._cond.notify()

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not self._busy

    def _run(self) -> None:
        try:
            self._scan()
        except Exception:  # the queue still takes new changes; the next mount scans again
            log.exception("remote: scanning for snapshots to upload failed")
        finally:
            with self._cond:
                self._busy = 0
        failures = 0
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                rel = next(iter(self._queue))
                del self._queue[rel]
                self._busy = 1
            try:
                self.check_format()
                self._sync(rel)
                failures = 0
            except FormatMismatch:  # logged once; the queue waits (remote.db re-queues it at the next mount)
                with self._cond:
                    self._queue.setdefault(rel, None)
                    while not self._stop:
                        self._cond.wait()
                return
            except (ChunkMissing, ChunkCorrupt) as e:  # retrying cannot help; a later change queues it again
                self.upload_errors += 1
                log.error("remote: cannot upload %s: %s", rel, e)
            except Exception as e:  # retried with backoff: an unreachable bucket never fails a save
                failures += 1
                self.upload_errors += 1
                log.warning("remote: upload of %s failed (retrying): %s", rel, e, exc_info=not isinstance(e, OSError))
                with self._cond:
                    self._queue.setdefault(rel, None)
                    self._cond.wait(min(_MAX_BACKOFF, 0.2 * 2**failures))
            finally:
                with self._cond:
                    self._busy = 0
                    idle = not self._queue
                if idle:
                    self._poke()  # uploads drained: evicting is safe for more snapshots now

    def _scan(self) -> None:
        """Queue every path where ``snapshots/`` and ``remote.db`` disagree (the durable queue)."""
        synced = self.db.all()
        stale = []
        for entry in stubs.walk(self.repo.snapshots):
            if entry.kind != "file":
                continue
            if synced.pop(entry.rel, None) != entry.ctime_ns:
                stale.append(entry.rel)
        stale.extend(synced)  # synced once, gone now
        if stale:
            log.info("remote: %d snapshots to bring up to date with %s", len(stale), self.bucket.url)
            with self._cond:
                for rel in stale:
                    self._queue.setdefault(rel, None)
                self._cond.notify()

    # -- upload -------------------------------------------------------------------------------

    def _sync(self, rel: str) -> None:
        path = self.repo.path(rel)
        try:
            fd = stubs.open_stub(path)
        except FileNotFoundError:
            self._gone(rel)
            return
        except stubs.StubError:  # a directory (renamed): its stubs, and the old paths below it
            if stat.S_ISDIR(os.lstat(path).st_mode):
                self._queue_below(rel)
            return
        try:
            data, _ = stubs.read_stub(fd)
            record = stubs.read_record(fd)
            ctime_ns = os.fstat(fd).st_ctime_ns
        finally:
            os.close(fd)
        sha = hashlib.sha256(data).digest()
        row = self.db.get(rel)
        if row is not None and row.sha == sha:
            if row.ctime_ns != ctime_ns:
                self.db.put(rel, Synced(sha, row.etag, ctime_ns))
            return
        try:
            index = idx.decode(data)
        except idx.IndexFormatError as e:
            log.error("remote: %s is not a valid index, not uploaded: %s", rel, e)
            return
        self._heal()
        self._upload_chunks(index)
        etag = self.bucket.put_index(rel, data, self._stream_tag(record), record_meta(data, record, index.size))
        self.db.put(rel, Synced(sha, etag, ctime_ns))
        self.uploaded_indexes += 1
        log.info("remote: uploaded %s (%d chunks)", rel, len(index))

    def _gone(self, rel: str) -> None:
        """The local stub is gone: delete the index this host put there, unless replaced since."""
        row = self.db.get(rel)
        if row is None:
            self._queue_below(rel)  # maybe a directory that was renamed or removed
            return
        if self.bucket.head_index(rel) == row.etag:
            self.bucket.delete_index(rel)
            self.deleted_indexes += 1
            log.info("remote: deleted %s", rel)
        self.db.delete(rel)

    def _queue_below(self, rel: str) -> None:
        prefix = rel + "/"
        below = [r for r in self.db.all() if r.startswith(prefix)]
        with contextlib.suppress(OSError):
            below += [prefix + e.rel for e in stubs.walk(self.repo.path(rel)) if e.kind == "file"]
        if below:
            with self._cond:
                for r in below:
                    self._queue.setdefault(r, None)

    def _upload_chunks(self, index: idx.Index) -> None:
        lengths = {cid: index.length(i) for i, cid in enumerate(index.ids)}
        todo = [cid for cid in lengths if not self._fresh(cid)]
        total = sum(lengths[c] for c in todo)
        self.bytes_pending += total
        try:
            if self.layout >= 2:
                self._upload_packed(todo)
                return
            futures = [self._uploads.submit(self._ensure, cid) for cid in todo]
            for f in futures:
                f.result()
        finally:
            self.bytes_pending -= total

    def _upload_packed(self, todo: list[bytes]) -> None:
        """Chunks the bucket's packs hold (as learned) are reused, their packs touched if older
        than half the grace; the rest go up in new packs, then one pack index per up to 64 packs."""
        if not todo:
            return
        self._learn()
        known = self.db.locate(todo)
        new = [c for c in todo if c not in known]
        for pack, cids in self._by_pack(known).items():
            seen = known[cids[0]][1]
            age = time.time() - seen
            if age < self.grace / 2:
                pass
            elif self.bucket.touch_pack(pack):
                self.db.seen([pack], time.time())
                age = 0
            else:  # collected since this host learned it
                self.db.forget_pack(pack)
                new.extend(cids)
                continue
            for cid in cids:
                self._confirm(cid, age)
        if new:
            self._put_packs(new)

    def _ensure(self, cid: bytes) -> None:
        """The chunk is in the bucket, with its content, and younger than half the grace when this returns."""
        head = self.bucket.stat_chunk(cid)
        data = None
        if head is not None:
            with contextlib.suppress(ChunkMissing):  # evicted here: the bucket's copy is all there is
                data = self._local(cid)
            if data is not None and not self._holds(cid, head, data):
                self._heal_one(cid, data, "its ETag is not its content's")
                return
            if head.now - head.modified < self.grace / 2:
                self._confirm(cid, head.now - head.modified)
                return
            self.bucket.touch_chunk(cid)
            self._confirm(cid, 0)
            return
        self._put_verified(cid, data or self._local(cid))
