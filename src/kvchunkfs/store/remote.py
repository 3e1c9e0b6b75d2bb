"""The shared tier: write-behind upload of snapshots to a bucket, read-through from it.

``RemoteTier`` is the whole of it, built of one part per concept: the upload queue
(store/remoteupload.py), healing of bad chunk objects (store/remoteheal.py), the packed layout
(store/remotepacked.py), read-through (store/remotefetch.py), cross-host refresh
(store/remoterefresh.py), on the common ground of store/remotecore.py, the index objects and the
file records they carry (store/remoteindex.py) and the sync database ``remote.db``
(store/remotesync.py).

**Eviction (``local_cache_size``, maint/evict.py).** The tier answers which snapshots are provably
in the bucket (``confirmed``: the stub is the version this host synced, and a fresh listing shows
that very index object), keeps the set of snapshots whose chunks are not all local (``partial``:
evicted, or fetched from another host and not opened yet), and counts evictions for ``stats``."""

from __future__ import annotations

import logging
import threading
import time

from kvchunkfs.store.remoterefresh import CrossHostRefresh
from kvchunkfs.store.remoteupload import UploadQueue

log = logging.getLogger(__name__)


class RemoteTier(UploadQueue, CrossHostRefresh):
    """The shared tier of one store: started and stopped with the mount; its numbers for ``stats``."""

    def start(self) -> None:
        with self._cond:
            self._busy = 1  # the scan counts as queued work until it has queued what it found
        self._thread = threading.Thread(target=self._run, name="kvcfs-uploader", daemon=True)
        self._thread.start()
        self._fetches.submit(self.listing)  # the first lookup miss should not wait for it

    def close(self, timeout: float = 30) -> None:
        """Stop after the path being uploaded (the rest stays queued: the next mount resumes it)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._uploads.shutdown(wait=True, cancel_futures=True)
        self._fetches.shutdown(wait=True, cancel_futures=True)
        self.db.close()

    def stats(self) -> dict[str, int]:
        c = self.bucket.counters
        with self._cond:
            queued = len(self._queue) + self._busy
        return {
            "upload_queue": queued,
            "upload_bytes_pending": self.bytes_pending,
            "upload_errors": self.upload_errors,
            "uploaded_indexes": self.uploaded_indexes,
            "remote_chunk_puts": c.chunk_puts,
            "remote_chunk_put_bytes": c.chunk_put_bytes,
            "remote_chunk_gets": c.chunk_gets,
            "remote_chunk_get_bytes": c.chunk_get_bytes,
            "remote_index_gets": c.index_gets,
            "remote_lists": c.lists,
            "remote_refused": int(self._format_state not in (None, "ok")),
            "remote_refused_indexes": self.refused_indexes,
            "remote_corrupt_chunks": self.corrupt_chunks,
            "remote_fetched_chunks": self.fetched_chunks,
            "remote_index_puts": c.index_puts,
            "remote_pack_puts": c.pack_puts,
            "remote_pack_put_bytes": c.pack_put_bytes,
            "remote_pack_touches": c.pack_touches,
            "remote_packidx_puts": c.packidx_puts,
            "remote_packidx_gets": c.packidx_gets,
            "remote_range_gets": c.range_gets,
            "remote_range_get_bytes": c.range_get_bytes,
            "remote_heads": c.heads,
            "remote_requests": c.requests(),
            "remote_healed_chunks": self.healed_chunks,
        } | self._eviction_stats()

    def _eviction_stats(self) -> dict[str, int]:
        e = self.eviction
        if not e.limit:
            return {}
        return {
            "local_cache_size": e.limit,
            "local_bytes": e.local_bytes,
            "evictions": e.runs,
            "evicted_chunks": e.evicted_chunks,
            "evicted_bytes": e.evicted_bytes,
            "partial_snapshots": len(self._partial),
        }

    # -- where snapshots are (eviction, ls) ---------------------------------------------------

    def confirmed(self) -> dict[str, bytes]:
        """rel -> sha256 of the stub content that is provably in the bucket now: the version this
        host last synced, whose index object a fresh listing still shows (same ETag; another
        host's newer version would not name the same chunks). OSError if the bucket cannot be
        listed (then nothing is provably there). Blocking: a LIST."""
        names = self.bucket.list_indexes()
        with self._list_lock:
            self._listing = (time.monotonic(), names)
        return {rel: row.sha for rel, row in self.db.rows().items() if (i := names.get(rel)) and i.etag == row.etag}
