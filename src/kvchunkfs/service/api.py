"""HTTP API of a running daemon (Starlette app, served by uvicorn in a background thread).

Endpoints (see ``docs/api.md`` and ``GET /openapi.json``): ``GET /snapshots``, ``GET|PATCH|DELETE
/snapshots/{path}``, ``POST /deletion-preview``, ``GET /stats``, ``GET /history``, ``POST /gc``,
``GET /logs``, ``GET /metrics``, ``GET /prefix-tree``, ``POST /prefix-match``, ``GET /health``,
``GET /openapi.json``.

Threads: the FUSE loop is trio on the main thread; uvicorn runs its own asyncio loop in the thread
``kvcfs-api``; handlers do blocking work in the anyio worker pool. Nothing here runs on the trio
thread, so a handler may use the mount itself: DELETE unlinks through the mountpoint, which the
FUSE thread serves, so open handles and inodes stay right.

Listeners: always the unix socket ``STORE/api.sock`` (0600; its permissions are the authentication;
the CLI uses it), plus TCP on ``api_address`` when configured, behind the bearer token ``api_token``
if one is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import logging
import math
import os
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote_to_bytes

import orjson
import trio
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse as _StarletteJSONResponse
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvchunkfs.config import Config, ConfigError
from kvchunkfs.config import api_token as configured_token
from kvchunkfs.file.files import Files
from kvchunkfs.formula import compile_formula
from kvchunkfs.service import catalog, logbuffer, prefixtree
from kvchunkfs.service.apiclient import daemon_listening, short_path, socket_path
from kvchunkfs.service.history import History
from kvchunkfs.service.live import LiveCatalog, cyclic_gc_paused, direct_reader
from kvchunkfs.service.metrics import CONTENT_TYPE, Metrics
from kvchunkfs.service.openapi import spec
from kvchunkfs.store import stubs
from kvchunkfs.store.repository import Repository

log = logging.getLogger(__name__)

DEFAULT_LOG_LIMIT = 200
MAX_BODY = 4 << 20  # request bodies (a deletion preview of 10,000 paths is ~0.5 MB)
OPEN_PATHS = frozenset({"/health"})  # answered without a token (no data in them)


class Collector(Protocol):
    """What POST /gc needs of the garbage collector (``gc.GarbageCollector``)."""

    observers: list[Callable[[Any], None]]  # told about every run (the metrics count them)

    def run(self, walk: bool = False) -> Any: ...  # a report with to_dict()


class JSONResponse(_StarletteJSONResponse):
    """JSON whose strings are all valid UTF-8: a file name that is not (reaching a report, an error or a
    log line) is shown with U+FFFD instead of failing the response. Snapshot rows carry the exact
    bytes in ``path_b64`` (``catalog.path_fields``)."""

    def render(self, content: Any) -> bytes:
        try:  # almost always: no name with bytes that are not UTF-8, and no walk of a big answer
            return _dumps(content)
        except TypeError:  # orjson.JSONEncodeError: such a name (a surrogate), an int past 64 bits, ...
            pass
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return super().render(_displayable(content))


PIECE = 1000  # list items (rows, snapshots below a tree node) encoded per orjson call


def _dumps(content: Any) -> bytes:
    """orjson, in pieces: orjson holds the GIL for a whole call (40 ms for 50,000 rows), and the
    FUSE thread needs it to answer; between pieces it gets it. A top-level object's long lists go
    ``PIECE`` items at a time; a prefix tree node below which more than ``PIECE`` snapshots lie,
    one child at a time."""
    if not isinstance(content, dict) or not all(isinstance(k, str) for k in content):
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)
    return b"{" + b",".join(orjson.dumps(k) + b":" + _dumps_value(v) for k, v in content.items()) + b"}"


def _dumps_value(value: Any, depth: int = 0) -> bytes:
    if isinstance(value, list) and len(value) > PIECE:
        pieces = (orjson.dumps(value[i : i + PIECE])[1:-1] for i in range(0, len(value), PIECE))
        return b"[" + b",".join(pieces) + b"]"
    if isinstance(value, dict) and value.get("shared_count", 0) > PIECE and depth < 100:  # a big tree node
        children = value.get("children", [])
        head = orjson.dumps({k: v for k, v in value.items() if k != "children"})
        kids = b",".join(_dumps_value(child, depth + 1) for child in children)
        return head[:-1] + b',"children":[' + kids + b"]}"
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)


def _release_rows(rows: list) -> None:
    """Drop a long answer's rows ``PIECE`` at a time: freeing 50,000 dicts at once is one C call
    holding the GIL (see ``prefixtree.release``)."""
    while rows:
        del rows[-PIECE:]


def _displayable(value: Any) -> Any:
    if isinstance(value, str):
        return catalog.display_name(value)
    if isinstance(value, dict):
        return {_displayable(k): _displayable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_displayable(v) for v in value]
    return value


# -- the service: everything the handlers use --------------------------------------------------


@dataclass
class Service:
    """The daemon's state the API reads; ``stats_source`` is set once the filesystem is up."""

    files: Files
    mountpoint: Path
    config: Config
    collector: Collector | None = None
    logs: logbuffer.LogBuffer | None = None
    stats_source: Callable[[], Mapping[str, int]] | None = None
    metrics: Metrics | None = None

    def __post_init__(self) -> None:
        self.formula = compile_formula(self.config.score)  # already validated by config.load
        repo = self.files.repo
        self.live = LiveCatalog(repo.snapshots, direct_reader(repo.store.get_many))
        repo.watchers.append(self.live.changed)
        self._tree_lock = threading.Lock()
        self._tree_cache: dict[tuple[str, str, bool], tuple[int, bytes]] = {}
        self.live.start(repo.store.stats)  # also counts the map once, for totals and metrics
        if self.metrics is None:
            self.metrics = Metrics(self.files, self.stats)
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
        out["dedup_ratio"] = round(logical / stored, 4) if stored else 1.0
        out["counters"] = self.stats()
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

    def run_gc(self, walk: bool = False) -> dict[str, Any]:
        """One collection now (``walk``: read every stub); the collector serializes it with periodic runs."""
        if self.collector is None:
            raise HTTPException(503, "garbage collection is not available in this daemon")
        return _report_dict(self.collector.run(walk))

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


