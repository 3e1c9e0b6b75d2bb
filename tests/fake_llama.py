"""A small llama-server stand-in for the proxy tests: the HTTP surface the proxy uses, slot files in
llama.cpp's ``ggsq`` layout (token header, then fake KV rows) written into and read from a real mount.

Tokens are words (hashed), BOS is 1. The "KV" of position i is 64 bytes of a hash chain over the
tokens up to i, so a restore can check every row it reads against the tokens in the header, and
snapshots that share a prefix share bytes (what the store dedups). Generation is greedy: the next
token depends only on the tokens so far, so the same prompt always gives the same output, whatever
the slot held before; ``timings.prompt_n`` counts only the tokens past the slot's common prefix.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MAGIC = 0x67677371
ROW = 64  # fake KV bytes per token
F16, Q4_0 = 1, 2  # ggml type ids, as llama.cpp's state files record -ctk/-ctv
BOS = 1


def tokenize(text: str, add_special: bool) -> list[int]:
    words = [int.from_bytes(hashlib.sha256(w.encode()).digest()[:2], "little") + 2 for w in text.split()]
    return ([BOS] if add_special else []) + words


def word(token: int) -> str:
    return f"w{token}"


def rows(tokens: list[int]) -> bytes:
    out, h = [], b""
    for t in tokens:
        h = hashlib.sha256(h + struct.pack("<i", t)).digest()
        out.append(h * (ROW // 32))
    return b"".join(out)


def state_file(tokens: list[int], kv_type: int = F16) -> bytes:
    """A slot file as llama.cpp writes one (version 4, one stream, one layer): the token header, the
    cell records, then K and V of the layer (the type, with its rotation when quantized, as llama.cpp
    records them) whose rows are ``rows(tokens)``."""
    n, rot = len(tokens), 64 if kv_type != F16 else 0
    out = [struct.pack("<3I", MAGIC, 4, n), struct.pack(f"<{n}i", *tokens), struct.pack("<2I", 1, n)]
    if n:
        out += [struct.pack("<iIi", i, 1, 0) for i in range(n)]
        out += [struct.pack("<4I", 0, 1, rot, rot)]
        out += [struct.pack("<iQ", kv_type, ROW), rows(tokens)] * 2
    return b"".join(out)


def read_state(data: bytes, kv_type: int) -> list[int] | None:
    """The tokens of a slot file this server can load (its layout, rows matching tokens), else None."""
    try:
        magic, version, n = struct.unpack_from("<3I", data)
        tokens = list(struct.unpack_from(f"<{n}i", data, 12))
    except struct.error:
        return None
    if (magic, version) != (MAGIC, 4):
        return None
    if data[12 + 4 * n :] != state_file(tokens, kv_type)[12 + 4 * n :]:
        return None  # another KV type or rotation ("incompatible key rotation"), or damaged rows
    return tokens


def next_token(tokens: list[int]) -> int:
    return int.from_bytes(hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).digest()[:2], "little") + 2


def template(messages: list[dict[str, Any]]) -> str:
    return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"


@dataclass
class FakeSlot:
    id: int
    tokens: list[int] = field(default_factory=list)
    used: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class Record:
    path: str
    id_slot: int | None
    prompt_n: int
    cache_n: int


class FakeLlama:
    def __init__(self, slot_dir: Path, n_slots: int = 2, token_delay: float = 0.0, save_delay: float = 0.0,
                 api_key: str = "") -> None:  # fmt: skip
        self.slot_dir = slot_dir
        self.token_delay = token_delay
        self.save_delay = save_delay
        self.fail_restores = False
        self.save_fails = False
        self.kv_type = F16  # -ctk/-ctv
        self.fail_erases = False
        self.slots = [FakeSlot(i) for i in range(n_slots)]
        self.records: list[Record] = []
        self.actions: list[tuple[str, int, str]] = []  # (save|restore, slot, filename)
        self.probes: list[tuple[str, int, str]] = []  # the proxy's probe saves
        self.probe_records: list[Record] = []  # one-token prompts: the proxy's probes
        self.app = Starlette(routes=[
            Route("/health", lambda r: JSONResponse({"status": "ok"})),
            Route("/props", self.props),
            Route("/models", self.models), Route("/v1/models", self.models),
            Route("/slots", self.get_slots),
            Route("/slots/{id:int}", self.slot_action, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/apply-template", self.apply_template, methods=["POST"]),
            Route("/completion", self.completion, methods=["POST"]),
            Route("/v1/completions", self.completion, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ], middleware=[Middleware(KeyCheck, key=api_key)] if api_key else [])  # fmt: skip
        self.calls: list[str] = []  # every request's path, in order
        self.n_ctx = 4096  # per slot, as /props tells
        inner = self.app

        async def logged(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                self.calls.append(scope["path"])
            await inner(scope, receive, send)

        self.app = logged  # type: ignore[assignment]

    def restart(self) -> None:
        """What a restarted llama-server looks like: every slot empty."""
        self.slots = [FakeSlot(i) for i in range(len(self.slots))]

    async def props(self, request: Request) -> Response:
        return JSONResponse({"model_path": "/models/fake.gguf", "total_slots": len(self.slots),
                             "default_generation_settings": {"n_ctx": self.n_ctx}})  # fmt: skip

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "created": 0,
                                                         "owned_by": "test"}]})  # fmt: skip

    async def get_slots(self, request: Request) -> Response:
        out = []
        for s in self.slots:
            row: dict[str, Any] = {"id": s.id, "is_processing": s.lock.locked()}
            if s.used:
                row.update(id_task=1, n_prompt_tokens=len(s.tokens))
            out.append(row)
        return JSONResponse(out)

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"tokens": tokenize(body["content"], bool(body.get("add_special")))})

    async def apply_template(self, request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"prompt": template(body["messages"])})

    async def slot_action(self, request: Request) -> Response:
        slot = self.slots[request.path_params["id"]]
        action = request.query_params.get("action")
        if action == "erase":
            if self.fail_erases:
                return _err(500, "erase failing on purpose")
            async with slot.lock:
                self.actions.append(("erase", slot.id, ""))
                slot.tokens, slot.used = [], False
            return JSONResponse({"id_slot": slot.id, "n_erased": 0})
        filename = (await request.json())["filename"]
        if "/" in filename:
            return _err(400, "Invalid filename")
        async with slot.lock:
            probe = filename.startswith("kvp-probe-")  # the proxy learning the KV layout: kept apart
            (self.probes if probe else self.actions).append((action or "", slot.id, filename))
            path = self.slot_dir / filename
            if action == "save":
                await asyncio.sleep(self.save_delay)
                data = state_file(slot.tokens, self.kv_type)
                await run_in_threadpool(path.write_bytes, data[: len(data) // 2] if self.save_fails else data)
                if self.save_fails:
                    return _err(500, "Unable to save slot")
                return JSONResponse({"id_slot": slot.id, "filename": filename, "n_saved": len(slot.tokens),
                                     "n_written": len(data), "timings": {"save_ms": 1.0}})  # fmt: skip
            if action == "restore":
                if self.fail_restores:
                    slot.tokens, slot.used = [], False
                    return _err(400, "Unable to restore slot: failing on purpose")
                try:
                    data = await run_in_threadpool(path.read_bytes)
                except FileNotFoundError:
                    slot.tokens, slot.used = [], False
                    return _err(400, "Unable to restore slot: no such file")
                tokens = read_state(data, self.kv_type)
                if tokens is None:  # llama-server empties the slot when a restore fails
                    slot.tokens, slot.used = [], False
                    return _err(400, "Unable to restore slot: No available space in KV cache or invalid slot "
                                "save file")  # fmt: skip
                n = len(tokens)
                slot.tokens, slot.used = tokens, True
                return JSONResponse({"id_slot": slot.id, "filename": filename, "n_restored": n, "n_read": len(data),
                                     "timings": {"restore_ms": 1.0}})  # fmt: skip
        return _err(400, f"bad action {action!r}")

    # -- generation ------------------------------------------------------------------------------

    def _slot_for(self, body: dict[str, Any]) -> FakeSlot:
        wanted = body.get("id_slot", -1)
        if isinstance(wanted, int) and 0 <= wanted < len(self.slots):
            return self.slots[wanted]
        return min(self.slots, key=lambda s: s.lock.locked())

    async def _generate(self, path: str, body: dict[str, Any], prompt: list[int]) -> AsyncIterator[tuple[int, dict]]:
        """Yields (token, timings); the slot holds the prompt and every token generated so far."""
        slot = self._slot_for(body)
        async with slot.lock:
            common = 0
            for a, b in zip(slot.tokens, prompt, strict=False):
                if a != b:
                    break
                common += 1
            common = min(common, len(prompt) - 1)  # the last prompt token is always evaluated
            if body.get("cache_prompt") is False:  # llama-server then reuses nothing the slot holds
                common = 0
            timings = {"prompt_n": len(prompt) - common, "cache_n": common, "prompt_ms": 1.0 * (len(prompt) - common)}
            record = Record(path, body.get("id_slot"), len(prompt) - common, common)
            (self.probe_records if len(prompt) == 1 else self.records).append(record)
            slot.tokens, slot.used = list(prompt), True
            n = int(body.get("n_predict", body.get("max_tokens", 8)) or 8)
            for _ in range(n):
                token = next_token(slot.tokens)
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                slot.tokens.append(token)
                yield token, timings

    async def completion(self, request: Request) -> Response:
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = tokenize(prompt, True)
        if not isinstance(prompt, list) or not prompt:
            return _err(400, '"prompt" must be provided')
        if body.get("stream"):
            return StreamingResponse(self._stream_completion(request.url.path, body, prompt),
                                     media_type="text/event-stream")  # fmt: skip
        out, timings = [], {}
        async for token, t in self._generate(request.url.path, body, prompt):
            out.append(token)
            timings = t
        text = " ".join(map(word, out))
        if request.url.path.startswith("/v1/"):
            return JSONResponse({"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
                                 "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                                 "timings": timings})  # fmt: skip
        return JSONResponse({"content": text, "tokens": out, "timings": timings, "id_slot": body.get("id_slot")})

    async def _stream_completion(self, path: str, body: dict[str, Any], prompt: list[int]) -> AsyncIterator[bytes]:
        timings: dict = {}
        async for token, t in self._generate(path, body, prompt):
            timings = t
            yield _sse({"content": " " + word(token), "stop": False})
        yield _sse({"content": "", "stop": True, "timings": timings})

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        if not isinstance(body.get("messages"), list):
            return _err(400, "'messages' is required")
        prompt = tokenize(template(body["messages"]), True)
        if body.get("stream"):
            return StreamingResponse(self._stream_chat(body, prompt), media_type="text/event-stream")
        out, timings = [], {}
        async for token, t in self._generate("/v1/chat/completions", body, prompt):
            out.append(token)
            timings = t
        return JSONResponse({
            "id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()), "model": "fake",
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": " ".join(map(word, out))}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                      "total_tokens": len(prompt) + len(out)},
            "timings": timings,
        })  # fmt: skip

    async def _stream_chat(self, body: dict[str, Any], prompt: list[int]) -> AsyncIterator[bytes]:
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake"}
        first, timings = True, {}
        async for token, t in self._generate("/v1/chat/completions", body, prompt):
            timings = t
            delta = {"role": "assistant", "content": word(token)} if first else {"content": " " + word(token)}
            first = False
            yield _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        yield _sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "timings": timings})
        yield b"data: [DONE]\n\n"


class KeyCheck(BaseHTTPMiddleware):
    """llama-server's --api-key: every endpoint but /health wants ``Authorization: Bearer KEY``."""

    def __init__(self, app: Any, key: str) -> None:
        super().__init__(app)
        self.key = key

    async def dispatch(self, request: Request, call_next: Any) -> Response:
        if request.url.path != "/health" and request.headers.get("authorization") != f"Bearer {self.key}":
            return _err(401, "Invalid API Key")
        return await call_next(request)


def _sse(doc: dict) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _err(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": status, "message": message, "type": "invalid_request_error"}}, status)


class ServerThread:
    """An ASGI app served by uvicorn on 127.0.0.1:``port`` in a background thread."""

    def __init__(self, app: Any, port: int) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False,
                                timeout_graceful_shutdown=5)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.port = port
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
