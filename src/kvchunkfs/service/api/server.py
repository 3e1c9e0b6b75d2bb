"""Listeners: the unix socket (its permissions are the authentication), TCP behind the bearer token,
and the uvicorn thread that serves them; who the caller is."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any

import trio
import uvicorn
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvchunkfs.config import Config, ConfigError
from kvchunkfs.config import api_token as configured_token
from kvchunkfs.file.files import Files
from kvchunkfs.service import logbuffer
from kvchunkfs.service.api.caller import caller
from kvchunkfs.service.api.encode import JSONResponse
from kvchunkfs.service.api.routes import create_app
from kvchunkfs.service.api.service import Collector, Service
from kvchunkfs.service.apiclient import daemon_listening, short_path, socket_path

log = logging.getLogger("kvchunkfs.service.api")  # one name for the whole API in the log


OPEN_PATHS = frozenset({"/health"})  # answered without a token (no data in them)


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

    def __init__(self, cfg: Config, files: Files, mountpoint: Path, collector: Collector | None = None,
                 logs: logbuffer.LogBuffer | None = None) -> None:  # fmt: skip
        """``logs``: a buffer installed before (the mount's recovery lines in it); else one is now."""
        repo = files.repo
        self.logs = logs if logs is not None else logbuffer.install()
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
        self.service.fuse_source = ops.fuse_mode
        ops.save_service.observer = ops.restores.observer = self.service.metrics  # saves, restores
        self.server.start()
        try:
            await trio.sleep_forever()
        finally:
            ops.save_service.observer = ops.restores.observer = None
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
