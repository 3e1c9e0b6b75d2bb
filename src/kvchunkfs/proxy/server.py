"""``kv-chunk-fs proxy``: a drop-in disk prompt cache in front of llama-server.

Clients talk to the proxy exactly as to llama-server; every request is forwarded unchanged (bodies,
status codes, SSE streams chunk by chunk). Generation requests (``/completion``, ``/v1/completions``,
``/v1/chat/completions`` and their unversioned aliases) get three extra steps:

1. **Before**: the prompt is tokenized by the upstream itself (``/apply-template`` for chat, then
   ``/tokenize``), so the tokens are exactly the ones llama-server will see. The request is routed to
   a free slot (proxy/slots.py: the one its prompt continues, else an empty one, else the least
   valuable), and the daemon's catalog is asked for the stored snapshot of the server's configuration
   sharing the longest prefix (``POST /prefix-match``; proxy/cache.py). If that beats the slot by
   ``proxy_min_restore`` tokens it is restored into the slot (``POST /slots/{id}?action=restore``); a
   refused restore is remembered and the next best tried. The request is pinned with ``id_slot``.
2. **After** the response (a stream's end, or a client that went away mid-stream): the slot is saved
   as ``NAME.<random>.tmp`` (a name of its own, so concurrent saves never rename each other's file) and
   renamed to ``NAME`` in the mount, the pattern the filesystem makes atomic. Only onto a live
   kv-chunk-fs mount: else llama-server would write full files to the disk under the mountpoint.
3. **Budget** (``cache_max_bytes``): past it, the lowest-score proxy snapshots are deleted through the
   daemon's API, then GC runs.

Names: ``kvp-<model>-<KV layout>-<hash of the first request's prompt tokens>`` (proxy/cache.py). A
request that extends the whole *prompt* of the snapshot it continues (its ``prompt_tokens`` label;
generated tokens are re-tokenized differently by the next turn, so they do not count) is the next
turn of that conversation and
replaces it under the same name. One that diverges inside that prompt (an edited message, a
regenerated turn, another conversation with the same system prompt) gets a new name, so both
branches stay. Two continuations of one turn: the first replaces it, the second diverges from the
first's prompt and gets its own name; each keeps the full shared history. When they run at once, the
name the first claimed is taken, so the second gets a new one.

Concurrency: a pool of slots; a slot is held from routing until its save is done (a background task,
so a client that disconnects cannot cancel it), and only requests routed to that slot wait for it.
The proxy's own ``/metrics`` replaces the upstream's (Prometheus text).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvchunkfs.proxy.cache import NAME_PREFIX, SnapshotCache, _digest, _why
from kvchunkfs.proxy.inputs import (
    RequestError,
    declared_too_large,
    parse_payload,
    read_body,
    too_many_tokens,
)
from kvchunkfs.proxy.metrics import ProxyMetrics
from kvchunkfs.proxy.relay import Relay, TimingsScanner, prompt_ms, prompt_n, request_headers, response_headers
from kvchunkfs.proxy.slots import Slot, SlotPool
from kvchunkfs.service.apiclient import socket_path
from kvchunkfs.service.prefixtree import common_prefix_len

log = logging.getLogger(__name__)

GENERATION = {
    "/completion": "completion",
    "/completions": "completion",
    "/v1/completions": "completion",
    "/chat/completions": "chat",
    "/v1/chat/completions": "chat",
}
DEFAULT_PROMPT_LIMIT = 1 << 20  # prompt tokens, when neither proxy_max_prompt_tokens nor the upstream says
TOKEN_JSON_BYTES = 12  # an upper bound of one token in /tokenize's answer ("151935, " is 8)
KEY_TTL = 60.0  # seconds an API key the upstream accepted is not asked about again
KEYS_KEPT = 4096
_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
# The client's Authorization header, for the proxy's own upstream calls on behalf of its request (a
# llama-server with --api-key wants it on /tokenize, /slots, ...). Tasks started by the request
# (its save) copy the context, so they carry it too.
_AUTH: contextvars.ContextVar[str] = contextvars.ContextVar("kvcfs_proxy_auth", default="")


def _error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
    """An error in llama-server's shape, so OpenAI clients show the message."""
    return JSONResponse({"error": {"code": status, "message": message, "type": kind}}, status)


