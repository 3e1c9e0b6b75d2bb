"""Relaying HTTP between a client and llama-server: headers, streamed bodies, the timings they carry."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

# Not forwarded: per-connection headers, and the ones the HTTP layer recomputes.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length"})  # fmt: skip


def request_headers(request: Request, identity: bool = False) -> dict[str, str]:
    out = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
    if identity:  # the proxy reads this body (timings): ask for it unencoded
        out = {k: v for k, v in out.items() if k.lower() != "accept-encoding"}
        out["accept-encoding"] = "identity"
    return out


def response_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}


class Relay(StreamingResponse):
    """A streamed response that calls ``on_close`` however it ends: finished, failed, or never started
    because the client left (an async generator that never ran has no ``finally`` to run)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class TimingsScanner:
    """Finds llama-server's ``timings`` in an SSE stream (its last event carries them)."""

    def __init__(self) -> None:
        self._partial = b""
        self.prompt_n: int | None = None

    def feed(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if b'"timings"' in line and line.startswith(b"data:"):
                n = prompt_n(line[5:])
                if n is not None:
                    self.prompt_n = n


def prompt_n(data: bytes) -> int | None:
    n = timings_of(data).get("prompt_n")
    return n if type(n) is int else None


def prompt_ms(data: bytes) -> float:
    ms = timings_of(data).get("prompt_ms")
    return float(ms) if isinstance(ms, (int, float)) else 0.0


def timings_of(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError:
        return {}
    timings = doc.get("timings") if isinstance(doc, dict) else None
    return timings if isinstance(timings, dict) else {}
