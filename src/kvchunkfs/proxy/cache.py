"""The proxy's side of the store: which snapshot a prompt restores, saving a slot, the disk budget.

A snapshot belongs to the server configuration that wrote it: ``kvp-MODEL-LAYOUT-HASH``, where
LAYOUT names what llama-server checks when it loads a slot file (proxy/layout.py: KV types and
rotations, layer count, V transposition, streams, cell layout), also recorded as the label
``kv_layout``. A configuration change (``-ctk q4_0``, ``--flash-attn``, ``-np``) saves under other
names: it never overwrites the other configuration's snapshots, and switching back finds them. A
lookup sees only the current configuration's names; a match is restored only if its label agrees,
it fits the slot (``n_ctx``), and llama-server has not refused that very file before (until the
file changes). The layout is learnt from the server itself: a probe save of one slot when the
proxy starts or the server looks restarted, and every save it makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from kvchunkfs.proxy import layout as kvlayout
from kvchunkfs.proxy.mountcheck import NotMounted, mount_problem
from kvchunkfs.proxy.slots import Slot, SlotPool

if TYPE_CHECKING:
    from kvchunkfs.proxy.metrics import ProxyMetrics

log = logging.getLogger("kvchunkfs.proxy.server")

NAME_PREFIX = "kvp-"
TMP_SUFFIX = ".tmp"
PROMPT_LABEL = "prompt_tokens"  # user.kvcfs.label.prompt_tokens: the prompt part of a snapshot's tokens
LABEL_XATTR = "user.kvcfs.label." + PROMPT_LABEL
LAYOUT_LABEL = "kv_layout"  # what llama-server needs to load it (proxy/layout.py)
LAYOUT_XATTR = "user.kvcfs.label." + LAYOUT_LABEL
UNKNOWN_LAYOUT = "unknown"  # a state file the proxy cannot follow: one set of its own, refusals remembered
LOOKUP_LIMIT = 8  # candidates asked for: refused or too long ones are passed over
REFUSALS_KEPT = 4096


@dataclass
class Match:
    """A stored snapshot sharing ``match`` leading tokens with a prompt."""

    path: str
    match: int
    tokens: int
    prompt_len: int


class SnapshotCache:
    """Mixed into ``Proxy`` (proxy/server.py), which provides the attributes below."""

    mount: Path | None
    daemon: httpx.AsyncClient | None
    pool: SlotPool | None
    metrics: ProxyMetrics
    tenant: str
    cache_max_bytes: int
    model_tag: str  # the model's part of every name
    layout: str | None  # the upstream's KV layout (None: not known: no restore until a probe tells)
    layout_stale: bool  # the upstream may have restarted: probe again before restoring
    n_ctx: int  # tokens per slot (0: not known)
    refused: dict[str, tuple[int, int]]  # snapshot llama-server refused -> (size, mtime_ns) then
    mount_ok: bool | None
    save_problem: str | None  # why the last save failed (None: it worked): /health says degraded
    wrong_mount: str | None  # a probe save did not land in ``mount``: no saves (they would land elsewhere)
    _claimed: set[str]
    _budget_lock: asyncio.Lock

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        raise NotImplementedError

    # -- names ------------------------------------------------------------------------------------

    @property
    def tag(self) -> str:
        """``MODEL-LAYOUT``: the configuration's part of every name."""
        return f"{self.model_tag}-{kvlayout.tag(self.layout or UNKNOWN_LAYOUT)}"

    def name_prefix(self, space: str, tag: str | None = None) -> str:
        """``kvp-MODEL-LAYOUT-`` without tenant isolation, ``kvp-MODEL-LAYOUT.NAMESPACE-`` with it: none
        is a prefix of another, so a lookup in one never sees the others."""
        tag = tag or self.tag
        return f"{NAME_PREFIX}{tag}.{space}-" if space else f"{NAME_PREFIX}{tag}-"

    def owns(self, row: dict[str, Any]) -> bool:
        """A listed snapshot is this proxy's: named as it names them (its model, any configuration, its
        namespace: tenant ones with tenant isolation, the others without) and labelled with a prompt
        length. A file a user called ``kvp-something``, another model's or another namespace's
        snapshots are not."""
        labels = row.get("labels")
        return (isinstance(labels, dict) and PROMPT_LABEL in labels and "path_b64" not in row
                and self._own_name.fullmatch(str(row.get("path", ""))) is not None)  # fmt: skip

    @property
    def _own_name(self) -> re.Pattern[str]:
        space = r"\.[0-9a-f]{12}" if self.tenant != "none" else ""
        return re.compile(re.escape(f"{NAME_PREFIX}{self.model_tag}-") + r"[0-9a-f]{8}" + space + r"-[0-9a-f]{16}")

    # -- before: look up, restore -------------------------------------------------------------------

    async def lookup(self, tokens: list[int], space: str = "") -> Match | None:
        """The stored snapshot of this model, configuration and namespace sharing the longest prefix with
        ``tokens`` that the upstream can load: its layout label agrees, it fits a slot, and the upstream
        has not refused it (as it is now) before."""
        if self.daemon is None or self.layout is None:
            return None
        body = {"tokens": tokens, "prefix": self.name_prefix(space), "exclude_suffix": TMP_SUFFIX,
                "limit": LOOKUP_LIMIT}  # fmt: skip
        try:
            r = await self._ask_daemon("POST", "/prefix-match", json=body)
            r.raise_for_status()
            matches = r.json()["matches"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            log.warning("prefix lookup in the store failed (no restore): %s", e)
            self.metrics.errors.labels("lookup").inc()
            return None
        for m in matches:
            labels = m.get("labels") or {}
            if labels.get(LAYOUT_LABEL, self.layout) != self.layout:
                continue  # named for this layout, labelled for another: not sent
            if self.n_ctx and int(m["tokens"]) > self.n_ctx:
                continue  # llama-server refuses a snapshot longer than a slot
            if m["path"] in self.refused and not await asyncio.to_thread(self._changed_since_refused, m["path"]):
                continue
            return Match(m["path"], m["match"], m["tokens"], _int(labels.get(PROMPT_LABEL), m["tokens"]))
        return None

    def _identity(self, path: str) -> tuple[int, int] | None:
        assert self.mount is not None
        try:
            st = os.stat(self.mount / path)
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    def _changed_since_refused(self, path: str) -> bool:
        """A refused snapshot is offered again once it changed (saved again); the refusal is dropped."""
        if self._identity(path) == self.refused.get(path):
            return False
        self.refused.pop(path, None)
        return True

    async def _ask_daemon(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """A request to the daemon's API, sent again once if its connection is gone (a remount makes
        a new socket; the pooled connection still points at the old one)."""
        assert self.daemon is not None
        try:
            return await self.daemon.request(method, path, **kw)
        except httpx.TransportError as e:
            log.debug("daemon %s %s: %s; once more", method, path, e)
            return await self.daemon.request(method, path, **kw)

    async def restore(self, slot: Slot, match: Match, tokens: list[int]) -> int | None:
        """Restore ``match`` into ``slot``: the tokens loaded, or None if it failed. A refusal empties
        the slot (llama-server clears a slot whose restore failed); the proxy then learns whether the
        server's configuration changed (a probe), and if not remembers the file as refused."""
        start = time.monotonic()
        identity = await asyncio.to_thread(self._identity, match.path)
        try:
            r = await self._call("POST", f"/slots/{slot.id}", params={"action": "restore"},
                                 json={"filename": match.path})  # fmt: skip
            r.raise_for_status()
            n = int(r.json()["n_restored"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            slot.forget()
            slot.n_tokens = 0
            refused = (
                isinstance(e, httpx.HTTPStatusError)
                and e.response.status_code < 500
                or (isinstance(e, httpx.HTTPStatusError) and "restore" in e.response.text)
            )
            before = self.layout
            await self.probe(slot, tokens[:1])
            if refused and self.layout == before and identity is not None:
                if len(self.refused) >= REFUSALS_KEPT:
                    self.refused.pop(next(iter(self.refused)))  # the oldest
                self.refused[match.path] = identity
                self.metrics.refused_restores.labels("refused").inc()
                what = "refused (not offered again until it changes)"
            elif refused:
                self.metrics.refused_restores.labels("configuration").inc()
                what = "refused: llama-server's configuration changed"
            else:
                self.metrics.errors.labels("restore").inc()
                what = "failed"
            log.warning("restore of %s into slot %d %s: %s", match.path, slot.id, what, _why(e))
            return None
        self.metrics.restore_s.observe(time.monotonic() - start)
        slot.tokens, slot.n_tokens = tokens[: match.match], n
        slot.snapshot, slot.prompt_len = match.path, match.prompt_len
        return n

    async def probe(self, slot: Slot, first: list[int]) -> None:
        """Learn the upstream's KV layout from a save of ``slot`` (the caller holds it). An empty slot
        gets ``first`` (a prompt's first token) evaluated first, so the file has a layout to read."""
        if self.mount is None or await asyncio.to_thread(mount_problem, self.mount) is not None:
            return
        try:
            if slot.n_tokens == 0 and first:
                r = await self._call("POST", "/completion", json={"prompt": first, "n_predict": 1, "id_slot": slot.id,
                                                                  "cache_prompt": True, "temperature": 0})  # fmt: skip
                r.raise_for_status()
                slot.forget()
            found, n = await probe_save(self._call, self.mount, slot.id)
        except (httpx.HTTPError, OSError, ValueError, KeyError, TypeError) as e:
            log.warning("probe save of slot %d failed (no restores until a save tells the KV layout): %s",
                        slot.id, _why(e))  # fmt: skip
            self.metrics.errors.labels("probe").inc()
            return
        slot.n_tokens = n
        if isinstance(found, Exception):
            if self.wrong_mount is None:
                log.error("%s; saves are skipped", found)
            self.wrong_mount = str(found)
            return
        self.wrong_mount = None
        self.layout_stale = False
        self.learn_layout(found)

    def learn_layout(self, found: str) -> bool:
        """Take ``found`` as the upstream's layout; True if it changed."""
        if found == self.layout:
            return False
        names = (
            f"kvp-MODEL-{kvlayout.tag(found)}-*"
            if not self.model_tag
            else self.name_prefix("", f"{self.model_tag}-{kvlayout.tag(found)}") + "*"
        )
        if self.layout is not None:
            log.warning("llama-server's KV layout changed (%s, was %s): snapshots are kept apart, named %s",
                        found, self.layout, names)  # fmt: skip
        else:
            log.info("llama-server's KV layout: %s (snapshots named %s)", found, names)
        self.layout = found
        return True

    # -- after: save ----------------------------------------------------------------------------------

    async def save(self, slot: Slot, name: str, space: str, tokens: list[int]) -> str:
        """Save the slot as ``name`` (a name of the current layout); what happened, for the request's log
        line. The file's own layout decides: if the upstream's changed, it is named for the new one."""
        if self.mount is None:
            return "not saved: no mount to save into"
        if self.wrong_mount is not None:
            self.metrics.skipped.labels("wrong_mount").inc()
            slot.forget()
            return "not saved: llama-server's --slot-save-path is not the proxy's --mount"
        start = time.monotonic()
        tmp = f"{name}.{secrets.token_hex(6)}{TMP_SUFFIX}"  # its own: a concurrent save never renames it
        try:
            await asyncio.to_thread(self._check_mount)
            r = await self._call("POST", f"/slots/{slot.id}", params={"action": "save"}, json={"filename": tmp})
            r.raise_for_status()
            n = int(r.json()["n_saved"])
            prompt_len = min(n, len(tokens))  # a stream cut off during prefill saves fewer
            found = await asyncio.to_thread(self._layout_of, tmp)
            if self.learn_layout(found) or not name.startswith(self.name_prefix(space)):
                name = f"{self.name_prefix(space)}{_digest(tokens)}"
            await asyncio.to_thread(self._install, tmp, name, prompt_len, found)
        except NotMounted as e:
            self._mount_state(str(e))
            self.metrics.skipped.labels("not_mounted").inc()
            slot.forget()
            await asyncio.to_thread(self._discard, tmp)  # written while the mount went away: off the bare disk
            return f"not saved: {e}"
        except (httpx.HTTPError, OSError, ValueError, KeyError, TypeError) as e:
            log.warning("save of slot %d as %s failed: %s", slot.id, name, _why(e))
            self.metrics.errors.labels("save").inc()
            self.save_problem = f"the last save failed: {_why(e)}"
            slot.forget()
            await asyncio.to_thread(self._discard, tmp)
            return f"save failed: {_why(e)}"
        seconds = time.monotonic() - start
        self.metrics.save_s.observe(seconds)
        self._mount_state(None)
        self.save_problem = None
        slot.tokens, slot.n_tokens, slot.snapshot, slot.prompt_len = tokens[:n], n, name, prompt_len
        return f"saved {n} tokens as {name} in {seconds * 1000:.0f} ms"

    def health_problem(self) -> str | None:
        """Why saves do not work now (None: they do): ``/health`` reports the proxy degraded."""
        if self.wrong_mount is not None:
            return self.wrong_mount
        if self.mount_ok is False:
            return f"{self.mount} is not a live kv-chunk-fs mount: saves are skipped"
        return self.save_problem

    def _layout_of(self, tmp: str) -> str:
        assert self.mount is not None
        return kvlayout.describe_file(self.mount / tmp) or UNKNOWN_LAYOUT

    def _mount_state(self, problem: str | None) -> None:
        """A warning when saves start being skipped (the mount is gone), a line when they resume:
        not one per request (each request's own line says whether it was saved)."""
        if problem is not None and self.mount_ok is not False:
            log.warning("saves are skipped until %s is a kv-chunk-fs mount again: %s", self.mount, problem)
        elif problem is None and self.mount_ok is False:
            log.info("%s is a kv-chunk-fs mount again: saving", self.mount)
        self.mount_ok = problem is None

    def _discard(self, tmp: str) -> None:
        """Remove a half-done save's temporary file (if llama-server wrote one): the store frees it at GC."""
        assert self.mount is not None
        with contextlib.suppress(OSError):
            os.unlink(self.mount / tmp)

    def _check_mount(self) -> None:
        assert self.mount is not None
        problem = mount_problem(self.mount)
        if problem is not None:
            raise NotMounted(problem)

    def _install(self, tmp: str, name: str, prompt_len: int, found: str) -> None:
        """Label the temporary file, then rename it over NAME: readers see the old or the new snapshot, whole.
        The mount is checked again: it may have gone while llama-server was writing."""
        assert self.mount is not None
        self._check_mount()
        os.setxattr(self.mount / tmp, LABEL_XATTR, str(prompt_len).encode())
        os.setxattr(self.mount / tmp, LAYOUT_XATTR, found.encode())
        os.rename(self.mount / tmp, self.mount / name)
        self.refused.pop(name, None)

    # -- budget -------------------------------------------------------------------------------------

    async def keep_budget(self) -> None:
        """Delete the lowest-score snapshots this proxy owns (its model, every configuration, its
        namespace) until what they hold alone (what deleting all of them would free) fits
        ``cache_max_bytes``; other models', other namespaces' and users' files are neither counted nor
        touched. One run at a time; a save arriving meanwhile is covered by the run after it."""
        if self.daemon is None or self._budget_lock.locked():
            return
        async with self._budget_lock:
            try:
                await self._evict()
            except (httpx.HTTPError, ValueError, KeyError) as e:
                log.warning("keeping cache_max_bytes failed: %s", e)
                self.metrics.errors.labels("budget").inc()

    async def _evict(self) -> None:
        assert self.daemon is not None and self.pool is not None
        r = await self._ask_daemon("GET", "/snapshots", params={"prefix": f"{NAME_PREFIX}{self.model_tag}-",
                                                                "sort": "score"})  # fmt: skip
        r.raise_for_status()
        own = [row for row in r.json()["snapshots"] if self.owns(row)]
        if not own:
            return
        preview = await self._ask_daemon("POST", "/deletion-preview", json={"paths": [row["path"] for row in own]})
        preview.raise_for_status()
        excess = int(preview.json()["freed_bytes"]) - self.cache_max_bytes
        if excess <= 0:
            return
        in_use = {s.snapshot for s in self.pool.slots if s.busy} | self._claimed  # about to be rewritten: keep
        freed = deleted = 0
        for row in own:
            path = row["path"]
            if path in in_use:
                continue
            d = await self._ask_daemon("DELETE", "/snapshots/" + quote(path, safe="/"))
            if d.status_code >= 400 and d.status_code != 404:
                d.raise_for_status()
            # Unique bytes only: shared chunks stay for the others (an underestimate; the next run catches up).
            freed, deleted = freed + int(row["unique_bytes"]), deleted + 1
            for s in self.pool.slots:
                if s.snapshot == path:
                    s.snapshot = None
            if freed >= excess:
                break
        if deleted:
            self.metrics.evicted.inc(deleted)
            (await self._ask_daemon("POST", "/gc")).raise_for_status()
            log.info("cache_max_bytes: deleted %d snapshot(s), about %d bytes", deleted, freed)


class WrongMount(Exception):
    """llama-server saves somewhere else than the proxy's ``--mount``."""


async def probe_save(call: Any, mount: Path, slot_id: int) -> tuple[str | WrongMount, int]:
    """Save slot ``slot_id`` as a probe file: its KV layout and token count, or ``WrongMount`` when the
    file does not appear in ``mount`` (then it is not llama-server's ``--slot-save-path``). The probe
    file is removed."""
    tmp = f"{NAME_PREFIX}probe-{secrets.token_hex(6)}{TMP_SUFFIX}"
    path = mount / tmp
    try:
        r = await call("POST", f"/slots/{slot_id}", params={"action": "save"}, json={"filename": tmp})
        r.raise_for_status()
        n = int(r.json()["n_saved"])
        try:
            found = await asyncio.to_thread(kvlayout.describe_file, path)
        except FileNotFoundError:
            return WrongMount(f"llama-server saved {tmp} somewhere else than {mount}: --mount must be the "
                              "directory llama-server was given as --slot-save-path"), n  # fmt: skip
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return found or UNKNOWN_LAYOUT, n


def _digest(tokens: list[int]) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _why(e: BaseException) -> str:
    if isinstance(e, httpx.HTTPStatusError):
        return f"{e.response.status_code} {e.response.text[:300]}"
    return str(e) or type(e).__name__
