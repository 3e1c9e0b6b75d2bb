"""Prometheus metrics of a running daemon (``GET /metrics``), in a registry of their own.

Two sources:

* events the filesystem reports through its ``observer`` hook (``on_save`` / ``on_restore``) and GC
  runs (``on_gc``): durations as histograms, sizes as counters;
* counters the store, the read path and ``Operations`` keep anyway, read at scrape time by a custom
  collector, so the hot paths pay nothing for metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvchunkfs.file.files import Files
from kvchunkfs.service import figures
from kvchunkfs.service.catalog import chunk_map_stats
from kvchunkfs.service.history import History

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Saves and restores of multi-GiB snapshots take seconds to minutes.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))
StatsFn = Callable[[], Mapping[str, int]]
CatalogFn = Callable[[], tuple[int, int, int, int] | None]


class Metrics:
    """The registry plus the observer interface the save service (``file.saves.SaveService.observer``) and
    the restore accounting (``fuse.restores.Restores.observer``) call."""

    def __init__(self, files: Files, stats: StatsFn | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.save_seconds = Histogram(
            "kvcfs_save_duration_seconds",
            "Save time: from the start of a save's close until the save is stored (its chunks and stub written)",
            buckets=DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.close_seconds = Histogram(
            "kvcfs_close_duration_seconds",
            "Close time: how long the close of a save took (what the writer waited; storing may go on after)",
            buckets=DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.restore_seconds = Histogram(
            "kvcfs_restore_duration_seconds",
            "Time of a restore: from the first open of the snapshot to the last close of the opens it made",
            buckets=DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.saved_bytes = Counter("kvcfs_saved_bytes", "Logical bytes of snapshots saved", registry=r)
        self.saved_new_bytes = Counter(
            "kvcfs_saved_new_bytes", "Bytes saves added to the store (chunks it lacked)", registry=r
        )
        self.restored_bytes = Counter(
            "kvcfs_restored_bytes", "Logical bytes of snapshots opened to restore", registry=r
        )
        self.gc_runs = Counter("kvcfs_gc_runs", "Garbage collection runs", registry=r)
        self.gc_freed = Counter("kvcfs_gc_freed_bytes", "Chunk bytes garbage collection dropped", registry=r)
        self.gc_disk_freed = Counter(
            "kvcfs_gc_disk_freed_bytes", "Pack file bytes garbage collection gave back to the disk", registry=r
        )
        self.gc_seconds = Histogram(
            "kvcfs_gc_duration_seconds", "Time of a garbage collection run", buckets=DURATION_BUCKETS, registry=r
        )
        # (snapshots, logical bytes, referenced bytes, broken snapshots): the catalog's, once the API has one
        self.catalog: CatalogFn | None = None
        r.register(StoreCollector(files, stats or dict, lambda: self.catalog() if self.catalog else None))
        self.history: History | None = None  # the dashboard's event log, fed by the same hooks

    # -- observer hooks (called from the FUSE thread: keep them cheap) ------------------------

    def on_save(self, seconds: float, size: int, new_bytes: int, closed: float | None = None) -> None:
        """A save stored ``seconds`` after its close began; the close itself took ``closed`` (the
        same if the close stored it)."""
        closed = seconds if closed is None else closed
        self.save_seconds.observe(seconds)
        self.close_seconds.observe(closed)
        self.saved_bytes.inc(size)
        self.saved_new_bytes.inc(max(0, new_bytes))
        if self.history is not None:
            self.history.on_save(seconds, size, new_bytes, closed)

    def on_restore(self, seconds: float, size: int) -> None:
        self.restore_seconds.observe(seconds)
        self.restored_bytes.inc(size)
        if self.history is not None:
            self.history.on_restore(seconds, size)

    def on_gc(self, seconds: float, report: Mapping[str, Any]) -> None:
        """A finished GC run; ``report`` is ``GCReport.to_dict()``."""
        self.gc_runs.inc()
        self.gc_seconds.observe(seconds)
        self.gc_freed.inc(max(0, int(report.get("bytes_freed", 0))))
        self.gc_disk_freed.inc(max(0, int(report.get("disk_bytes_freed", 0))))
        if self.history is not None:
            self.history.on_gc(seconds, max(0, int(report.get("bytes_freed", 0))))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


_REMOTE = (
    ("upload_queue", "gauge", "Snapshots waiting to be uploaded to the remote (or being uploaded)"),
    ("upload_bytes_pending", "gauge", "Chunk bytes of the upload in progress not yet confirmed in the bucket"),
    ("upload_errors", "counter", "Uploads to the remote that failed (each is retried)"),
    ("uploaded_indexes", "counter", "Snapshot indexes put in the bucket"),
    ("remote_chunk_puts", "counter", "Chunks put in the bucket"),
    ("remote_chunk_put_bytes", "counter", "Chunk bytes put in the bucket"),
    ("remote_chunk_gets", "counter", "Chunks fetched from the bucket"),
    ("remote_chunk_get_bytes", "counter", "Chunk bytes fetched from the bucket"),
    ("remote_index_gets", "counter", "Snapshot indexes fetched from the bucket"),
    ("remote_refused", "gauge", "1 if the bucket's recorded format differs from this store's (the tier is off)"),
    ("remote_refused_indexes", "counter", "Index objects not fetched: another stream format, too large or invalid"),
    ("remote_corrupt_chunks", "counter", "Chunks fetched from the bucket that failed their id (reported as damaged)"),
    ("remote_healed_chunks", "counter", "Bad chunk objects in the bucket this host uploaded again"),
    ("remote_fetched_chunks", "counter", "Chunks fetched from the bucket into the local packs"),
    ("remote_index_puts", "counter", "Snapshot indexes put in the bucket"),
    ("remote_pack_puts", "counter", "Packs put in the bucket (packed layout)"),
    ("remote_pack_put_bytes", "counter", "Pack bytes put in the bucket"),
    ("remote_pack_touches", "counter", "Packs given a new modification time (reused after half the grace)"),
    ("remote_packidx_puts", "counter", "Pack indexes put in the bucket"),
    ("remote_packidx_gets", "counter", "Pack indexes read from the bucket"),
    ("remote_range_gets", "counter", "Range GETs of packs (coalesced runs of chunks)"),
    ("remote_range_get_bytes", "counter", "Bytes fetched by range GETs of packs"),
    ("remote_heads", "counter", "HEAD requests (chunks, packs)"),
    ("remote_requests", "counter", "Every request to the bucket"),
    ("local_cache_size", "gauge", "local_cache_size: pack bytes above which chunks in the bucket are evicted"),
    ("local_bytes", "gauge", "Pack bytes on disk when eviction last looked (compare with local_cache_size)"),
    ("evictions", "counter", "Eviction passes run (local_cache_size)"),
    ("evicted_chunks", "counter", "Chunks evicted from the local packs (they stay in the bucket)"),
    ("evicted_bytes", "counter", "Chunk bytes evicted from the local packs"),
    ("partial_snapshots", "gauge", "Snapshots with chunks only in the bucket (fetched when opened)"),
)


_WHOLE = (
    ("staged_saves", "counter", "Saves handed to ingestion at their close (their staged file was the snapshot)"),
    ("ingest_queue", "gauge", "Closed saves not yet stored as chunks (queued or being stored)"),
    ("ingest_queue_bytes", "gauge", "Bytes of closed saves not yet stored as chunks"),
    ("ingest_waits", "counter", "Closes that waited: ingestion more than ingest_backlog or 5 s behind"),
    ("ingest_behind_ms", "gauge", "How far behind its saves ingestion is (oldest unstored save and the queue's time)"),
    ("ingest_backlog_limit", "gauge", "ingest_backlog in effect: staged bytes beyond which a close waits"),
    ("ingest_failures", "counter", "Ingestions that failed (the staged file stays the snapshot; tried again)"),
    ("ingest_degraded", "gauge", "1 while the store cannot take a staged save (no space, I/O errors, read-only)"),
    ("unstored_saves", "gauge", "Closed saves not stored yet: only in memory, a reboot would lose them"),
    ("unstored_bytes", "gauge", "Bytes of closed saves not stored yet (only in memory)"),
    ("saves_refused", "counter", "Saves refused at their open or close because the store could not keep them"),
    ("room_waits", "counter", "Opens for writing that waited for ingestion to make room for whole files"),
    ("hot_files", "gauge", "Whole copies in the hot tier"),
    ("hot_bytes", "gauge", "Bytes of whole copies in the hot tier"),
    ("hot_budget", "gauge", "hot_tier_size in effect (at most memory_tier_size)"),
    ("hot_hits", "counter", "Opens served from a whole copy kept in the hot tier"),
    ("hot_misses", "counter", "Opens of a snapshot with a checksum but no whole copy (put back from chunks)"),
    ("hot_put_backs", "counter", "Whole copies put back from the chunk store, checked against the file checksum"),
    ("hot_evictions", "counter", "Whole copies evicted, those no snapshot names first, then least recently used"),
    ("hot_superseded", "counter", "Whole copies moved first in line: their snapshot has another version or is gone"),
    ("warm_up_budget", "gauge", "Bytes the warm-up may put back at a mount that found the memory tier empty"),
    ("warm_up_warming", "gauge", "1 while the warm-up puts snapshots back into the memory tier"),
    ("warm_up_planned", "gauge", "Snapshots the warm-up chose, most recently used first, within its budget"),
    ("warm_up_files", "counter", "Snapshots the warm-up put back into the hot tier"),
    ("warm_up_bytes", "counter", "Bytes the warm-up put back into the hot tier"),
    ("warm_up_skipped", "counter", "Snapshots the warm-up chose but did not put back (a copy there already, failed)"),
    ("warm_up_pieces", "counter", "Pieces (about 1 MiB) the warm-up wrote"),
    ("warm_up_yields", "counter", "Times the warm-up waited for a client's restore or save to finish"),
    ("warm_up_stopped_short", "gauge", "1 if the warm-up stopped because memory was short"),
    ("warm_up_ms", "gauge", "Milliseconds the warm-up ran (waits for clients included)"),
    ("restores_loading", "gauge", "Clients' restores loading or being put back now (the warm-up waits for them)"),
    ("tier_size", "gauge", "memory_tier_size in effect: staged saves and hot copies together"),
    ("tier_fs_size", "gauge", "Size of the file system the memory tier is on (its own tmpfs as root)"),
    ("staged_files", "gauge", "Files in the memory tier's staged area (saves not yet stored, open rewrites)"),
    ("staged_bytes", "gauge", "Bytes in the memory tier's staged area"),
    ("memory_short", "gauge", "1 while the host or the daemon's cgroup is short of memory (the tier does not grow)"),
    ("pressure_episodes", "counter", "Times the host or the daemon's cgroup became short of memory"),
    ("pressure_evictions", "counter", "Hot copies evicted because memory was short"),
    ("pressure_evicted_bytes", "counter", "Bytes of hot copies evicted because memory was short"),
    ("saves_inline", "counter", "Saves stored at their close instead of staged, because memory was short"),
    (
        "pressure_reaction_us",
        "gauge",
        "Last episode: microseconds from finding memory short to its first eviction done",
    ),
)


class StoreCollector(Collector):
    """Reads the store's and the filesystem's own counters at scrape time."""

    def __init__(self, files: Files, stats: StatsFn, catalog: Callable[[], tuple[int, int, int, int] | None]) -> None:
        self.files = files
        self.repo = files.repo
        self.stats = stats
        self.catalog = catalog

    def describe(self) -> list[Metric]:
        return []  # names vary with what is available; skip the registry's duplicate check

    def collect(self) -> Iterator[Metric]:
        c = self.repo.store.counters
        written = c.bytes_written + c.bytes_deduped
        yield _counter("kvcfs_written_bytes", "Chunk bytes saves passed to the store", written)
        yield _counter("kvcfs_new_bytes", "Chunk bytes the store lacked and appended to a pack", c.bytes_written)
        yield _counter("kvcfs_deduped_bytes", "Chunk bytes the store already had", c.bytes_deduped)
        yield _counter("kvcfs_chunks_written", "Chunks appended to packs", c.chunks_written)
        yield _counter("kvcfs_chunks_deduped", "Chunks the store already had", c.chunks_deduped)
        succ = self.files.successors
        predicted = succ.predicted_bytes if succ is not None else 0
        yield _counter("kvcfs_predicted_bytes", "Saved bytes taken as a predicted chunk, not cut again", predicted)
        yield _counter("kvcfs_pack_reads", "Pack reads (one pread per run of chunks)", c.pack_reads)
        yield _counter("kvcfs_pack_read_bytes", "Bytes read from packs", c.pack_bytes_read)
        yield _counter("kvcfs_pack_direct_reads", "Pack reads that bypassed the page cache (O_DIRECT)", c.direct_reads)
        rs = self.files.restore.stats
        yield _counter("kvcfs_chunks_read", "Chunks read from disk", rs.chunks_read)
        yield _counter(
            "kvcfs_restores_to_memory", "Snapshots put back into a whole file in the memory tier", rs.to_memory
        )
        yield _counter("kvcfs_restores_to_disk", "Snapshots too big for the memory tier put back on the store's disk",
                       rs.to_disk)  # fmt: skip
        yield _gauge("kvcfs_restore_disk_copies", "Whole files on the store's disk that opens still hold",
                     rs.disk_copies_open)  # fmt: skip
        pool = self.files.buffers
        yield _counter("kvcfs_restore_buffers_reused", "Put-backs and saves given a buffer faulted in before",
                       pool.reused)  # fmt: skip
        checks = self.files.checks
        doc = "Saves stored in file order: their stored form parsed otherwise"
        yield _counter("kvcfs_file_order_saves", doc, checks.file_order_saves)
        doc = "File or group checksums that did not match (failed with EIO)"
        yield _counter("kvcfs_checksum_mismatches", doc, checks.mismatches)
        yield _gauge("kvcfs_restore_buffers_bytes", "Bytes of buffers kept for put-backs and saves", pool.size)
        yield from self._ops()
        yield from self._store()

    def _ops(self) -> Iterator[Metric]:
        stats = _safe(self.stats) or {}
        if "saves" in stats:
            yield _counter("kvcfs_saves", "Snapshots saved", stats["saves"])
        if "restores" in stats:
            yield _counter("kvcfs_restores", "Restores (read-only opens of a snapshot; the opens of one restore, "
                           "which its content still loaded ties together, count once)", stats["restores"])  # fmt: skip
        if "open_files" in stats:
            yield _gauge("kvcfs_open_files", "Snapshots open", stats["open_files"])
        if "fuse_passthrough" in stats:
            doc = "1 if the kernel may serve open files from backing files (FUSE passthrough), 0 if served"
            yield _gauge("kvcfs_fuse_passthrough", doc, stats["fuse_passthrough"])
        for key, kind, doc in (*_WHOLE, *_REMOTE):  # a mount's whole files; a remote (store/remote.py)
            if key in stats:
                yield (_gauge if kind == "gauge" else _counter)(f"kvcfs_{key}", doc, stats[key])

    def _store(self) -> Iterator[Metric]:
        # Never the map itself: a scrape must not wait for its lock (saves hold it) nor count its rows.
        chunk_stats = self.repo.store.cached_stats()
        if chunk_stats is None:  # not counted yet (just mounted): a read-only connection, no lock
            chunk_stats = _safe(lambda: chunk_map_stats(self.repo.root))
        if chunk_stats is not None:
            yield _gauge("kvcfs_store_chunks", "Chunks in the chunk map", chunk_stats[0])
            yield _gauge("kvcfs_store_bytes", "Chunk bytes in the chunk map", chunk_stats[1])
        totals = _safe(self.catalog)
        if totals is not None:
            snapshots, logical, _, broken = totals
            yield _gauge("kvcfs_snapshots", "Snapshots in the store", snapshots)
            doc = "Snapshots that cannot be read in full (no readable index, or marked broken by fsck --repair)"
            yield _gauge("kvcfs_snapshots_broken", doc, broken)
            yield _gauge("kvcfs_logical_bytes", "Logical bytes: the sum of the snapshots' sizes", logical)
            if chunk_stats is not None:
                doc = "Dedup ratio: logical bytes per chunk byte stored (kvcfs_logical_bytes / kvcfs_store_bytes)"
                yield _gauge("kvcfs_dedup_ratio", doc, figures.dedup_ratio(logical, chunk_stats[1]))
        packs = _safe(self.repo.store.pack_ids)
        if packs is not None:
            yield _gauge("kvcfs_packs", "Pack files", len(packs))
            size = 0
            for pack in packs:
                try:
                    size += self.repo.store.pack_path(pack).stat().st_size
                except FileNotFoundError:
                    continue  # GC removed it meanwhile
            yield _gauge("kvcfs_pack_file_bytes", "Bytes of pack files on disk (live and dead)", size)


def _safe(fn: Callable[[], Any]) -> Any:
    """A scrape must not fail because one source is briefly unavailable (e.g. during shutdown)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported, and the rest of the scrape still works
        log.debug("metrics source %s failed: %s", getattr(fn, "__name__", fn), e)
        return None
