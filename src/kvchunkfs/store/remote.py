"""The shared tier: write-behind upload of snapshots to a bucket, read-through from it.

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
it is young again before the index naming it goes up.

**Read-through.** A lookup or listing miss consults the bucket's index listing (reused for
``remote_list_ttl`` seconds) and fetches the index into a local stub (create-if-absent: a local
file always wins). Opening a snapshot fetches the chunks the local packs lack (parallel GETs,
hashes checked) into local packs; later restores read local packs only.

**Eviction (``local_cache_size``, maint/evict.py).** The tier answers which snapshots are provably
in the bucket (``confirmed``: the stub is the version this host synced, and a fresh listing shows
that very index object), keeps the set of snapshots whose chunks are not all local (``partial``:
evicted, or fetched from another host and not opened yet), and counts evictions for ``stats``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvchunkfs.format import filerecord
from kvchunkfs.format import index as idx
from kvchunkfs.store import remotepacks as rp
from kvchunkfs.store import stubs
from kvchunkfs.store.bucketformat import MAX_FORMAT_BYTES, BucketFormat, FormatError, FormatMismatch
from kvchunkfs.store.packs import ChunkCorrupt, ChunkMissing, PackStore
from kvchunkfs.store.s3 import Bucket, ChunkHead, IndexObject, NotItsName, ObjectInfo, TooLarge, content_etag

log = logging.getLogger(__name__)

DB_NAME = "remote.db"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS synced (
    rel TEXT PRIMARY KEY, sha BLOB NOT NULL, etag TEXT NOT NULL, ctime_ns INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- packed layout: what this host learned from the bucket's pack indexes (a cache: the bucket is the truth)
CREATE TABLE IF NOT EXISTS rchunk (cid BLOB PRIMARY KEY, pack BLOB NOT NULL, off INTEGER NOT NULL,
    len INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS rpack (pack BLOB PRIMARY KEY, seen REAL NOT NULL);  -- host clock at its last put/touch
CREATE TABLE IF NOT EXISTS ridx (name TEXT PRIMARY KEY);  -- pack indexes read
"""
_SQL_BATCH = 500
_FETCH_BATCH = 8 << 20  # fetched bytes stored per pack append
_MAX_BACKOFF = 5.0  # seconds between retries of a failing upload
_FIRST_LIST_WAIT = 2.0  # seconds a lookup waits for the daemon's first listing of the bucket
_CONFIRMED_MAX = 1 << 20  # chunk ids remembered as recently confirmed in the bucket
_PACKIDX_SKEW_US = 3600 * 10**6  # pack indexes are listed from this long before the newest one read
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
class Synced:
    sha: bytes
    etag: str
    ctime_ns: int


@dataclass
class Fetched:
    """A newer version of a local snapshot, fetched from the bucket, waiting for its rename."""

    rel: str
    tmp: Path
    synced: Synced
    local_ctime_ns: int  # of the stub it replaces: changed meanwhile means a local change won

    def current(self, path: Path) -> bool:
        try:
            return os.lstat(path).st_ctime_ns == self.local_ctime_ns
        except OSError:
            return False

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


