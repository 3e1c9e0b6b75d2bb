"""What ``kv-chunk-fs proxy`` checks before it serves: ``--mount`` is the root of a live kv-chunk-fs
mount (its store read from the mount table), and llama-server saves there (a probe save, which also
tells the server's KV layout). Each refusal is one line."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import httpx

from kvchunkfs.proxy.cache import WrongMount, probe_save
from kvchunkfs.proxy.mountcheck import find_mount_root

log = logging.getLogger("kvchunkfs.proxy.server")


def resolve_mount(mount: Path, store: Path, store_given: bool) -> tuple[Path, Path] | str:
    """The mount's root and its store, or why the proxy cannot use ``mount``. The store is the one the
    mount table names (``kv-chunk-fs:STORE``); a ``--store`` given as well must be that one."""
    root = find_mount_root(mount)
    if isinstance(root, str):
        return root
    if root.store is None:  # an older daemon's mount does not name its store
        return root.mountpoint, store
    if store_given and os.path.realpath(store) != os.path.realpath(root.store):
        return f"--store {store} is not the store of the mount at {root.mountpoint} ({root.store}): leave --store out"
    return root.mountpoint, root.store


async def probe_upstream(upstream: str, mount: Path, wait: float = 30.0) -> str | WrongMount | None:
    """The upstream's KV layout from a probe save of an idle slot, or ``WrongMount`` if the probe file
    does not appear in ``mount``; None when it cannot tell now (llama-server not answering within
    ``wait`` seconds, an API key needed, no idle slot): the first request probes again."""
    async with httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=httpx.Timeout(60.0, connect=5.0)) as http:

        async def call(method: str, path: str, **kw: Any) -> httpx.Response:
            return await http.request(method, path, **kw)

        deadline = time.monotonic() + wait
        while True:
            try:
                r = await http.get("/slots")
                if r.status_code in (401, 403, 501):  # a key needed, or no /slots: tell later
                    return None
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.5)
        slots = [s for s in r.json() if isinstance(s, dict) and not s.get("is_processing")]
        if not slots:
            return None
        held = [s for s in slots if "id_task" in s and int(s.get("n_prompt_tokens", 0)) > 0]
        slot = (held or slots)[0]
        if not held:  # an empty slot saves no layout: give it one token first
            t = await http.post("/tokenize", json={"content": "probe", "add_special": True})
            t.raise_for_status()
            first = [tok if type(tok) is int else tok["id"] for tok in t.json()["tokens"]][:1]
            c = await http.post("/completion", json={"prompt": first, "n_predict": 1, "id_slot": slot["id"],
                                                     "cache_prompt": True, "temperature": 0})  # fmt: skip
            c.raise_for_status()
        found, _ = await probe_save(call, mount, int(slot["id"]))
        return found
