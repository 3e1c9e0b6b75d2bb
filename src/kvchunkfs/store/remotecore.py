"""The shared tier's common ground: its state, the bucket's format, which index objects this host
accepts, the chunks recently confirmed in the bucket, and the snapshots whose chunks are not all
local (``partial``). The tier's parts (upload, healing, read-through, cross-host refresh) build on
it; ``RemoteTier`` (store/remote.py) is the whole."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvchunkfs.format import filerecord
from kvchunkfs.format import index as idx
from kvchunkfs.store.bucketformat import MAX_FORMAT_BYTES, BucketFormat, FormatError, FormatMismatch
from kvchunkfs.store.packs import PackStore
from kvchunkfs.store.remoteindex import FetchedStub, fetch_stub
from kvchunkfs.store.remotesync import DB_NAME, SyncDb
from kvchunkfs.store.s3 import Bucket, IndexObject, ObjectInfo, TooLarge

log = logging.getLogger(__name__)

_CONFIRMED_MAX = 1 << 20  # chunk ids remembered as recently confirmed in the bucket
_SHORT_CHUNKS = 1 << 12  # chunks shorter than the minimum an index may have (segment ends)


# Fetched chunks handed over as they arrive (``fetch_missing``): a buffer and its chunks as (id,
# offset in it, length), every one checked against its id; called on the fetch workers, in any order.
Deliver = Callable[[memoryview, list[tuple[bytes, int, int]]], None]


def max_index_bytes(max_file_size: int, chunk_min: int) -> int:
    """The largest index a file of ``max_file_size`` bytes can have: index objects larger than this
    are refused before a byte of them is parsed (one entry is 40 bytes; chunks are at least
    ``chunk_min`` long, or relayout's small stride, except at a bounded number of segment ends)."""
    from kvchunkfs.format.cutter import SMALL_STRIDE

    entries = max_file_size // max(1, min(chunk_min, SMALL_STRIDE)) + _SHORT_CHUNKS
    return idx.FIXED_BYTES + idx.ITEM_BYTES * entries


def decode_checked(data: bytes, max_file_size: int | None) -> idx.Index:
    """An index object's content, parsed: IndexFormatError also for a file over ``max_file_size``."""
    index = idx.decode(data)
    if max_file_size is not None and index.size > max_file_size:
        raise idx.IndexFormatError(f"a file of {index.size} bytes, more than max_file_size ({max_file_size})")
    return index


class RepoView(Protocol):
    """What the tier needs of ``Repository`` (which owns the tier: no import back)."""

    snapshots: Path
    tmp: Path
    store: PackStore

    def path(self, rel: str) -> Path: ...

    def install_new(self, tmp: Path, rel: str) -> bool: ...

    def install_fetched(self, tmp: Path, rel: str) -> None: ...


@dataclass
class EvictionStats:
    """What ``local_cache_size`` did (maint/evict.py writes, ``stats`` reads: plain numbers)."""

    limit: int = 0
    local_bytes: int = 0  # pack file bytes at the end of the last eviction pass
    runs: int = 0
    evicted_chunks: int = 0
    evicted_bytes: int = 0


class TierCore:
    def __init__(
        self,
        repo: RepoView,
        bucket: Bucket,
        upload_workers: int = 4,
        fetch_workers: int = 8,
        grace: float = 86400,
        list_ttl: float = 5,
        fmt: BucketFormat | None = None,
        max_file_size: int | None = None,
        pack_size: int = 16 << 20,
    ) -> None:
        self.repo = repo
        self.bucket = bucket
        # What this host's store writes and can read; None (tools, tests of other parts): unchecked.
        self.format = fmt
        self._format_state: str | None = None if fmt is not None else "ok"  # None: not checked yet
        self._format_lock = threading.Lock()  # held across the format object's GET/PUT (tier threads only)
        self.refused_indexes = 0
        self.corrupt_chunks = 0  # fetched chunks that failed their id (reported in the bucket)
        self.healed_chunks = 0  # bad chunk objects this host put right
        self._etags_are_md5 = True  # until a good object shows otherwise (SSE-KMS, multipart)
        self._damage_checked = 0.0  # monotonic time of the last look at the bucket's damage reports
        # Index objects over this many bytes are refused unread (a bogus one must not cost memory).
        self.max_file_size = max_file_size
        self.pack_size = pack_size or 16 << 20
        self.layout = 1 if fmt is None else fmt.layout  # the bucket's, once its format object is read
        self._learn_lock = threading.Lock()  # one reader of the bucket's pack indexes at a time
        self._learned_at = -1e18
        self.fetched_chunks = 0
        self.max_index = max_index_bytes(max_file_size, fmt.chunk_min if fmt else 1) if max_file_size else None
        self.grace = grace
        self.list_ttl = list_ttl
        self.db = SyncDb(repo.snapshots.parent / DB_NAME, bucket.url)
        self._uploads = ThreadPoolExecutor(upload_workers, thread_name_prefix="kvcfs-upload")
        self._fetches = ThreadPoolExecutor(fetch_workers, thread_name_prefix="kvcfs-fetch")
        self._fetch_window = max(4 * fetch_workers, 16)
        # The queue: paths to bring in agreement with the bucket. ``_cond`` guards list operations
        # and counters only, never I/O, so ``changed`` may be called on the FUSE thread.
        self._cond = threading.Condition()
        self._queue: dict[str, None] = {}
        self._busy = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self.bytes_pending = 0
        self.upload_errors = 0
        self.uploaded_indexes = 0
        self.deleted_indexes = 0
        self.fetched_indexes = 0
        # chunk id -> monotonic time equivalent to its modification in the bucket (leaf lock)
        self._confirmed: dict[bytes, float] = {}
        self._confirmed_lock = threading.Lock()
        self._listing: tuple[float, dict[str, ObjectInfo]] | None = None
        self._list_lock = threading.Lock()  # the cached listing; list operations only
        self._refreshing = False
        self._listed = threading.Event()  # the first listing is there (or failed)
        # Snapshots with chunks only in the bucket (``ls`` says "remote"); leaf lock, set operations.
        self._partial: set[str] = set()
        self._partial_lock = threading.Lock()
        self.eviction = EvictionStats()
        # Called on the uploader thread whenever the queue has drained (the daemon: evict if over
        # the local limit, in a thread of its own). Must not block.
        self.on_idle: Callable[[], None] | None = None

    # -- the bucket's format -------------------------------------------------------------------

    def check_format(self) -> None:
        """Make sure this host may use the bucket: read its format object, or create it (a
        conditional PUT, then read back: of two hosts racing to create it, the one whose format is
        not there refuses). FormatMismatch if the store differs (the tier then stays off: nothing
        is uploaded, listed or fetched); OSError if the bucket cannot be reached (checked again
        before the next use). Blocking: never on the FUSE thread."""
        with self._format_lock:
            if self._format_state == "ok":
                return
            if self._format_state is not None:
                raise FormatMismatch(5, self._format_state)
            assert self.format is not None
            ours = self.format.to_json()
            data = self.bucket.get_format(MAX_FORMAT_BYTES)
            if data is None:
                if self.bucket.create_format(ours):
                    log.info("remote: %s had no format; recorded this store's (%s)", self.bucket.url, self.format)
                data = self.bucket.get_format(MAX_FORMAT_BYTES)
                if data is None:
                    raise OSError(5, f"{self.bucket.url}: the format object just written is not there")
            try:
                theirs = BucketFormat.from_json(data)
                why = self.format.mismatch(theirs)
            except FormatError as e:
                why = f"its format object is unreadable ({e})"
            if why is None:
                self.layout = theirs.layout  # the bucket's layout decides how this host writes to it
                self._format_state = "ok"
                return
            self._format_state = (
                f"remote {self.bucket.url} refused: {why}. Its snapshots would not read back as their "
                "files here; use another prefix, or a store created with the bucket's chunker and sizes"
            )
            log.error("%s", self._format_state)
            raise FormatMismatch(5, self._format_state)

    def _readable(self, rel: str, obj: IndexObject) -> bool:
        """An index object whose stream this host reads as it was written (one from before the tag
        existed is the bucket's format, checked at mount)."""
        if self.format is None or obj.stream is None or obj.stream == self.format.stream:
            return True
        self.refused_indexes += 1
        log.error("remote: %s in %s was written by a %s store; this store (%s) cannot read it: not fetched",
                  rel, self.bucket.url, obj.stream, self.format.stream)  # fmt: skip
        return False

    def _fetch_stub(self, rel: str, like: Path | None) -> FetchedStub | None:
        """The bucket's index of ``rel`` as a new stub under ``tmp/`` with the file record it
        carries (store/remoteindex.py); None if it is gone, or refused (too large, not an index,
        another stream: nothing of it kept). Blocking: network."""
        try:
            fetched = fetch_stub(self.bucket, rel, self.repo.tmp, self.max_index, self.max_file_size, like)
        except FileNotFoundError:
            return None
        except (TooLarge, idx.IndexFormatError) as e:
            self._bad_index(rel, e)
            return None
        if not self._readable(rel, fetched.obj):
            os.unlink(fetched.tmp)
            return None
        return fetched

    def _bad_index(self, rel: str, e: Exception) -> None:
        self.refused_indexes += 1
        log.error("remote: %s in %s is not a valid index here, not fetched: %s", rel, self.bucket.url, e)

    def _stream_tag(self, record: bytes | None = None) -> str:
        """The stream tag of an index: the store's, or ``plain`` for a snapshot its file record says
        is stored in file order although its bytes parse to groups (a host that reads the index
        without the record would put groups back that are not there: it refuses the tag instead)."""
        if record is not None and len(record) > 1 and record[1] == filerecord.Form.FILE_ORDER:
            return "plain"
        return self.format.stream if self.format is not None else ""

    def _fresh(self, cid: bytes) -> bool:
        with self._confirmed_lock:
            at = self._confirmed.get(cid)
        return at is not None and time.monotonic() - at < self.grace / 2

    def _confirm(self, cid: bytes, age: float) -> None:
        with self._confirmed_lock:
            if len(self._confirmed) >= _CONFIRMED_MAX:
                self._confirmed.clear()
            self._confirmed[cid] = time.monotonic() - max(0.0, age)

    def is_partial(self, rel: str) -> bool:
        with self._partial_lock:
            return rel in self._partial

    def set_partial(self, rels: Iterable[str]) -> None:
        with self._partial_lock:
            self._partial = set(rels)

    def mark_partial(self, rel: str, partial: bool = True) -> None:
        with self._partial_lock:
            if partial:
                self._partial.add(rel)
            else:
                self._partial.discard(rel)

    def renamed(self, old: str, new: str) -> None:
        """Carry the partial mark of ``old`` (a file, or a directory's subtree) to ``new``."""
        prefix = old + "/"
        with self._partial_lock:
            moved = {r for r in self._partial if r == old or r.startswith(prefix)}
            self._partial -= moved
            self._partial |= {new + r[len(old) :] for r in moved}

    def _poke(self) -> None:
        if self.on_idle is not None:
            try:
                self.on_idle()
            except Exception:  # a hook never fails an upload or a fetch
                log.exception("remote: the idle hook failed")