# -- request helpers ---------------------------------------------------------------------------


def _params(request: Request, allowed: frozenset[str] | None = None) -> dict[str, str]:
    """Query parameters as a dict; 400 for a repeated or (with ``allowed``) unknown one."""
    out: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if name in out:
            raise HTTPException(400, f"query parameter {name!r} given more than once")
        if allowed is not None and name not in allowed:
            raise HTTPException(400, f"unknown query parameter {name!r} (known: {', '.join(sorted(allowed))})")
        out[name] = value
    return out


def _flag(params: Mapping[str, str], name: str) -> bool:
    """A yes/no query parameter: absent or 0/false/no is no, empty or 1/true/yes is yes; 400 otherwise."""
    value = params.get(name)
    if value is None or value.lower() in ("0", "false", "no"):
        return False
    if value.lower() in ("", "1", "true", "yes"):
        return True
    raise HTTPException(400, f"query parameter {name!r} must be true or false, not {value!r}")


def _int_param(params: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = params.get(name)
    if raw is None:
        return default
    # ASCII digits only (str.isdigit() takes '²', which int() refuses), and few enough for int().
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18 or not lo <= int(raw) <= hi:
        raise HTTPException(400, f"{name}={raw[:40]!r}: expected an integer from {lo} to {hi}")
    return int(raw)


def check_snapshot_path(snapshots_dir: Path, rel: str) -> str:
    """``rel`` if it names a regular snapshot file inside the store, else HTTPException 400/404.

    No absolute paths, no ``.``/``..``/empty components, no symlink anywhere on the way: a path
    can only ever reach a stub under ``snapshots/``.
    """
    if not rel:
        raise HTTPException(400, "empty snapshot path")
    if "\0" in rel:
        raise HTTPException(400, "snapshot path contains a NUL byte")
    if rel.startswith("/"):
        raise HTTPException(400, f"snapshot path {rel!r} is absolute; give it relative to the mount")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise HTTPException(400, f"snapshot path {rel!r} has an empty, '.' or '..' component")
    current = snapshots_dir
    for i, part in enumerate(parts):
        current = current / part
        try:
            st = os.lstat(current)
        except (FileNotFoundError, NotADirectoryError):
            raise HTTPException(404, f"no snapshot {rel!r}") from None
        except OSError as e:
            raise HTTPException(400, f"snapshot path {rel!r}: {e.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            raise HTTPException(400, f"snapshot path {rel!r} goes through a symlink")
        if i < len(parts) - 1 and not stat.S_ISDIR(st.st_mode):
            raise HTTPException(404, f"no snapshot {rel!r}")
    if not stat.S_ISREG(st.st_mode):
        raise HTTPException(400, f"{rel!r} is a directory, not a snapshot")
    return rel


def snapshot_path_param(request: Request) -> str:
    """The ``{path}`` of ``/snapshots/{path}`` as the file name's bytes (``os.fsdecode``d).

    Taken from the raw request path: the decoded one has already replaced bytes that are not UTF-8,
    so a name such as ``b"a\\xff"`` (``/snapshots/a%FF``) could not be named at all.
    """
    raw, prefix = request.scope.get("raw_path"), b"/snapshots/"
    if isinstance(raw, bytes) and raw.startswith(prefix):
        return os.fsdecode(unquote_to_bytes(raw[len(prefix) :]))
    return request.path_params["path"]


MAX_QUERY_TOKENS = 1 << 22  # far beyond any context window; bounds what one request can make us hold
_INT32 = (-(1 << 31), (1 << 31) - 1)


@dataclass(frozen=True)
class PrefixQuery:
    """The body of ``POST /prefix-match``."""

    tokens: list[int]
    prefix: str = ""
    exclude_suffix: str = ""
    limit: int = 1


def parse_prefix_query(body: Any) -> PrefixQuery:
    """A checked query, else HTTPException 400 naming what is wrong."""
    if not isinstance(body, dict):
        raise HTTPException(400, "expected a JSON object with a 'tokens' list")
    unknown = sorted(set(body) - {"tokens", "prefix", "exclude_suffix", "limit"})
    if unknown:
        raise HTTPException(400, f"unknown field(s) {', '.join(map(repr, unknown))}")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > MAX_QUERY_TOKENS:
        raise HTTPException(400, f"'tokens' must be a list of at most {MAX_QUERY_TOKENS} integers")
    lo, hi = _INT32
    if not all(type(t) is int and lo <= t <= hi for t in tokens):  # bool is not a token
        raise HTTPException(400, "'tokens' must hold 32-bit integers only")
    texts = {k: body.get(k, "") for k in ("prefix", "exclude_suffix")}
    for name, value in texts.items():
        if not isinstance(value, str):
            raise HTTPException(400, f"{name!r} must be a string")
    limit = body.get("limit", 1)
    if type(limit) is not int or not 1 <= limit <= 1000:
        raise HTTPException(400, "'limit' must be an integer from 1 to 1000")
    return PrefixQuery(tokens, texts["prefix"], texts["exclude_suffix"], limit)


_UNLINK_STATUS = {errno.ENOENT: 404, errno.EACCES: 403, errno.EPERM: 403, errno.EBUSY: 409, errno.EISDIR: 400}
# setxattr: a value the filesystem cannot hold is the request's fault, a full disk is 507
_XATTR_STATUS = {**_UNLINK_STATUS, errno.E2BIG: 400, errno.ERANGE: 400, errno.ENOSPC: 507, errno.ENOTSUP: 400}


def _labels_status(e: OSError, snapshots: Path) -> int:
    """ENOSPC while the disk has room is the snapshot's xattr space, full (ext4: one block for all
    of them): the labels sent do not fit, 413. A full disk stays 507."""
    if e.errno == errno.ENOSPC:
        try:
            sv = os.statvfs(snapshots)
        except OSError:
            return 507
        return 413 if sv.f_bavail * sv.f_frsize >= _DISK_ROOM else 507
    return _XATTR_STATUS.get(e.errno or 0, 500)


_DISK_ROOM = 16 << 20  # free bytes above which an ENOSPC of setxattr cannot be the disk


# -- handlers --------------------------------------------------------------------------------------


def create_app(service: Service) -> Starlette:
    """The API app over ``service``; the same app serves the unix socket and (token-wrapped) TCP."""

    async def list_snapshots(request: Request) -> Response:
        params = _params(request)
        try:
            answer = await run_in_threadpool(service.listing, params)
            response = JSONResponse(answer)
            _release_rows(answer["snapshots"])
            return response
        except catalog.QueryError as e:
            raise HTTPException(400, str(e)) from None

    async def snapshot_row(rel: str) -> Response:
        row = await run_in_threadpool(service.snapshot, rel)
        if row is None:
            raise HTTPException(404, f"no snapshot {rel!r}")
        return JSONResponse(row.to_dict())

    async def get_snapshot(request: Request) -> Response:
        _params(request, frozenset())
        rel = check_snapshot_path(service.repo.snapshots, snapshot_path_param(request))
        return await snapshot_row(rel)

    async def delete_snapshot(request: Request) -> Response:
        _params(request, frozenset())
        rel = check_snapshot_path(service.repo.snapshots, snapshot_path_param(request))
        try:
            await run_in_threadpool(service.delete, rel)
        except OSError as e:
            status = _UNLINK_STATUS.get(e.errno or 0, 500)
            log.log(logging.ERROR if status == 500 else logging.INFO, "API delete of %s by %s failed: %s", rel,
                    caller(request), e)  # fmt: skip
            raise HTTPException(status, f"cannot delete {rel!r}: {e.strerror or e}") from None
        log.info("API deleted snapshot %s (by %s)", rel, caller(request))
        return JSONResponse({"deleted": rel, **_b64(rel)})

    async def patch_snapshot(request: Request) -> Response:
        _params(request, frozenset())
        rel = check_snapshot_path(service.repo.snapshots, snapshot_path_param(request))
        body = await _json_body(request)
        labels = body.get("labels") if isinstance(body, dict) else None
        if not isinstance(labels, dict) or set(body) != {"labels"}:
            raise HTTPException(400, 'expected {"labels": {"KEY": "VALUE" or null, ...}}')
        changes = {str(k): v for k, v in labels.items()}
        for key, value in changes.items():
            if not key or "\0" in key or len(key) > 200 or not (value is None or isinstance(value, str)):
                raise HTTPException(400, f"label {key[:40]!r}: a non-empty key and a string (or null to remove)")
            if value is not None and ("\0" in value or len(value) > 1024):  # xattrs share one 4 KiB block
                raise HTTPException(400, f"label {key[:40]!r}: value too long or has a NUL byte")
            try:
                (key + (value or "")).encode()
            except UnicodeEncodeError:  # a lone surrogate (JSON "\ud800") is no UTF-8
                raise HTTPException(400, f"label {key[:40]!r}: not valid Unicode") from None
        try:
            await run_in_threadpool(service.set_labels, rel, changes)
        except OSError as e:
            status = _labels_status(e, service.repo.snapshots)
            log.log(logging.ERROR if status == 500 else logging.INFO, "API labels of %s failed: %s", rel, e)
            raise HTTPException(status, f"cannot label {rel!r}: {e.strerror or e}") from None
        log.info("API set labels of %s to %s (by %s)", rel, changes, caller(request))
        return await snapshot_row(rel)

    async def deletion_preview(request: Request) -> Response:
        _params(request, frozenset())
        body = await _json_body(request)
        paths = body.get("paths") if isinstance(body, dict) else None
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise HTTPException(400, 'expected {"paths": ["PATH", ...]}')
        return JSONResponse(await run_in_threadpool(service.deletion_preview, paths))

    async def get_history(request: Request) -> Response:
        params = _params(request, frozenset({"since"}))
        try:
            since = float(params.get("since", "0"))
        except ValueError:
            raise HTTPException(400, f"since={params['since'][:40]!r}: not a number (epoch seconds)") from None
        return JSONResponse(service.history.to_dict(since))

    async def get_stats(request: Request) -> Response:
        _params(request, frozenset())
        return JSONResponse(await run_in_threadpool(service.totals))

    async def post_gc(request: Request) -> Response:
        params = _params(request, frozenset({"walk"}))
        walk = _flag(params, "walk")
        log.info("API GC requested by %s%s", caller(request), " (walk every stub)" if walk else "")
        return JSONResponse(await run_in_threadpool(service.run_gc, walk))

    async def get_logs(request: Request) -> Response:
        params = _params(request, frozenset({"level", "limit"}))
        if service.logs is None:
            raise HTTPException(503, "no log buffer in this daemon")
        try:
            level = logbuffer.parse_level(params.get("level", "debug"))
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        limit = _int_param(params, "limit", DEFAULT_LOG_LIMIT, 0, logbuffer.DEFAULT_CAPACITY)
        lines = service.logs.lines(level, limit)
        return JSONResponse({"count": len(lines), "lines": [line.to_dict() for line in lines]})

    async def get_metrics(request: Request) -> Response:
        _params(request, frozenset())
        assert service.metrics is not None
        body = await run_in_threadpool(service.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    async def get_prefix_tree(request: Request) -> Response:
        params = _params(request, frozenset({"prefix", "format", "shared_by"}))
        fmt = params.get("format", "json")
        if fmt not in ("json", "text"):
            raise HTTPException(400, f"format={fmt!r}: use json or text")
        shared_by = _flag(params, "shared_by")
        body = await run_in_threadpool(service.prefix_tree_body, params.get("prefix", ""), fmt, shared_by)
        if fmt == "text":
            return Response(body, media_type="text/plain; charset=utf-8")
        return Response(body, media_type="application/json")

    async def post_prefix_match(request: Request) -> Response:
        _params(request, frozenset())
        try:
            body = await request.json()
        except ValueError:
            raise HTTPException(400, "the body is not JSON") from None
        query = parse_prefix_query(body)
        return JSONResponse(await run_in_threadpool(service.prefix_match, query))

    async def get_openapi(request: Request) -> Response:
        return JSONResponse(spec())

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "filesystem": service.stats_source is not None})

    routes = [
        Route("/snapshots", list_snapshots, methods=["GET"]),
        Route("/snapshots/{path:path}", get_snapshot, methods=["GET"]),
        Route("/snapshots/{path:path}", delete_snapshot, methods=["DELETE"]),
        Route("/snapshots/{path:path}", patch_snapshot, methods=["PATCH"]),
        Route("/deletion-preview", deletion_preview, methods=["POST"]),
        Route("/stats", get_stats, methods=["GET"]),
        Route("/history", get_history, methods=["GET"]),
        Route("/gc", post_gc, methods=["POST"]),
        Route("/logs", get_logs, methods=["GET"]),
        Route("/metrics", get_metrics, methods=["GET"]),
        Route("/prefix-tree", get_prefix_tree, methods=["GET"]),
        Route("/prefix-match", post_prefix_match, methods=["POST"]),
        Route("/openapi.json", get_openapi, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    handlers = {HTTPException: _http_error, Exception: _server_error}
    return Starlette(routes=routes, exception_handlers=handlers)


async def _json_body(request: Request) -> Any:
    """The request's JSON body, at most MAX_BODY bytes; 400/413 otherwise."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise HTTPException(413, f"request body over {MAX_BODY} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except ValueError as e:
        raise HTTPException(400, f"request body is not JSON: {e}") from None


def _b64(rel: str) -> dict[str, str]:
    b64 = catalog.path_fields(rel).get("path_b64")
    return {"path_b64": b64} if b64 else {}


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = exc.detail
    if exc.status_code == 404 and message == "Not Found":
        message = f"no such endpoint: {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} not allowed on {request.url.path}"
    return JSONResponse({"error": message}, exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    # A bug, not a bad request: the traceback goes to the daemon's log, the client gets one line.
    log.error("API %s %s failed", request.method, request.url.path, exc_info=exc)
    return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, 500)


class BearerAuth:
    """ASGI wrapper that requires ``Authorization: Bearer <token>`` (the TCP listener only)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            if scope.get("method") not in ("GET", "HEAD"):
                log.warning("API %s %s refused: missing or wrong token (from %s)", scope.get("method"),
                            scope["path"], caller(Request(scope)))  # fmt: skip
            response = JSONResponse(
                {"error": "missing or wrong bearer token"},
                401,
                headers={"WWW-Authenticate": 'Bearer realm="kv-chunk-fs"'},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.token)
        return False


# -- serving -------------------------------------------------------------------------------------


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def bind_tcp(address: str) -> socket.socket:
    host, port = split_address(address)
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)  # queue clients until the server thread runs
    except BaseException:
        sock.close()
        raise
    return sock


def bind_unix(path: Path, tmp_dir: Path) -> socket.socket:
    """Listen on ``path`` with mode 0600 from the first moment.

    The socket is bound inside a fresh 0700 directory under ``tmp_dir`` (same filesystem; recovery
    cleans it after a crash), chmod'ed and only then renamed into place: no window in which another
    user could connect, and no process-wide umask change.
    """
    if path.exists() or path.is_symlink():
        if daemon_listening(path):
            raise RuntimeError(f"another daemon is serving this store (it answers on {path})")
        path.unlink()  # left behind by a daemon that was killed
    private = Path(tempfile.mkdtemp(prefix="api-", dir=tmp_dir))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        tmp = private / "sock"
        with short_path(tmp) as name:
            sock.bind(name)
        os.chmod(tmp, 0o600)
        sock.listen(128)
        os.rename(tmp, path)
    except BaseException:
        sock.close()
        raise
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return sock


CALLER_HEADER = "x-kvcfs-caller"  # who a local front end (the dashboard) acts for
_CALLER_MAX = 200


def caller(request: Request) -> str:
    """Who sent the request, for the log: ``host:port`` over TCP, ``uid N pid N`` on the unix socket,
    plus ``for WHO`` when a process on the socket says whom it acts for (only the daemon's own user can
    connect there, so the dashboard's word is taken; a TCP client's is not)."""
    client = request.client
    if client is None:
        return "unknown"
    if client.port != 0:
        return f"{client.host}:{client.port}"
    behalf = request.headers.get(CALLER_HEADER, "")
    behalf = "".join(c if c.isprintable() else "?" for c in behalf[:_CALLER_MAX])
    return f"{client.host} for {behalf}" if behalf else client.host


class _PeerProtocol(H11Protocol):
    """uvicorn's h11 protocol that names a unix-socket client by its credentials (SO_PEERCRED)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if self.client is None and sock is not None and sock.family == socket.AF_UNIX:
            try:
                creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                pid, uid, _ = struct.unpack("3i", creds)
                self.client = (f"uid {uid} pid {pid} (unix socket)", 0)
            except OSError as e:  # only the log line loses its detail
                log.debug("no peer credentials: %s", e)


def _uvicorn_config(app: ASGIApp) -> uvicorn.Config:
    # log_config=None keeps our logging setup; no lifespan (the app has none); a short graceful
    # shutdown so a stuck request cannot hold up unmounting.
    return uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=3, loop="asyncio",
        http=_PeerProtocol,
    )  # fmt: skip


class ApiServer:
    """uvicorn servers for the unix socket and, optionally, TCP, in one background thread."""

    def __init__(self, app: ASGIApp, unix_path: Path, tmp_dir: Path, tcp_address: str = "", token: str = "") -> None:
        self.unix_path = unix_path
        self._listeners: list[tuple[socket.socket, ASGIApp]] = [(bind_unix(unix_path, tmp_dir), app)]
        if tcp_address:
            try:
                tcp = bind_tcp(tcp_address)
            except BaseException:
                self.close()
                raise
            self._listeners.append((tcp, BearerAuth(app, token) if token else app))
        self._servers: list[uvicorn.Server] = []
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._servers = [uvicorn.Server(_uvicorn_config(app)) for _, app in self._listeners]
        self._thread = threading.Thread(target=self._run, name="kvcfs-api", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException:  # uvicorn exits with SystemExit on startup failure
            log.exception("API server stopped")

    async def _serve(self) -> None:
        pairs = zip(self._servers, self._listeners, strict=True)
        await asyncio.gather(*(server.serve(sockets=[sock]) for server, (sock, _) in pairs))

    def stop(self, timeout: float = 5.0) -> None:
        for server in self._servers:
            server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("API server did not stop within %.0fs; leaving it behind", timeout)
            self._thread = None
        self.close()

    def close(self) -> None:
        for sock, _ in self._listeners:
            sock.close()
        self._listeners = []
        try:
            self.unix_path.unlink()
        except FileNotFoundError:
            pass


class MountApi:
    """The API of one mount: create before mounting (binds now), pass ``task`` to daemon.serve."""

    def __init__(self, cfg: Config, files: Files, mountpoint: Path, collector: Collector | None = None) -> None:
        repo = files.repo
        self.logs = logbuffer.install()
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # not "Started server process" per listener
        self.service = Service(files, mountpoint, cfg, collector=collector, logs=self.logs)
        self.service.observe_gc()
        app = create_app(self.service)
        try:
            token = tcp_token(cfg)
            self.server = ApiServer(app, socket_path(repo.root), repo.tmp, cfg.api_address, token)
        except BaseException:
            logging.getLogger().removeHandler(self.logs)
            raise
        if cfg.api_address:
            host, _ = split_address(cfg.api_address)
            if not token:
                where = "from the network" if not _is_loopback(host) else "by every local user"
                log.warning("the API on %s is open %s without a token (api_insecure_no_token)", cfg.api_address,
                            where)  # fmt: skip
            log.info("HTTP API on %s%s", cfg.api_address, " (bearer token required)" if token else "")

    async def task(self, ops: Any) -> None:
        """Background task of the FUSE loop: serve the API while the filesystem runs."""
        self.service.stats_source = ops.stats
        ops.observer = self.service.metrics
        self.server.start()
        try:
            await trio.sleep_forever()
        finally:
            ops.observer = None
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.server.stop)

    def close(self) -> None:
        self.server.stop()
        logging.getLogger().removeHandler(self.logs)


def tcp_token(cfg: Config) -> str:
    """The TCP listener's token; refuses (RuntimeError) a TCP API without one unless explicitly allowed:
    every local user can connect to 127.0.0.1, and the API deletes snapshots."""
    try:
        token = configured_token(cfg)
    except ConfigError as e:
        raise RuntimeError(str(e)) from None
    if cfg.api_address and not token and not cfg.api_insecure_no_token:
        raise RuntimeError(
            f"refusing to serve the API on {cfg.api_address} without a token: any local user could delete "
            "snapshots. Set api_token_file (or api_token), or api_insecure_no_token = true to accept that"
        )
    return token


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _xattr_or_none(path: Path, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return None
