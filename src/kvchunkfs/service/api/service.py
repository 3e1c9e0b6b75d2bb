"""What the API does, behind its routes: listings, stats, deletes, GC, logs, metrics, the prefix tree."""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from starlette.exceptions import HTTPException

from kvchunkfs.config import Config
from kvchunkfs.file.files import Files
from kvchunkfs.formula import compile_formula
from kvchunkfs.service import catalog, figures, logbuffer, prefixtree
from kvchunkfs.service.api.encode import JSONResponse
from kvchunkfs.service.gcpause import cyclic_gc_paused
from kvchunkfs.service.history import History
from kvchunkfs.service.live import LiveCatalog
from kvchunkfs.service.metrics import Metrics
from kvchunkfs.service.stubread import direct_reader
from kvchunkfs.store import stubs
from kvchunkfs.store.repository import Repository

log = logging.getLogger("kvchunkfs.service.api")  # one name for the whole API in the log


DEFAULT_LOG_LIMIT = 200
SCRAPE_WAIT = 2.0  # seconds a scrape waits for the catalog to apply what changed


class Collector(Protocol):
    """What POST /gc needs of the garbage collector (``gc.GarbageCollector``)."""

    observers: list[Callable[[Any], None]]  # told about every run (the metrics count them)

    def run(self, walk: bool = False) -> Any: ...  # a report with to_dict()

    def plan(self) -> Any: ...  # what a run would free, nothing deleted: a report with to_dict()


