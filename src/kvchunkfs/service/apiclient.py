"""Talk to a running daemon over its unix socket ``STORE/api.sock`` (the CLI's ``ls``, ``stats``, ...).

Standard library only, so the CLI works without an HTTP client package. The socket is root-only
(0600): its file permissions are the authentication, no token is needed on it.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

SOCKET_NAME = "api.sock"
TIMEOUT = 600.0  # a GC run on a large store can take minutes
_SUN_PATH_MAX = 100  # sockaddr_un holds 108 bytes; stay below with room to spare


class DaemonError(RuntimeError):
    """The daemon answered with an error status; ``status`` and the message it sent."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"daemon answered {status}: {message}")
        self.status = status
        self.message = message


def socket_path(store: Path) -> Path:
    return Path(store) / SOCKET_NAME


@contextlib.contextmanager
def short_path(path: Path) -> Iterator[str]:
    """A name for ``path`` that fits in a sockaddr_un.

    Long store paths go through ``/proc/self/fd/N/`` of an O_PATH descriptor of the directory, which
    the kernel resolves like the real directory without a process-wide chdir.
    """
    text = os.fspath(path)
    if len(os.fsencode(text)) < _SUN_PATH_MAX:
        yield text
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def connect_unix(path: Path, timeout: float | None = TIMEOUT) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        with short_path(path) as name:
            sock.connect(name)
    except BaseException:
        sock.close()
        raise
    return sock


def daemon_listening(path: Path) -> bool:
    """Whether a daemon accepts connections on ``path`` (False for a stale socket of a dead one)."""
    try:
        connect_unix(path, timeout=5).close()
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            return False
        raise
    return True


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = connect_unix(self.unix_path, self.timeout)


class DaemonClient:
    """JSON requests to the daemon's API on its unix socket."""

    def __init__(self, store: Path, timeout: float = TIMEOUT) -> None:
        self.path = socket_path(store)
        self.timeout = timeout

    def request(self, method: str, path: str, params: dict[str, str] | None = None) -> tuple[int, str, bytes]:
        """(status, content type, body); OSError if nothing listens on the socket."""
        url = path + ("?" + urlencode(params) if params else "")
        conn = _UnixConnection(self.path, self.timeout)
        try:
            conn.request(method, url)
            resp = conn.getresponse()
            return resp.status, resp.getheader("content-type", ""), resp.read()
        finally:
            conn.close()

    def forward(self, method: str, url: str, body: bytes = b"", content_type: str = "",
                headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:  # fmt: skip
        """Send a request as given (``url``: path and query, already encoded): the dashboard's proxy."""
        conn = _UnixConnection(self.path, self.timeout)
        headers = dict(headers or {})
        if content_type:
            headers["Content-Type"] = content_type
        try:
            conn.request(method, url, body=body or None, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheader("content-type", ""), resp.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, params: dict[str, str] | None = None) -> Any:
        status, _, body = self.request(method, path, params)
        if status >= 400:
            raise DaemonError(status, _error_message(body))
        return json.loads(body)

    def text(self, method: str, path: str, params: dict[str, str] | None = None) -> str:
        status, _, body = self.request(method, path, params)
        if status >= 400:
            raise DaemonError(status, _error_message(body))
        return body.decode("utf-8", "replace")


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace").strip()


def running_daemon(store: Path) -> DaemonClient | None:
    """A client if a daemon serves ``store`` now, else None (then read the store directly)."""
    path = socket_path(store)
    if not path.exists():
        return None
    try:
        listening = daemon_listening(path)
    except OSError:
        return None
    return DaemonClient(store) if listening else None
