"""What ``kv-chunk-fs proxy`` accepts from a client before any work for it: the body's size, its JSON,
its prompt's length. Each refusal is a :class:`RequestError` with the HTTP status the client gets."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

MAX_DEPTH = 64  # nesting of a request's JSON: llama-server's requests need a handful of levels


class RequestError(Exception):
    """The client's request is refused: ``status`` and a message, in llama-server's error shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def declared_too_large(request: Request, limit: int) -> RequestError | None:
    """A 413 when the Content-Length says the body is over ``limit``: refused before reading it."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        return too_large(limit)
    return None


def too_large(limit: int) -> RequestError:
    return RequestError(413, f"request body over {limit} bytes (proxy_max_body)")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as more than ``limit`` bytes came, whatever Content-Length said."""
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


def parse_payload(body: bytes) -> dict[str, Any]:
    """A generation request's JSON object; a 400 for anything else: not JSON, not UTF-8, not an object,
    nested deeper than ``MAX_DEPTH`` (the decoder's own recursion limit included)."""
    try:
        payload = json.loads(body)
    except RecursionError:
        raise RequestError(400, f"request body nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # UnicodeDecodeError is one too
        raise RequestError(400, f"request body is not JSON: {e}") from None
    if not isinstance(payload, dict):
        raise RequestError(400, f"request body is JSON but not an object: {type(payload).__name__}")
    # Brackets bound the depth from above; only a body with many (code in a prompt) is walked.
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and depth(payload) > MAX_DEPTH:
        raise RequestError(400, f"request body nested deeper than {MAX_DEPTH} levels")
    return payload


def depth(value: Any) -> int:
    """Nesting depth of lists and dicts, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, level + 1) for c in children if isinstance(c, (list, dict)))
    return deepest if isinstance(value, (list, dict)) else 0


def too_many_tokens(n: int | None, limit: int) -> RequestError:
    told = f"{n} tokens" if n is not None else f"more than {limit} tokens"
    return RequestError(400, f"the prompt has {told}, over the limit of {limit} (proxy_max_prompt_tokens, or the "
                        "upstream's context size)", "exceed_context_size_error")  # fmt: skip
