"""Who is asking: the peer of a unix-socket request, and whom a local front end (the dashboard) acts for."""

from __future__ import annotations

from starlette.requests import Request

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
