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

from kvchunkfs.service.api.encode import JSONResponse
from kvchunkfs.service.api.routes import check_snapshot_path, create_app
from kvchunkfs.service.api.server import ApiServer, MountApi, split_address, tcp_token
from kvchunkfs.service.api.service import Service

__all__ = [
    "ApiServer",
    "JSONResponse",
    "MountApi",
    "Service",
    "check_snapshot_path",
    "create_app",
    "split_address",
    "tcp_token",
]
