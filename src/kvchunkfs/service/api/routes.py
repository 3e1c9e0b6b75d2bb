"""The Starlette app: routes, parameters and how errors map to status codes."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvchunkfs.service import catalog, logbuffer
from kvchunkfs.service.api.caller import caller
from kvchunkfs.service.api.encode import JSONResponse, _release_rows
from kvchunkfs.service.api.service import DEFAULT_LOG_LIMIT, PrefixQuery, Service, _b64
from kvchunkfs.service.metrics import CONTENT_TYPE
from kvchunkfs.service.openapi import INT32, LABEL_KEY_MAX, LABEL_VALUE_MAX, MAX_QUERY_TOKENS, spec

log = logging.getLogger("kvchunkfs.service.api")  # one name for the whole API in the log


MAX_BODY = 4 << 20  # request bodies (a deletion preview of 10,000 paths is ~0.5 MB)


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
    """A boolean query parameter, as OpenAPI writes one: ``true`` or ``false`` (absent: false); 400
    otherwise, an empty value too."""
    value = params.get(name, "false")
    if value not in ("true", "false"):
        raise HTTPException(400, f"query parameter {name!r} must be true or false, not {value[:40]!r}")
    return value == "true"


def _count_param(params: Mapping[str, str], name: str, default: int) -> int:
    """A count from 0 to MAX_COUNT (catalog.parse_limit), or 400."""
    raw = params.get(name)
    if raw is None:
        return default
    try:
        return catalog.parse_limit(raw, name)
    except catalog.QueryError as e:
        raise HTTPException(400, str(e)) from None


def check_snapshot_path(snapshots_dir: Path, rel: str) -> str:
    """``rel`` if it names a regular snapshot file inside the store, else HTTPException 400/404.

    No absolute paths, no ``.``/``..``/empty components, no symlink anywhere on the way (400): a
    path can only ever reach a stub under ``snapshots/``. A directory or a missing name is 404.
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
            if e.errno == errno.ENAMETOOLONG:  # a name no snapshot can have
                raise HTTPException(404, f"no snapshot {rel[:80]!r}: {e.strerror}") from None
            raise HTTPException(400, f"snapshot path {rel!r}: {e.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            raise HTTPException(400, f"snapshot path {rel!r} goes through a symlink")
        if i < len(parts) - 1 and not stat.S_ISDIR(st.st_mode):
            raise HTTPException(404, f"no snapshot {rel!r}")
    if not stat.S_ISREG(st.st_mode):  # a well-formed path that names no snapshot: 404, as a missing one
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise HTTPException(404, f"no snapshot {rel!r}: {what}")
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


def parse_prefix_query(body: Any) -> PrefixQuery:
    """A checked query, else HTTPException 400 naming what is wrong."""
    if not isinstance(body, dict):
        raise HTTPException(400, "expected a JSON object with a 'tokens' list")
    _no_unknown_fields(body, {"tokens", "prefix", "exclude_suffix", "limit"})
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > MAX_QUERY_TOKENS:
        raise HTTPException(400, f"'tokens' must be a list of at most {MAX_QUERY_TOKENS} integers")
    lo, hi = INT32
    if not all(type(t) is int and lo <= t <= hi for t in tokens):  # bool is not a token
        tokens = [_json_int(t) for t in tokens]  # 7.0 is an integer in JSON (and its schema) too
        if not all(t is not None and lo <= t <= hi for t in tokens):
            raise HTTPException(400, "'tokens' must hold 32-bit integers only")
    texts = {k: body.get(k, "") for k in ("prefix", "exclude_suffix")}
    for name, value in texts.items():
        if not isinstance(value, str):
            raise HTTPException(400, f"{name!r} must be a string")
    limit = _json_int(body.get("limit", 1))
    if limit is None or not 1 <= limit <= 1000:
        raise HTTPException(400, "'limit' must be an integer from 1 to 1000")
    return PrefixQuery(tokens, texts["prefix"], texts["exclude_suffix"], limit)


def _json_int(value: Any) -> int | None:
    """A JSON integer (``7`` or ``7.0``: JSON Schema counts both), else None (``true`` is no number)."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer():
        return int(value)
    return None


def _no_unknown_fields(body: dict[str, Any], known: set[str]) -> None:
    """400 for a field the endpoint does not know (a typo would be ignored otherwise); the spec says
    ``additionalProperties: false``."""
    unknown = sorted(set(body) - known)
    if unknown:
        raise HTTPException(400, f"unknown field(s) {', '.join(repr(k[:40]) for k in unknown[:5])}")


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
        if not isinstance(labels, dict):
            raise HTTPException(400, 'expected {"labels": {"KEY": "VALUE" or null, ...}}')
        _no_unknown_fields(body, {"labels"})
        changes = {str(k): v for k, v in labels.items()}
        for key, value in changes.items():
            if not key or "\0" in key or len(key) > LABEL_KEY_MAX or not (value is None or isinstance(value, str)):
                raise HTTPException(400, f"label {key[:40]!r}: a non-empty key and a string (or null to remove)")
            if value is not None and ("\0" in value or len(value) > LABEL_VALUE_MAX):  # xattrs share 4 KiB
                raise HTTPException(400, f"label {key[:40]!r}: value too long or has a NUL byte")
            try:
                (key + (value or "")).encode()
            except UnicodeEncodeError:  # a lone surrogate (JSON "\ud800") is no UTF-8
                raise HTTPException(400, f"label {key[:40]!r}: not valid Unicode") from None
            if len(key.encode()) > LABEL_KEY_MAX:  # the xattr name (user.kvcfs.label.KEY) must fit in 255 bytes
                raise HTTPException(400, f"label {key[:40]!r}: the key is over {LABEL_KEY_MAX} bytes of UTF-8")
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
        _no_unknown_fields(body, {"paths"})
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
        params = _params(request, frozenset({"walk", "dry_run"}))
        walk, dry_run = _flag(params, "walk"), _flag(params, "dry_run")
        how = " (dry run: nothing is deleted)" if dry_run else " (walk every stub)" if walk else ""
        log.info("API GC requested by %s%s", caller(request), how)
        return JSONResponse(await run_in_threadpool(service.run_gc, walk, dry_run))

    async def get_logs(request: Request) -> Response:
        params = _params(request, frozenset({"level", "limit"}))
        if service.logs is None:
            raise HTTPException(503, "no log buffer in this daemon")
        try:
            level = logbuffer.parse_level(params.get("level", "debug"))
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        limit = _count_param(params, "limit", DEFAULT_LOG_LIMIT)  # more than the buffer holds: all of it
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
        body: dict[str, object] = {"status": "ok", "filesystem": service.stats_source is not None}
        stats = await run_in_threadpool(service.stats)
        if stats.get("ingest_degraded"):  # saves acknowledged but not stored, and new ones refused
            body["status"] = "degraded"
        for key in ("unstored_saves", "unstored_bytes"):
            if key in stats:
                body[key] = stats[key]
        return JSONResponse(body)

    by_method = {"GET": get_snapshot, "HEAD": get_snapshot, "DELETE": delete_snapshot, "PATCH": patch_snapshot}

    async def snapshot(request: Request) -> Response:
        return await by_method[request.method](request)

    routes = [
        Route("/snapshots", list_snapshots, methods=["GET"]),
        # One route for the three methods: a 405 there names them all in Allow.
        Route("/snapshots/{path:path}", snapshot, methods=["GET", "DELETE", "PATCH"]),
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