@dataclass
class Plan:
    """What one generation request does with its slot."""

    name: str | None  # where the slot is saved afterwards (None: not saved)
    held: int = 0  # prompt tokens the slot holds before llama-server evaluates (after a restore)
    restored: int = 0  # of those, the ones a restore brought (the others were already in the slot)
    loaded: int = 0  # tokens the restore loaded (the snapshot's, past the prompt's too)
    refused: int = 0  # restores llama-server refused for this request
    space: str = ""  # the namespace of its names
    prepare_s: float = 0.0
    first_token_s: float | None = None
    prompt_n: int | None = None  # tokens llama-server evaluated (its timings), when it said
    no_reuse: bool = False  # the slot may hold another tenant's tokens: tell llama-server not to reuse them
    restored_from: str | None = None  # the snapshot restored into the slot
    uncached: str = ""  # why the request runs without the cache (its prompt not known)
    request: str = ""  # "POST /v1/chat/completions", for its log line


# -- the proxy ---------------------------------------------------------------------------------


class Proxy(SnapshotCache):
    """The proxy's state and its ASGI app (``app``)."""

    def __init__(
        self,
        upstream: str,
        mount: Path | None,
        store: Path | None,
        *,
        min_restore: int = 32,
        cache_max_bytes: int = 0,
        max_body: int = 16 << 20,
        max_prompt_tokens: int = 0,
        tenant: str = "none",
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.upstream_url = upstream.rstrip("/")
        self.mount = mount
        self.min_restore = min_restore
        self.cache_max_bytes = cache_max_bytes
        self.max_body = max_body
        if tenant not in ("none", "api-key") and not (tenant.startswith("header:") and len(tenant) > 7):
            raise ValueError(f"tenant must be none, api-key or header:NAME, not {tenant!r}")
        self.tenant = tenant  # none | api-key | header:NAME
        self.max_prompt_tokens = max_prompt_tokens  # 0: the upstream's context size, once known
        self.prompt_limit = max_prompt_tokens or DEFAULT_PROMPT_LIMIT
        self.open_upstream = False  # the upstream takes requests without an API key (learnt in ready())
        self._keys_ok: dict[bytes, float] = {}  # hash of an Authorization header the upstream took -> until
        self.metrics = ProxyMetrics(registry)
        # llama-server closes idle keep-alive connections after 5 s; reusing one it just closed fails the
        # request, so pooled connections expire well before that.
        limits = httpx.Limits(max_keepalive_connections=32, keepalive_expiry=1.0)
        self.http = httpx.AsyncClient(base_url=self.upstream_url, timeout=httpx.Timeout(None, connect=10.0),
                                      limits=limits)  # fmt: skip
        self.daemon: httpx.AsyncClient | None = None
        if store is not None:
            transport = httpx.AsyncHTTPTransport(uds=str(socket_path(store)))
            self.daemon = httpx.AsyncClient(transport=transport, base_url="http://kvcfs", timeout=120.0)
        self.pool: SlotPool | None = None
        self.model_tag = ""  # the model's part of every snapshot name
        self.layout: str | None = None
        self.layout_stale = False
        self.n_ctx = 0
        self.refused: dict[str, tuple[int, int]] = {}
        self.save_problem: str | None = None
        self.wrong_mount: str | None = None
        self._ready_lock = asyncio.Lock()
        self._budget_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._claimed: set[str] = set()  # names a request in flight will save under
        self.mount_ok: bool | None = None  # the mount at the last save (None: not known yet)
        self.app = self._make_app()

    # -- app ------------------------------------------------------------------------------------

    def _make_app(self) -> Starlette:
        routes = [
            Route("/metrics", self.get_metrics, methods=["GET"]),
            Route("/{path:path}", self.handle, methods=_METHODS),
        ]
        return Starlette(routes=routes, exception_handlers={Exception: self._server_error}, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        await self.close()

    async def close(self) -> None:
        if self._tasks:  # saves in flight finish before the clients go
            await asyncio.wait(set(self._tasks), timeout=60)
        await self.http.aclose()
        if self.daemon is not None:
            await self.daemon.aclose()

    async def _server_error(self, request: Request, exc: Exception) -> Response:
        log.error("proxy %s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(500, f"proxy internal error: {type(exc).__name__}: {exc}")

    async def get_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` independently of the request (a disconnect cancels the request, not this)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("proxy background task failed", exc_info=task.exception())

    async def handle(self, request: Request) -> Response:
        """Cheap checks first: the declared size, then (generation) the upstream's word on the API key,
        and only then the body is read (bounded) and parsed (bounded): a client the upstream would
        refuse costs the proxy one small request, not a copy of its prompt."""
        kind = GENERATION.get(request.url.path) if request.method == "POST" else None
        _AUTH.set(request.headers.get("authorization", ""))
        try:
            refused = declared_too_large(request, self.max_body)
            if refused is not None:
                raise refused
            if self.tenant != "none" and (request.url.path == "/slots" or request.url.path.startswith("/slots/")):
                # A client's own save/restore/list of slots would bypass the namespaces.
                raise RequestError(403, "slots are managed by the proxy alone with proxy_tenant set",
                                   "permission_error")  # fmt: skip
            if request.url.path == "/health" and request.method == "GET":
                return await self.health(request)
            if kind is not None and await self.ready():
                denied = await self.upstream_refusal(request)
                if denied is not None:
                    return denied
                return await self.generate(request, kind, parse_payload(await read_body(request, self.max_body)))
            return await self.forward(request, await read_body(request, self.max_body))
        except RequestError as e:
            log.info("proxy refused %s %s: %s", request.method, request.url.path, e)
            self.metrics.refused.labels(str(e.status)).inc()
            return _error(e.status, str(e), e.kind)
        except httpx.TransportError as e:
            self.layout_stale = True  # it may come back configured otherwise
            log.warning("upstream %s unreachable for %s %s: %s", self.upstream_url, request.method,
                        request.url.path, e)  # fmt: skip
            return _error(502, f"upstream {self.upstream_url} unreachable: {e}", "unavailable_error")

    # -- plain forwarding ---------------------------------------------------------------------

    async def forward(self, request: Request, body: bytes) -> Response:
        req = self.http.build_request(request.method, request.url.path, params=request.query_params,
                                      headers=request_headers(request), content=body)  # fmt: skip
        resp = await self.http.send(req, stream=True)
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            return Relay(resp.aiter_raw(), lambda: self.spawn(resp.aclose()), status_code=resp.status_code,
                         headers=response_headers(resp))  # fmt: skip
        try:
            data = b"".join([chunk async for chunk in resp.aiter_raw()])
        finally:
            await resp.aclose()
        return Response(data, resp.status_code, headers=response_headers(resp))

    async def health(self, request: Request) -> Response:
        """llama-server's ``/health``; while the upstream is ok but saves fail, ``degraded`` and why."""
        resp = await self.forward(request, b"")
        problem = self.health_problem()
        if resp.status_code != 200 or problem is None:
            return resp
        return JSONResponse({"status": "degraded", "reason": problem})

    async def upstream_refusal(self, request: Request) -> Response | None:
        """The upstream's 401/403 for this request's API key (asked with ``GET /props``, before the proxy
        reads the body), or None. An upstream without keys is not asked; a key it took is not asked
        about again for ``KEY_TTL`` seconds."""
        if self.open_upstream:
            return None
        auth = request.headers.get("authorization", "")
        key, now = hashlib.sha256(auth.encode("latin-1", "replace")).digest(), time.monotonic()
        if self._keys_ok.get(key, 0.0) > now:
            return None
        r = await self.http.get("/props", headers={"authorization": auth} if auth else {})
        if r.status_code in (401, 403):
            return Response(r.content, r.status_code, headers=response_headers(r))
        if len(self._keys_ok) >= KEYS_KEPT:
            self._keys_ok.clear()
        self._keys_ok[key] = now + KEY_TTL
        return None

    # -- setup ---------------------------------------------------------------------------------

    async def ready(self) -> bool:
        """Slots and model known (asked once, again after a failure); False: forward as is."""
        if self.pool is not None:
            return True
        async with self._ready_lock:
            if self.pool is None:
                try:
                    n, tag = await self._discover()
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                    log.warning("cannot learn the upstream's slots and model (requests pass through): %s", e)
                    return False
                self.pool, self.model_tag = SlotPool(n, self.min_restore, self.daemon is not None), tag
                log.info("proxy: %d slot(s) upstream, snapshots named %s%s-*, prompts up to %d tokens", n,
                         NAME_PREFIX, tag, self.prompt_limit)  # fmt: skip
        return True

    async def _discover(self) -> tuple[int, str]:
        props = await self._json("GET", "/props")
        slots = await self._json("GET", "/slots")
        n = len(slots) if isinstance(slots, list) and slots else int(props["total_slots"])
        model = str(props.get("model_path") or props.get("model_alias") or "")
        self.open_upstream = (await self.http.get("/props")).status_code == 200  # no --api-key
        settings = props.get("default_generation_settings")
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        self.n_ctx = n_ctx if type(n_ctx) is int and n_ctx > 0 else 0
        if not self.max_prompt_tokens:  # llama-server refuses a prompt longer than a slot's context anyway
            self.prompt_limit = self.n_ctx or DEFAULT_PROMPT_LIMIT
        return n, hashlib.sha256(model.encode()).hexdigest()[:8]

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        r = await self._call(method, path, **kw)
        r.raise_for_status()
        return r.json()

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """The proxy's own requests to the upstream (tokenize, slots, save, restore: all safe to repeat),
        sent again once if the connection was closed under them."""
        auth = _AUTH.get()
        if auth:
            kw["headers"] = {"authorization": auth, **kw.get("headers", {})}
        try:
            return await self.http.request(method, path, **kw)
        except httpx.RemoteProtocolError as e:
            log.debug("%s %s: %s; once more on a new connection", method, path, e)
            return await self.http.request(method, path, **kw)

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, request: Request, kind: str, payload: dict[str, Any]) -> Response:
        start = time.monotonic()
        space = self.namespace(request)
        tokens = await self.prompt_tokens(kind, payload) if space is not None else None
        assert self.pool is not None
        tenant = None if self.tenant == "none" else space or f"anonymous {secrets.token_hex(8)}"
        slot = await self.pool.acquire(tokens or [], tenant)
        what = f"{request.method} {request.url.path}"
        plan = Plan(None, request=what)
        resp: httpx.Response | None = None
        handed_off = False  # from here on the slot is released by the task finish() runs in
        try:
            plan = await self.prepare(slot, tokens, space or "", tenant)
            plan.prepare_s = time.monotonic() - start
            plan.request, plan.uncached = what, _uncached_why(space, payload) if tokens is None else ""
            payload["id_slot"] = slot.id
            if plan.no_reuse:
                payload["cache_prompt"] = False
            req = self.http.build_request("POST", request.url.path, params=request.query_params,
                                          headers=request_headers(request, identity=True),
                                          content=json.dumps(payload).encode())  # fmt: skip
            resp = await self.http.send(req, stream=True)
            headers = response_headers(resp)
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                relay = Relay(self._relay(resp, plan, start), self._finisher(slot, plan, tokens, resp),
                              status_code=resp.status_code, headers=headers)  # fmt: skip
                handed_off = True
                return relay
            data = await resp.aread()
            plan.prompt_n = prompt_n(data)
            if plan.prompt_n is not None and resp.status_code < 400:
                self._observe_ttft(plan, plan.prepare_s + prompt_ms(data) / 1000)
            handed_off = True
            self.spawn(self.finish(slot, plan, tokens, resp, ok=resp.status_code < 400))
            return Response(data, resp.status_code, headers=headers)
        finally:
            if not handed_off:
                self.spawn(self.finish(slot, plan, tokens, resp, ok=False))

    def _finisher(self, slot: Slot, plan: Plan, tokens: list[int] | None, resp: httpx.Response) -> Callable[[], None]:
        """finish() once, whenever the stream ends, fails or is abandoned."""
        called = False

        def done() -> None:
            nonlocal called
            if not called:
                called = True
                self.spawn(self.finish(slot, plan, tokens, resp, ok=resp.status_code < 400))

        return done

    async def _relay(self, resp: httpx.Response, plan: Plan, start: float) -> AsyncIterator[bytes]:
        """The upstream's SSE bytes as they come; notes the first chunk's time and the final timings."""
        scanner = TimingsScanner()
        try:
            async for chunk in resp.aiter_raw():
                if plan.first_token_s is None:
                    plan.first_token_s = time.monotonic() - start
                    if resp.status_code < 400:
                        self._observe_ttft(plan, plan.first_token_s)
                scanner.feed(chunk)
                yield chunk
        except httpx.HTTPError as e:  # the upstream went away mid-stream: end the client's stream too
            log.warning("upstream stream broke off: %s", e)
            self.metrics.errors.labels("stream").inc()
        plan.prompt_n = scanner.prompt_n

    def _observe_ttft(self, plan: Plan, seconds: float) -> None:
        self.metrics.ttft.labels("yes" if plan.restored else "no").observe(seconds)

    async def prompt_tokens(self, kind: str, payload: dict[str, Any]) -> list[int] | None:
        """The prompt as the upstream tokenizes it; None when the proxy cannot tell (multimodal,
        several prompts, a template error): then the request runs uncached."""
        if payload.get("cache_prompt") is False:  # the client asked for no prompt cache
            return None
        try:
            if kind == "chat":
                if not _text_only(payload.get("messages")):
                    return None
                templated = await self._json("POST", "/apply-template", json=payload)
                return await self._tokenize(templated["prompt"])
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return await self._tokenize(prompt)
            if isinstance(prompt, list) and len(prompt) > self.prompt_limit:
                raise too_many_tokens(len(prompt), self.prompt_limit)
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return list(prompt)
        except (httpx.HTTPStatusError, ValueError, KeyError, TypeError) as e:
            log.info("prompt not tokenized (request runs uncached): %s", e)
        return None

    async def _tokenize(self, text: str) -> list[int] | None:
        """The tokens of ``text``; over ``prompt_limit`` a 400, told from the answer's size before it is
        parsed (each token is at most ``TOKEN_JSON_BYTES`` of it)."""
        cap = self.prompt_limit * TOKEN_JSON_BYTES + 4096
        # add_special and parse_special as llama-server's completion handlers tokenize prompts.
        body = {"content": text, "add_special": True, "parse_special": True}
        auth = _AUTH.get()
        req = self.http.build_request("POST", "/tokenize", json=body, headers={"authorization": auth} if auth else {})
        resp = await self.http.send(req, stream=True)
        try:
            resp.raise_for_status()
            parts, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > cap:
                    raise too_many_tokens(None, self.prompt_limit)
                parts.append(chunk)
        finally:
            await resp.aclose()
        out = json.loads(b"".join(parts))
        tokens = [t if type(t) is int else t["id"] for t in out["tokens"]]
        if len(tokens) > self.prompt_limit:
            raise too_many_tokens(len(tokens), self.prompt_limit)
        return tokens or None

    # -- before: route, look up, restore ----------------------------------------------------------

    async def prepare(self, slot: Slot, tokens: list[int] | None, space: str = "", tenant: str | None = None) -> Plan:
        """Restore into ``slot`` if the store has more of the prompt; decide the save name. ``space``:
        the namespace of the names it restores and saves; ``tenant`` (isolation on): who the slot is
        for, whose content it must not reuse."""
        no_reuse = False
        if tenant is not None and slot.tenant != tenant:
            slot.forget()  # nothing it holds is this tenant's: no parent, no held prefix
            no_reuse = not await self._erase(slot)
        slot.tenant = tenant
        if tokens is None:
            slot.forget()  # an uncached request changes the slot in ways the proxy cannot follow
            self.metrics.requests.labels("uncached").inc()
            return Plan(None, no_reuse=no_reuse)
        await self._check_slot(slot)
        if self.layout is None or self.layout_stale:  # what the upstream can load, before any restore
            await self.probe(slot, tokens[:1])
        held = common_prefix_len(tokens, slot.tokens)
        # The next turn of the conversation the slot holds: its latest save is the slot's content, so the
        # store has no more of this prompt (steady state costs no round trip to the daemon).
        continues = slot.snapshot is not None and held >= slot.prompt_len > 0
        best = None if continues else await self.lookup(tokens, space)
        plan = Plan(None, space=space)
        for _ in range(2):  # a refused restore emptied the slot: the next best candidate, once
            if best is None:
                break
            if best.path == slot.snapshot:
                held = max(held, min(best.match, len(tokens)))  # the slot holds that very file
                break
            if min(best.match, len(tokens)) < held + self.min_restore:
                break  # not worth more than what the slot holds
            loaded = await self.restore(slot, best, tokens)
            if loaded is not None:
                held = plan.restored = min(best.match, len(tokens))
                plan.loaded, plan.restored_from = loaded, best.path
                break
            plan.refused, held = plan.refused + 1, 0
            best = await self.lookup(tokens, space)
        parent = None
        if continues:
            parent = slot.snapshot  # the next turn of the slot's conversation: replace it
        elif best is not None and best.match >= best.prompt_len > 0 and not plan.refused:
            parent = best.path
        name = parent or f"{self.name_prefix(space)}{_digest(tokens)}"
        if name in self._claimed:  # another continuation of the same turn replaces it: this one branches off
            name = f"{self.name_prefix(space)}{secrets.token_hex(8)}"
        self._claimed.add(name)  # released in finish(); nothing awaits in between, so no other request sees it free
        self.metrics.requests.labels("restored" if plan.restored else "in_slot" if held else "evaluated").inc()
        plan.name, plan.held, plan.no_reuse = name, held, no_reuse and not plan.restored
        return plan

    def namespace(self, request: Request) -> str | None:
        """The request's namespace: "" without tenant isolation; with it, a hash of the API key or of the
        configured header, or None when the request has none (then it runs uncached)."""
        if self.tenant == "none":
            return ""
        header = "authorization" if self.tenant == "api-key" else self.tenant.partition(":")[2]
        value = request.headers.get(header, "").strip()
        if not value:
            return None
        return hashlib.sha256(b"kv-chunk-fs tenant\0" + value.encode("utf-8", "surrogateescape")).hexdigest()[:12]

    async def _erase(self, slot: Slot) -> bool:
        """Empty a slot that held another tenant's tokens (llama-server would reuse their common prefix,
        and its timings would tell). False if it could not: then the request asks for no reuse."""
        try:
            r = await self._call("POST", f"/slots/{slot.id}", params={"action": "erase"})
            r.raise_for_status()
        except httpx.HTTPError as e:
            log.warning("erase of slot %d failed (the request runs without prompt reuse): %s", slot.id, _why(e))
            self.metrics.errors.labels("erase").inc()
            return False
        return True

    async def _check_slot(self, slot: Slot) -> None:
        """Forget what the slot held if llama-server says otherwise (restarted, or used by another client)."""
        try:
            slots = await self._json("GET", "/slots")
            info = next(s for s in slots if s.get("id") == slot.id)
        except (httpx.HTTPError, ValueError, StopIteration, TypeError, AttributeError) as e:
            log.debug("GET /slots: %s", e)
            return
        n = int(info.get("n_prompt_tokens", 0)) if "id_task" in info else 0
        if n != slot.n_tokens:
            if slot.tokens:
                log.info("slot %d holds %d tokens, not the %d the proxy saw last: forgotten", slot.id, n, slot.n_tokens)
            if n < slot.n_tokens:  # emptied behind the proxy's back: perhaps a restart, perhaps reconfigured
                self.layout_stale = True
            slot.forget()
            slot.n_tokens = n

    # -- after: save, budget ------------------------------------------------------------------------

    async def finish(self, slot: Slot, plan: Plan, tokens: list[int] | None, resp: httpx.Response | None,
                     ok: bool = True) -> None:  # fmt: skip
        """Close the upstream response, save the slot, release it; then keep the budget."""
        assert self.pool is not None
        failed = "the request failed" + (f" ({resp.status_code})" if resp is not None else "")
        outcome = "not saved" if ok else f"not saved: {failed}"
        try:
            if resp is not None:
                await resp.aclose()
            if tokens is not None and ok:
                self._count_tokens(plan, len(tokens))
            if ok and plan.name is not None and tokens is not None:
                async with self.pool.changed():  # the prompt is in the slot now: its next turn waits for it
                    slot.tokens, slot.saving = list(tokens), True
                outcome = await self.save(slot, plan.name, plan.space, tokens)
            elif tokens is None:
                slot.forget()
                outcome = f"not saved: {plan.uncached or 'uncached'}"
            log.info("%s, slot %d: %s; %s", plan.request, slot.id, _prompt_report(plan, tokens), outcome)
        finally:
            if plan.name is not None:
                self._claimed.discard(plan.name)
            await self.pool.release(slot)
        if ok and plan.name is not None and self.cache_max_bytes:
            await self.keep_budget()

    def _count_tokens(self, plan: Plan, n: int) -> None:
        evaluated = plan.prompt_n if plan.prompt_n is not None else max(0, n - plan.held)
        self.metrics.count_tokens("restored", plan.restored)
        self.metrics.count_tokens("in_slot", max(0, plan.held - plan.restored))
        self.metrics.count_tokens("evaluated", evaluated)


def _uncached_why(space: str | None, payload: dict[str, Any]) -> str:
    """Why a generation request runs without the cache (its prompt tokens are not known)."""
    if space is None:
        return "no tenant key (proxy_tenant)"
    if payload.get("cache_prompt") is False:
        return "the client asked for no prompt cache"
    return "prompt not tokenized (media, several prompts, or a template error)"


def _prompt_report(plan: Plan, tokens: list[int] | None) -> str:
    """Where a request's prompt tokens came from, for its log line: restored + already in the slot +
    evaluated (llama-server's own count; it re-evaluates at least the last one)."""
    if tokens is None:
        return "uncached"
    evaluated = plan.prompt_n if plan.prompt_n is not None else max(0, len(tokens) - plan.held)
    restored = (
        f"{plan.restored} restored ({plan.loaded} loaded from {plan.restored_from})"
        if plan.restored_from
        else "0 restored"
    )
    refused = f", {plan.refused} restore(s) refused" if plan.refused else ""
    return (
        f"{len(tokens)} prompt tokens: {restored}, {max(0, plan.held - plan.restored)} already in the slot, "
        f"{evaluated} evaluated{refused}"
    )


def _text_only(messages: Any) -> bool:
    """Chat messages whose content is text (media would need the upstream's multimodal tokens)."""
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            return False
    return True


def serve(proxy: Proxy, listen: str) -> None:
    """Serve ``proxy`` on ``host:port`` in the foreground until SIGINT/SIGTERM."""
    import uvicorn

    host, _, port = listen.rpartition(":")
    config = uvicorn.Config(proxy.app, host=host.strip("[]") or "127.0.0.1", port=int(port), log_config=None,
                            access_log=False, timeout_graceful_shutdown=10)  # fmt: skip
    uvicorn.Server(config).run()
