"""The operator dashboard (``kv-chunk-fs ui``): static pages plus a proxy to the daemon's unix socket.

A process of its own, not part of the daemon: the browser-facing server (static files, a proxy, a
token prompt) then cannot take the mount down, runs only while someone looks, and needs no TCP API:
it reaches the daemon through ``STORE/api.sock`` (so it must run as the daemon's user).

Protection, since every local user (and every web page in a browser) can reach 127.0.0.1:

* every ``/api/`` request needs ``Authorization: Bearer TOKEN``: the configured one (``api_token_file``
  / ``api_token``, the TCP API's), else one generated at each start and printed as a URL that carries
  it (``http://127.0.0.1:8765/?token=...``, as Jupyter does). The page takes it from the URL (or asks
  for it), keeps it in sessionStorage and drops it from the address bar. No cookie, so another site
  cannot make the browser send it (no CSRF);
* the ``Host`` header must be a loopback name or the listen address: a DNS-rebinding page cannot
  reach the API under its own name;
* requests other than GET need the header ``X-KVCFS-UI: 1``, which a cross-site form cannot send and
  a cross-site script may not without a CORS preflight this server never grants;
* a non-loopback ``--listen`` is refused without a configured token;
* the daemon's audit lines name the real caller: the dashboard sends who asked (the peer address and,
  for a local peer, its uid from ``/proc/net/tcp``) in ``X-KVCFS-Caller``, which the daemon trusts
  only on its 0600 unix socket.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvchunkfs.service.apiclient import DaemonClient

log = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "ui"
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
MAX_BODY = 4 << 20
# The daemon's endpoints the dashboard uses; anything else is 404 here (no /openapi.json et al.).
PROXIED = ("stats", "snapshots", "deletion-preview", "history", "gc", "logs", "prefix-tree", "metrics", "health")
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
     b"frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]  # fmt: skip


CALLER_HEADER = "X-KVCFS-Caller"


def new_token() -> str:
    """A token for one run of the dashboard (when none is configured)."""
    return secrets.token_urlsafe(32)


def host_name(host_header: str) -> str:
    """``[::1]:8765`` -> ``::1``, ``localhost:9000`` -> ``localhost``."""
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header


class Guard:
    """ASGI wrapper: Host check, token on /api/, the custom header on writes, security headers."""

    def __init__(self, app: ASGIApp, token: str, listen_host: str) -> None:
        if not token:
            raise ValueError("the dashboard always needs a token (dashboard.new_token() makes one)")
        self.app = app
        self.token = token.encode()
        self.hosts = LOOPBACK_NAMES | {listen_host}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            status, message = refusal
            extra = {"WWW-Authenticate": 'Bearer realm="kv-chunk-fs"'} if status == 401 else {}
            await JSONResponse({"error": message}, status, headers=extra)(scope, receive, send)
            return

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + SECURITY_HEADERS
            await send(message)

        await self.app(scope, receive, send_secured)

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        host = host_name(headers.get(b"host", b"").decode("latin-1"))
        if host not in self.hosts:
            return 421, f"this dashboard answers to {', '.join(sorted(self.hosts))}, not {host!r}"
        if not scope["path"].startswith("/api/"):
            return None
        if not self._authorized(headers.get(b"authorization", b"")):
            return 401, "missing or wrong token"
        if scope["method"] not in ("GET", "HEAD") and headers.get(b"x-kvcfs-ui") != b"1":
            return 403, "writes need the header X-KVCFS-UI: 1"
        return None

    def _authorized(self, value: bytes) -> bool:
        scheme, _, credentials = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.token)


def create_ui_app(store: Path, token: str, listen_host: str = "127.0.0.1") -> ASGIApp:
    client = DaemonClient(store)

    async def index(request: Request) -> Response:
        return FileResponse(ASSETS / "index.html", headers={"Cache-Control": "no-cache"})

    async def ui_config(request: Request) -> Response:
        return JSONResponse({"token_required": True, "store": str(store)})

    async def proxy(request: Request) -> Response:
        raw = request.scope.get("raw_path") or request.url.path.encode()
        rest = raw[len(b"/api") :].decode("ascii", "replace")  # percent-encoded path: ASCII
        if rest.lstrip("/").split("/", 1)[0].split("?", 1)[0] not in PROXIED:
            return JSONResponse({"error": f"no such endpoint: {request.url.path}"}, 404)
        query = request.scope.get("query_string", b"").decode("ascii", "replace")
        body = await request.body()
        if len(body) > MAX_BODY:
            return JSONResponse({"error": "request body too large"}, 413)
        url = rest + (f"?{query}" if query else "")
        try:
            # Who asked, for the daemon's audit lines (writes only: the socket table is not read per poll).
            who = (
                {}
                if request.method in ("GET", "HEAD")
                else {CALLER_HEADER: await run_in_threadpool(describe_client, request.scope)}
            )
            status, ctype, data = await run_in_threadpool(
                client.forward, request.method, url, body, request.headers.get("content-type", ""), who
            )
        except OSError as e:
            message = f"the daemon does not answer on {client.path}: {e.strerror or e}. Is the store mounted?"
            return JSONResponse({"error": message}, 502)
        except ValueError as e:  # http.client refuses control characters in the URL
            return JSONResponse({"error": f"bad request: {e}"}, 400)
        return Response(data, status, media_type=ctype or "application/octet-stream")

    routes = [
        Route("/", index, methods=["GET"]),
        Route("/ui-config", ui_config, methods=["GET"]),
        Route("/api/{path:path}", proxy, methods=["GET", "POST", "DELETE", "PATCH"]),
        Mount("/static", StaticFiles(directory=ASSETS), name="static"),
    ]
    return Guard(Starlette(routes=routes), token, listen_host)


def serve(store: Path, host: str, port: int, token: str) -> None:
    """Run the dashboard in the foreground until SIGINT/SIGTERM."""
    import uvicorn

    app = create_ui_app(store, token, host)
    log.info("dashboard on %s for the store %s (token required)", base_url(host, port), store)
    uvicorn.run(app, host=host, port=port, log_config=None, access_log=False, lifespan="off")


def loopback(host: str) -> bool:
    return host in LOOPBACK_NAMES or host.startswith("127.")


def base_url(host: str, port: int) -> str:
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/"


# -- who asked ------------------------------------------------------------------------------------


def describe_client(scope: Scope) -> str:
    """``dashboard client 127.0.0.1:PORT uid N`` for the daemon's audit line (uid when the peer is a
    socket on this host, from the kernel's socket table)."""
    client, server = scope.get("client"), scope.get("server")
    if not client:
        return "dashboard client (unknown)"
    text = f"dashboard client {client[0]}:{client[1]}"
    uid = peer_uid(client[0], int(client[1]), server[0], int(server[1])) if server else None
    return text if uid is None else f"{text} uid {uid}"


def peer_uid(peer_host: str, peer_port: int, our_host: str, our_port: int) -> int | None:
    """The uid owning the local TCP socket ``peer`` connected to ``our`` address, or None (not a
    local peer, or not found). ``/proc/net/tcp{,6}`` lists every socket of this network namespace
    with its owner, the peer's side too when the peer is on this host."""
    try:
        want = (_ip(peer_host), peer_port, _ip(our_host), our_port)
    except ValueError:
        return None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 7 and _endpoint(cols[1]) + _endpoint(cols[2]) == want:
                return int(cols[7])
    return None


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    addr = ipaddress.ip_address(text)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _endpoint(hex_text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address | None, int]:
    """``0100007F:1F90`` -> (127.0.0.1, 8080); the kernel prints each 32-bit word in host order."""
    addr_hex, _, port_hex = hex_text.partition(":")
    try:
        raw = bytes.fromhex(addr_hex)
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
        return _ip(str(ipaddress.ip_address(words))), int(port_hex, 16)
    except ValueError:
        return None, -1