class SyncDb:
    """``remote.db``; one connection, used by the tier's threads only (never the FUSE thread)."""

    def __init__(self, path: Path, url: str) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        with contextlib.suppress(OSError):
            os.chmod(path, 0o600)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(_SCHEMA)
        row = self.db.execute("SELECT value FROM meta WHERE key = 'remote'").fetchone()
        if row is None or row[0] != url:  # another bucket: what this host synced is not in it
            for table in ("synced", "rchunk", "rpack", "ridx"):
                self.db.execute(f"DELETE FROM {table}")
            self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('remote', ?)", (url,))
        self.lock = threading.Lock()  # held across SQL only
        # rel -> ETag of every synced path, for the FUSE thread (which never takes ``lock``)
        self._etags: dict[str, str] = dict(self.db.execute("SELECT rel, etag FROM synced").fetchall())
        self._etag_lock = threading.Lock()  # leaf lock, dict operations only

    def etag(self, rel: str) -> str | None:
        with self._etag_lock:
            return self._etags.get(rel)

    def get(self, rel: str) -> Synced | None:
        with self.lock:
            row = self.db.execute("SELECT sha, etag, ctime_ns FROM synced WHERE rel = ?", (rel,)).fetchone()
        return Synced(*row) if row else None

    def put(self, rel: str, row: Synced) -> None:
        with self.lock:
            self.db.execute(
                "INSERT OR REPLACE INTO synced (rel, sha, etag, ctime_ns) VALUES (?, ?, ?, ?)",
                (rel, row.sha, row.etag, row.ctime_ns),
            )
        with self._etag_lock:
            self._etags[rel] = row.etag

    def delete(self, rel: str) -> None:
        with self.lock:
            self.db.execute("DELETE FROM synced WHERE rel = ?", (rel,))
        with self._etag_lock:
            self._etags.pop(rel, None)

    def all(self) -> dict[str, int]:
        """rel -> ctime_ns of every synced path."""
        with self.lock:
            return dict(self.db.execute("SELECT rel, ctime_ns FROM synced").fetchall())

    def rows(self) -> dict[str, Synced]:
        with self.lock:
            return {rel: Synced(sha, etag, ct) for rel, sha, etag, ct in self.db.execute("SELECT * FROM synced")}

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # -- the packed layout's cache ---------------------------------------------------------------

    def newest_packidx(self) -> str | None:
        with self.lock:
            row = self.db.execute("SELECT max(name) FROM ridx").fetchone()
        return row[0] if row else None

    def read_packidx(self, since: str = "") -> set[str]:
        """The pack indexes read, of those named from ``since`` on (names start with their time)."""
        with self.lock:
            return {r[0] for r in self.db.execute("SELECT name FROM ridx WHERE name >= ?", (since,))}

    def learned(self, name: str, packs: list[rp.PackDesc]) -> None:
        """What one pack index says (a chunk in several packs: the last one learned wins)."""
        rows = [(cid, d.pack, loc.offset, loc.length) for d in packs for cid, loc in d.locs()]
        with self.lock, self._transaction():
            self.db.executemany("INSERT OR REPLACE INTO rchunk (cid, pack, off, len) VALUES (?, ?, ?, ?)", rows)
            self.db.executemany("INSERT OR IGNORE INTO rpack (pack, seen) VALUES (?, 0)", [(d.pack,) for d in packs])
            self.db.execute("INSERT OR IGNORE INTO ridx (name) VALUES (?)", (name,))

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One transaction (the connection autocommits: each statement would be one, with its fsync)."""
        self.db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def locate(self, cids: list[bytes]) -> dict[bytes, tuple[rp.Loc, float]]:
        """chunk id -> (where in a pack, when this host last put or touched the pack)."""
        out = {}
        with self.lock:
            for i in range(0, len(cids), _SQL_BATCH):
                part = cids[i : i + _SQL_BATCH]
                q = ("SELECT c.cid, c.pack, c.off, c.len, p.seen FROM rchunk c JOIN rpack p ON p.pack = c.pack "
                     f"WHERE c.cid IN ({','.join('?' * len(part))})")  # fmt: skip
                for cid, pack, off, n, seen in self.db.execute(q, part):
                    out[cid] = (rp.Loc(pack, off, n), seen)
        return out

    def seen(self, packs: list[bytes], at: float) -> None:
        with self.lock, self._transaction():
            self.db.executemany("INSERT OR REPLACE INTO rpack (pack, seen) VALUES (?, ?)", [(p, at) for p in packs])

    def forget_pack(self, pack: bytes) -> None:
        """The bucket no longer has it (``gc --remote``): forget what it held."""
        with self.lock, self._transaction():
            self.db.execute("DELETE FROM rchunk WHERE pack = ?", (pack,))
            self.db.execute("DELETE FROM rpack WHERE pack = ?", (pack,))


def read_synced(root: Path) -> dict[str, bytes]:
    """rel -> sha256 of the index this host last put in or fetched from the bucket (``remote.db``
    of the store at ``root``, read-only; {} without one). A stub whose content has that hash is in
    the bucket whole (index last: the bucket never holds an index naming a missing chunk), so the
    chunks of it the local packs lack are evicted or not fetched yet, not lost (recovery, fsck)."""
    path = root / DB_NAME
    if not path.exists():
        return {}
    try:
        db = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
        try:
            return dict(db.execute("SELECT rel, sha FROM synced").fetchall())
        finally:
            db.close()
    except sqlite3.Error as e:
        log.warning("cannot read %s: %s", path, e)
        return {}


@dataclass
class EvictionStats:
    """What ``local_cache_size`` did (maint/evict.py writes, ``stats`` reads: plain numbers)."""

    limit: int = 0
    local_bytes: int = 0  # pack file bytes at the end of the last eviction pass
    runs: int = 0
    evicted_chunks: int = 0
    evicted_bytes: int = 0


class RemoteTier:
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

    def _read_index(self, rel: str) -> IndexObject | None:
        """The bucket's index object of ``rel`` (None: gone, or refused unread for its size)."""
        try:
            return self.bucket.read_index(rel, self.max_index)
        except FileNotFoundError:
            return None
        except TooLarge as e:
            self._bad_index(rel, e)
            return None

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

    # -- the queue ----------------------------------------------------------------------------

    def changed(self, *rels: str) -> None:
        """Paths whose stub changed, appeared or went away (after the change). Never blocks."""
        with self._cond:
            for rel in rels:
                self._queue.pop(rel, None)
                self._queue[rel] = None  # to the end: the newest change is handled last
            self._cond.notify()

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

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not self._busy

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
        etag = self.bucket.put_index(rel, data, self._stream_tag(record))
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

    # -- the packed layout ----------------------------------------------------------------------

    def _learn(self, force: bool = False) -> None:
        """Read the pack indexes this host has not read yet: a LIST of those named from an hour
        before the newest one read (writers' clocks may differ that much), or with ``force`` (a
        restore that misses) of all; then a GET per new one. At most once per ``remote_list_ttl``
        unless ``force``."""
        with self._learn_lock:
            if not force and time.monotonic() - self._learned_at < self.list_ttl:
                return
            newest = self.db.newest_packidx()
            since = None if force or newest is None else max(0, int(newest[:16], 16) - _PACKIDX_SKEW_US)
            listed = self.bucket.list_packidx(since)
            known = self.db.read_packidx(f"{since:016x}" if since is not None else "")
            # oldest first: a chunk put again (healed) is found where the newer pack index says
            for name in sorted(listed.keys() - known):
                try:
                    self.db.learned(name, rp.decode(self.bucket.get_packidx(name, rp.MAX_PIDX_BYTES)))
                except FileNotFoundError:
                    continue  # deleted by gc --remote meanwhile: its packs are gone
                except (rp.PackIndexError, TooLarge, NotItsName) as e:
                    log.error("remote: pack index %s in %s is invalid, ignored: %s", name, self.bucket.url, e)
            self._learned_at = time.monotonic()

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

    @staticmethod
    def _by_pack(known: dict[bytes, tuple[rp.Loc, float]]) -> dict[bytes, list[bytes]]:
        out: dict[bytes, list[bytes]] = {}
        for cid, (loc, _) in known.items():
            out.setdefault(loc.pack, []).append(cid)
        return out

    def _put_packs(self, cids: list[bytes]) -> None:
        done: list[rp.PackDesc] = []
        pending: collections.deque[tuple[rp.PackDesc, Future[None]]] = collections.deque()
        packer = rp.Packer(self.pack_size)

        def send(full: tuple[rp.PackDesc, bytes] | None) -> None:
            if full is None:
                return
            desc, data = full
            pending.append((desc, self._uploads.submit(self.bucket.put_pack, desc.pack, data)))
            while len(pending) > 2:  # a few packs in memory at once
                d, f = pending.popleft()
                f.result()
                done.append(d)

        for i in range(0, len(cids), 64):
            part = cids[i : i + 64]
            for cid, data in zip(part, self.repo.store.get_many(part), strict=True):  # each checked against its id
                send(packer.add(cid, data))
        send(packer.flush())
        for d, f in pending:
            f.result()
            done.append(d)
        for group in rp.groups(done):
            name = self.bucket.put_packidx(rp.encode(group))
            self.db.learned(name, group)
            self.db.seen([g.pack for g in group], time.time())
            for g in group:
                for cid, _ in g.chunks:
                    self._confirm(cid, 0)

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

    def _fresh(self, cid: bytes) -> bool:
        with self._confirmed_lock:
            at = self._confirmed.get(cid)
        return at is not None and time.monotonic() - at < self.grace / 2

    def _confirm(self, cid: bytes, age: float) -> None:
        with self._confirmed_lock:
            if len(self._confirmed) >= _CONFIRMED_MAX:
                self._confirmed.clear()
            self._confirmed[cid] = time.monotonic() - max(0.0, age)

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

    def _local(self, cid: bytes) -> bytes:
        try:
            return bytes(self.repo.store.get_many([cid])[0])
        except ChunkMissing:
            raise ChunkMissing(f"chunk {cid.hex()} is neither in the local packs nor in the bucket") from None

    def _holds(self, cid: bytes, head: ChunkHead, data: bytes) -> bool:
        """The bucket's object is the chunk's content: its ETag is the content's MD5, or (a server
        whose ETags are not MD5s: SSE-KMS) the object fetched hashes to its id."""
        if not self._etags_are_md5 or head.etag == content_etag(data):
            return True
        try:
            good = hashlib.sha256(self.bucket.get_chunk(cid)).digest() == cid
        except FileNotFoundError:
            return False
        if good:
            self._etags_are_md5 = False  # one good object with another ETag: stop comparing them
            log.info("remote: %s gives ETags that are not MD5s; existing chunks are trusted by key", self.bucket.url)
        return good

    def _put_verified(self, cid: bytes, data: bytes) -> None:
        """Never put bytes under an id they do not hash to; the server's ETag must be their MD5."""
        if hashlib.sha256(data).digest() != cid:
            raise ChunkCorrupt(f"chunk {cid.hex()} read from the local packs fails its checksum: not uploaded")
        etag = self.bucket.put_chunk(cid, data)
        if self._etags_are_md5 and etag and etag != content_etag(data):
            raise OSError(5, f"{self.bucket.url}: chunk {cid.hex()} stored with ETag {etag}, not its content's")
        self._confirm(cid, 0)

    def _heal_one(self, cid: bytes, data: bytes, why: str) -> None:
        log.warning("remote: chunk %s in %s is bad (%s); uploading it again", cid.hex(), self.bucket.url, why)
        with self._confirmed_lock:
            self._confirmed.pop(cid, None)
        if self.layout >= 2:  # a new pack: readers learn its index, and its place replaces the bad one
            self._put_packs([cid])
        else:
            self._put_verified(cid, data)
        self.healed_chunks += 1
        with contextlib.suppress(OSError):
            self.bucket.clear_damaged(cid)

    def _heal(self) -> None:
        """Put right the chunks other hosts reported bad that this host has (at most once per
        ``remote_list_ttl``, before an upload: one LIST, almost always empty)."""
        if time.monotonic() - self._damage_checked < self.list_ttl:
            return
        self._damage_checked = time.monotonic()
        damaged = self.bucket.list_damaged()
        if not damaged:
            return
        have = self.repo.store.has(list(damaged))
        for cid in damaged:
            if cid in have:
                self._heal_one(cid, self._local(cid), "reported by a host that fetched it")

    def _report_corrupt(self, cid: bytes) -> None:
        """A fetched chunk failed its id: say so here (log, metric) and in the bucket (a host that
        has the chunk uploads it again at its next upload)."""
        self.corrupt_chunks += 1
        log.error("remote: chunk %s from %s fails its checksum; reported as damaged", cid.hex(), self.bucket.url)
        try:
            self.bucket.report_damaged(cid)
        except OSError as e:
            log.warning("remote: cannot report chunk %s as damaged: %s", cid.hex(), e)

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
        obj = self._read_index(rel)
        if obj is None or not self._readable(rel, obj):
            return False
        data, etag = obj.data, obj.etag
        try:
            index = decode_checked(data, self.max_file_size)
        except idx.IndexFormatError as e:
            self._bad_index(rel, e)
            return False
        path = self.repo.path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = stubs.prepare(self.repo.tmp, index, None, 0o644)
        ctime_ns = os.lstat(tmp).st_ctime_ns  # a link changes it: read again below
        if not self.repo.install_new(tmp, rel):
            return True  # a local file won the race
        self.mark_partial(rel)  # its chunks come at the first open
        with contextlib.suppress(OSError):
            ctime_ns = os.lstat(path).st_ctime_ns
        self.db.put(rel, Synced(hashlib.sha256(data).digest(), etag, ctime_ns))
        self.fetched_indexes += 1
        log.info("remote: fetched the index of %s", rel)
        return True

    def newer_in_bucket(self, rel: str) -> bool:
        """The bucket's listing shows another version of ``rel`` than the one this host last synced
        (another host saved it since). Never blocks: the FUSE thread asks at every lookup."""
        info = self.listing(wait=False).get(rel)
        known = self.db.etag(rel)
        return info is not None and known is not None and info.etag != known

    def prepare_refresh(self, rel: str) -> Fetched | None:
        """The bucket's version of ``rel`` as a complete stub under ``tmp/`` (blocking), if the local
        stub is still the version last synced (else local changes are pending upload: they win)."""
        row = self.db.get(rel)
        path = self.repo.path(rel)
        if row is None:
            return None
        try:
            fd = stubs.open_stub(path)
        except OSError:
            return None
        try:
            local, _ = stubs.read_stub(fd)
            ctime_ns = os.fstat(fd).st_ctime_ns
        finally:
            os.close(fd)
        if hashlib.sha256(local).digest() != row.sha:
            return None
        self.check_format()
        obj = self._read_index(rel)
        if obj is None or not self._readable(rel, obj):
            return None
        data, etag = obj.data, obj.etag
        if etag == row.etag:
            return None  # the listing was older than what we synced
        try:
            index = decode_checked(data, self.max_file_size)
        except idx.IndexFormatError as e:
            self._bad_index(rel, e)
            return None
        tmp = stubs.prepare(self.repo.tmp, index, path)  # keeps use count, labels, mode
        return Fetched(rel, tmp, Synced(hashlib.sha256(data).digest(), etag, 0), ctime_ns)

    def refreshed(self, fetched: Fetched) -> None:
        """After the caller renamed ``fetched.tmp`` into place (blocking: SQL)."""
        with contextlib.suppress(OSError):
            fetched.synced.ctime_ns = os.lstat(self.repo.path(fetched.rel)).st_ctime_ns
        self.db.put(fetched.rel, fetched.synced)
        self.mark_partial(fetched.rel)  # the new version's chunks come at the next open
        self.fetched_indexes += 1
        log.info("remote: %s replaced by the bucket's newer version", fetched.rel)

    def fetch_missing(self, ids: Iterable[bytes], owner: object, deliver: Deliver | None = None) -> int:
        """Store the chunks of ``ids`` the local packs lack, fetched from the bucket (pinned for
        ``owner``: the caller unpins once its own pins hold them). Returns the number fetched.

        ``deliver`` gets every fetched chunk as it arrives, checked against its id, on the fetch
        workers (a restore writes them into its whole file meanwhile); no call of it is running or
        to come once this returns or raises."""
        store = self.repo.store
        wanted = list(dict.fromkeys(ids))
        have = store.has(wanted)
        missing = [c for c in wanted if c not in have]
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

    def _poke(self) -> None:
        if self.on_idle is not None:
            try:
                self.on_idle()
            except Exception:  # a hook never fails an upload or a fetch
                log.exception("remote: the idle hook failed")


def _stop(pending: Iterable[Future[Any]], running: bool) -> None:
    """Cancel the requests not started; with ``running``, wait for the others too: once a fetch
    that hands chunks over returns or raises, none of its workers still does (to a file its caller
    may have dropped already)."""
    futures = list(pending)
    for f in futures:
        f.cancel()
    if running:
        wait(futures)