@dataclass
class Service:
    """The daemon's state the API reads; ``stats_source`` is set once the filesystem is up."""

    files: Files
    mountpoint: Path
    config: Config
    collector: Collector | None = None
    logs: logbuffer.LogBuffer | None = None
    stats_source: Callable[[], Mapping[str, int]] | None = None
    fuse_source: Callable[[], Mapping[str, str]] | None = None  # the FUSE mode and why
    metrics: Metrics | None = None

    def __post_init__(self) -> None:
        self.formula = compile_formula(self.config.score)  # already validated by config.load
        repo = self.files.repo
        self.live = LiveCatalog(repo.snapshots, direct_reader(repo.store.get_many), repo.store.ids_with_keys)
        repo.watchers.append(self.live.changed)
        self._tree_lock = threading.Lock()
        self._tree_cache: dict[tuple[str, str, bool], tuple[int, bytes]] = {}
        self.live.start(repo.store.stats)  # also counts the map once, for totals and metrics
        if self.metrics is None:
            self.metrics = Metrics(self.files, self.stats)
        self.metrics.catalog = self.catalog_totals
        self._scrape_refresh: threading.Thread | None = None
        self._scrape_lock = threading.Lock()
        self.history = History(repo.store.cached_stats)
        self.metrics.history = self.history
        self.gc_finished: float | None = None  # wall clock of the last GC run's end

    @property
    def repo(self) -> Repository:
        return self.files.repo

    def stats(self) -> dict[str, int]:
        """The filesystem's counters; {} before it is up. Plain numbers only: safe from any thread."""
        source = self.stats_source
        return dict(source()) if source is not None else {}

    def catalog_totals(self) -> tuple[int, int, int, int] | None:
        """The catalog's (snapshots, logical bytes, referenced bytes, broken) for a scrape: brought
        up to date in a thread of its own, waited for at most ``SCRAPE_WAIT`` (applying a change can
        wait for the map's lock, which a save holds), else as last applied. None before the load."""
        live = self.live
        if not live.wait(0):
            return None
        with self._scrape_lock:
            refresh = self._scrape_refresh
            if refresh is None or not refresh.is_alive():
                refresh = self._scrape_refresh = threading.Thread(target=live.current_generation, daemon=True,
                                                                  name="kvcfs-scrape-refresh")  # fmt: skip
                refresh.start()
        refresh.join(SCRAPE_WAIT)
        entries = list(live.entries.values())  # one C call: no change lands in the middle
        broken = sum(1 for e in entries if catalog.unreadable(e.info))
        return len(entries), live.logical_bytes, live.referenced_bytes, broken

    def snapshots(self) -> list[catalog.Snapshot]:
        return self.live.rows(self.formula)

    def snapshot(self, rel: str) -> catalog.Snapshot | None:
        rows = self.live.rows(self.formula, [rel])
        return rows[0] if rows else None

    def listing(self, params: Mapping[str, str]) -> dict[str, Any]:
        """Rows for ``GET /snapshots``: a page in path order straight from the catalog, else every row
        filtered and sorted; ``next`` is the ``after`` of the next page when this one is full."""
        with cyclic_gc_paused():
            return self._listing(params)

    def _listing(self, params: Mapping[str, str]) -> dict[str, Any]:
        page = catalog.page_params(params)
        if page is not None:
            after, limit, prefix, descending = page
            rows, total = self.live.page(self.formula, after, limit, prefix, descending)
        else:
            # ``total``: the rows the filters match, for paging by offset (the dashboard's table).
            filters = {k: v for k, v in params.items() if k not in ("limit", "offset")}
            matched = catalog.select(self.snapshots(), filters)
            total = len(matched)
            offset = catalog.parse_limit(params["offset"], "offset") if "offset" in params else 0
            end = offset + catalog.parse_limit(params["limit"]) if "limit" in params else total
            rows = [r.to_dict() for r in matched[offset:end]]
        out: dict[str, Any] = {"count": len(rows), "total": total, "snapshots": rows}
        if "limit" in params and rows and len(rows) == catalog.parse_limit(params["limit"]):
            out["next"] = rows[-1]["path"]  # display form: names that are not UTF-8 page by path_b64
        self._where(out, params.get("prefix", "").lstrip("/"))
        return out

    def _where(self, out: dict[str, Any], prefix: str) -> None:
        """With a remote: each row's ``where`` ("local": not in the bucket yet; "both": in the
        bucket and every chunk local; "remote": in the bucket and some chunks only there: evicted
        under ``local_cache_size`` or not fetched yet, an open fetches them), and the bucket's
        snapshots this host has no stub of (``remote_only``, paths under ``prefix``)."""
        remote = self.repo.remote
        if remote is None:
            return
        try:
            names = remote.listing()  # the cached listing; a refresh runs in the background
        except OSError as e:
            log.warning("remote listing failed: %s", e)
            return
        seen = set()
        for row in out["snapshots"]:
            seen.add(row["path"])
            rel = row["path"]
            row["where"] = "local" if rel not in names else "remote" if remote.is_partial(rel) else "both"
        out["remote_only"] = sorted(
            catalog.display_name(rel) for rel in names
            if rel.startswith(prefix) and rel not in seen and not os.path.lexists(self.repo.path(rel))
        )  # fmt: skip

    def totals(self) -> dict[str, Any]:
        n, logical, referenced, broken = self.live.totals()
        store = self.repo.store
        chunks, stored = store.stats()
        packs = [store.pack_path(p) for p in store.pack_ids()]
        out = catalog.totals([], (chunks, stored), packs).to_dict()
        out.update(snapshots=n, logical_bytes=logical, referenced_bytes=referenced, broken=broken)
        out["catalog_generation"] = self.live.generation  # moves with every row added or dropped (fsck)
        out["dedup_ratio"] = figures.dedup_ratio(logical, stored)
        out["counters"] = figures.public(self.stats())
        if self.fuse_source is not None:
            out["fuse"] = dict(self.fuse_source())
        remote = self.repo.remote
        if remote is not None:  # the bucket as last listed: its snapshots and their index bytes
            names = remote.listing()
            out["remote"] = {"url": remote.bucket.url, "snapshots": len(names),
                             "index_bytes": sum(i.size for i in names.values())}  # fmt: skip
        last = getattr(self.collector, "last", None)
        interval = getattr(self.collector, "interval", 0)
        finished = self.gc_finished
        out["gc"] = {
            "runs": getattr(self.collector, "runs", 0),
            "idle_skips": getattr(self.collector, "idle_skips", 0),
            "walks": getattr(self.collector, "walks", 0),
            "last": _report_dict(last) if last else None,
            "interval_s": interval,
            "last_finished": finished,
            "next_due": _next_due(finished, interval, time.time()),
        }
        return out

    def deletion_preview(self, paths: list[str]) -> dict[str, Any]:
        freed, chunks, missing = self.live.freed_together(paths)
        return {"snapshots": len(paths) - len(missing), "freed_bytes": freed, "freed_chunks": chunks,
                "missing": missing}  # fmt: skip

    def set_labels(self, rel: str, changes: Mapping[str, str | None]) -> None:
        """Set (or, for None, remove) labels through the mount, so FUSE reports the change."""
        target = self.mountpoint / rel
        done: list[tuple[str, bytes | None]] = []  # (label, value before): undone if a later one fails
        try:
            for key, value in changes.items():
                name = stubs.LABEL_PREFIX + key
                done.append((name, _xattr_or_none(target, name)))
                if value is None:
                    try:
                        os.removexattr(target, name, follow_symlinks=False)
                    except OSError as e:
                        if e.errno != errno.ENODATA:
                            raise
                else:
                    os.setxattr(target, name, value.encode(), follow_symlinks=False)
        except OSError:
            for name, old in reversed(done):  # all of the request or none of it
                with contextlib.suppress(OSError):
                    if old is None:
                        os.removexattr(target, name, follow_symlinks=False)
                    else:
                        os.setxattr(target, name, old, follow_symlinks=False)
            raise

    def run_gc(self, walk: bool = False, dry_run: bool = False) -> dict[str, Any]:
        """One collection now (``walk``: read every stub); the collector serializes it with periodic
        runs. ``dry_run``: what it would free, deleting nothing (always a walk)."""
        if self.collector is None:
            raise HTTPException(503, "garbage collection is not available in this daemon")
        return _report_dict(self.collector.plan() if dry_run else self.collector.run(walk))

    def observe_gc(self) -> None:
        """Count every run of the collector in the metrics, periodic and SIGUSR1 ones too."""
        collector, metrics = self.collector, self.metrics
        if collector is None or metrics is None:
            return

        def observe(report: Any) -> None:
            self.gc_finished = time.time()
            result = _report_dict(report)
            metrics.on_gc(float(result.get("duration_s", 0.0)), result)

        collector.observers.append(observe)

    def prefix_tree(self, prefix: str) -> tuple[prefixtree.Node, dict[str, str]]:
        return self.live.token_tree(prefix)

    def prefix_tree_body(self, prefix: str, fmt: str, shared_by: bool = False) -> bytes:
        """The rendered tree, kept until the catalog changes: scrapes of an idle store cost nothing."""
        gen = self.live.current_generation()
        key = (prefix, fmt, shared_by)
        with self._tree_lock:
            cached = self._tree_cache.get(key)
            if cached is not None and cached[0] == gen:
                return cached[1]
            with cyclic_gc_paused():
                body = self._render_tree(prefix, fmt, shared_by)
            if len(self._tree_cache) >= 8:
                self._tree_cache.clear()
            self._tree_cache[key] = (gen, body)
            return body

    def _render_tree(self, prefix: str, fmt: str, shared_by: bool) -> bytes:
        root, skipped = self.prefix_tree(prefix)
        if fmt == "text":
            text = prefixtree.render_text(root, skipped).encode()
            prefixtree.release(root)
            return text
        tree = prefixtree.to_json(root, shared_by)
        answer = {
            "snapshots": root.count,
            "skipped": [{"path": p, "reason": r} for p, r in sorted(skipped.items())],
            "tree": tree,
        }
        body = bytes(JSONResponse(answer).body)
        prefixtree.release(tree)
        prefixtree.release(root)
        return body

    def prefix_match(self, query: PrefixQuery) -> dict[str, Any]:
        matches = self.live.prefix_match(query.tokens, query.prefix, query.exclude_suffix, query.limit)
        rows = [{"path": catalog.display_name(m.path), **_b64(m.path), "match": m.match, "tokens": m.tokens,
                 "labels": m.labels} for m in matches]  # fmt: skip
        return {"count": len(rows), "matches": rows}

    def delete(self, rel: str) -> None:
        """Unlink through the mount so FUSE sees it (open handles keep working, inodes are dropped)."""
        os.unlink(self.mountpoint / rel)


def _next_due(finished: float | None, interval: int, now: float) -> float | None:
    """When the periodic GC fires next: every ``interval`` after the last run (a timer run skipped on
    an unchanged store restarts the timer without running, so count whole intervals forward)."""
    if finished is None or not interval:
        return None
    due = finished + interval
    if due < now:
        due += math.ceil((now - due) / interval) * interval
    return due


def _report_dict(report: Any) -> dict[str, Any]:
    return report.to_dict() if hasattr(report, "to_dict") else dict(report)


def _xattr_or_none(path: Path, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return None


@dataclass(frozen=True)
class PrefixQuery:
    """The body of ``POST /prefix-match``."""

    tokens: list[int]
    prefix: str = ""
    exclude_suffix: str = ""
    limit: int = 1


def _b64(rel: str) -> dict[str, str]:
    b64 = catalog.path_fields(rel).get("path_b64")
    return {"path_b64": b64} if b64 else {}
