"""The real llama-server behind ``kv-chunk-fs proxy``: an agent-like chat workload, three ways.

    python -m e2e.proxy [--conversations 16 --systems 3 --turns 3 --slots 2] [--out proxy-report.json]

Workload: ``--conversations`` chats, each with one of ``--systems`` long system prompts (shared),
``--turns`` user turns, sent through the real ``openai`` client (streaming, greedy, 8 tokens per
answer), one request at a time (``--clients N``: N at a time), conversations interleaved
round-robin (more conversations than slots). Before the last turn everything is restarted:
llama-server, and for the proxy run also the mount and the proxy. Runs:

- ``alone-cache-ram-0``: llama-server alone, ``--cache-ram 0`` (only the slots themselves cache);
- ``alone-cache-ram``: llama-server alone with its default RAM prompt cache;
- ``proxy``: clients talk to ``kv-chunk-fs proxy``, llama-server (``--cache-ram 0``) saves into a
  kv-chunk-fs mount.

Checks: every answer is identical in the three runs (with ``--clients 1``: llama.cpp's numbers depend
on what else is in a batch, so parallel runs differ in a few near-tie tokens even between two runs of
llama-server alone); after the restart, the proxy run takes >= 90% of
the shared prompt tokens (the prefix each last-turn prompt shares with its conversation's previous
prompt) from the store. Prints the table README.md shows (prompt tokens evaluated, time to first
token). Exit code 0 when the checks pass.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from e2e.build import cache_dir, ensure_llama_server, src_tree
from e2e.llama import LlamaServer, free_port
from e2e.models import ensure_model
from e2e.mount import REPO, Mount

WORDS = (
    "agent tool call result file search plan step check error retry memory context task goal user query answer "
    "summary code test patch review branch commit merge build deploy log metric trace span cache token prompt "
    "model slot store chunk index pack map stub rename save restore"
).split()


class Server(LlamaServer):
    """llama-server with ``slots`` slots of ``ctx`` tokens each; ``cache_ram=None`` keeps its default."""

    def __init__(self, *a: Any, slots: int, cache_ram: str | None, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.slots, self.cache_ram = slots, cache_ram

    port_fixed = 0  # > 0: always this port (a restart the proxy in front does not see coming)

    def argv(self, port: int) -> list[str]:
        argv = super().argv(self.port_fixed or port)
        i = argv.index("--cache-ram")
        del argv[i : i + 2]
        argv[argv.index("-np") + 1] = str(self.slots)
        argv[argv.index("-c") + 1] = str(self.ctx * self.slots)
        return argv + (["--cache-ram", self.cache_ram] if self.cache_ram is not None else [])


class FixedPortServer(Server):
    """A llama-server restarted on the same port, so the proxy in front keeps running across restarts."""

    def start(self, timeout: float = 180.0) -> None:
        self.port_fixed = self.port_fixed or free_port()
        argv = self.argv(self.port_fixed)
        self._logf = open(self.log, "ab")  # noqa: SIM115 - closed in stop()
        self._logf.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
        self._logf.flush()
        self.proc = subprocess.Popen(argv, stdout=self._logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)  # fmt: skip
        self.port = self.port_fixed
        self._wait_healthy(timeout)


class Proxy:
    """``kv-chunk-fs proxy`` as a child process (this checkout's src first on the path)."""

    def __init__(self, store: Path, mnt: Path, log: Path) -> None:
        self.store, self.mnt, self.log = store, mnt, log
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, upstream: str) -> None:
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        # README's command: no --store, the mount table names the mount's store
        argv = [sys.executable, "-m", "kvchunkfs.cli", "proxy", "--mount", str(self.mnt), "--upstream", upstream,
                "--listen", f"127.0.0.1:{self.port}"]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/metrics", timeout=5):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"proxy did not start; see {self.log}") from None
                time.sleep(0.1)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()  # uvicorn finishes saves in flight, then exits
            self.proc.wait(60)
            self.proc = None


def workload(n_conv: int, n_sys: int, turns: int, sys_words: int, user_words: int) -> list[dict[str, Any]]:
    rng = random.Random(7)
    systems = [f"System {i}. " + " ".join(rng.choice(WORDS) for _ in range(sys_words)) for i in range(n_sys)]
    return [
        {"system": systems[c % n_sys],
         "users": [f"C{c} T{t}: " + " ".join(rng.choice(WORDS) for _ in range(user_words)) for t in range(turns)]}
        for c in range(n_conv)
    ]  # fmt: skip


def ask(base_url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=600)
    start = time.monotonic()
    ttft, text, timings = None, "", {}
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0.0,  # type: ignore[arg-type]
                                            stream=True, seed=1)  # fmt: skip
    for chunk in stream:
        if ttft is None:
            ttft = time.monotonic() - start
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        timings = (chunk.model_extra or {}).get("timings") or timings
    return {"text": text, "ttft": ttft, "prompt_n": timings.get("prompt_n"), "cache_n": timings.get("cache_n", 0)}


def prompt_tokens(upstream: str, messages: list[dict[str, str]]) -> list[int]:
    def post(path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(upstream + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    text = post("/apply-template", {"messages": messages})["prompt"]
    return post("/tokenize", {"content": text, "add_special": True})["tokens"]


def run(mode: str, convs: list[dict[str, Any]], args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    d = work / mode
    d.mkdir()
    binary, model = ensure_llama_server(), ensure_model(args.model, cache_dir(), src_tree())
    via_proxy = mode == "proxy"
    mount = Mount(d / "store", d / "mnt", d / "mount.log", plain=not via_proxy)
    cache_ram = None if mode == "alone-cache-ram" else "0"
    server = Server(binary, model.path, d / "mnt", d / "llama.log", ctx=args.ctx, slots=args.slots,
                    cache_ram=cache_ram)  # fmt: skip
    proxy = Proxy(d / "store", d / "mnt", d / "proxy.log")

    def start() -> str:
        mount.start()
        server.start()
        if not via_proxy:
            return server.url
        proxy.start(server.url)
        return proxy.url

    def stop() -> None:
        proxy.stop()
        server.stop()
        mount.stop()

    history = [[{"role": "system", "content": c["system"]}] for c in convs]

    def one_turn(i: int, t: int, url: str) -> dict[str, Any]:
        messages = [*history[i], {"role": "user", "content": convs[i]["users"][t]}]
        r = ask(url, messages)
        r.update(conv=i, turn=t, after_restart=t == args.turns - 1)
        if via_proxy and r["after_restart"]:  # what this prompt shares with the previous one
            now, before = prompt_tokens(server.url, messages), prompt_tokens(server.url, history[i][:-1])
            r["shared"] = next((k for k, (a, b) in enumerate(zip(now, before, strict=False)) if a != b),
                               min(len(now), len(before)))  # fmt: skip
        history[i] = [*messages, {"role": "assistant", "content": r["text"]}]
        return r

    records: list[dict[str, Any]] = []
    url = start()
    try:
        for t in range(args.turns):
            if t == args.turns - 1:  # everything restarts before the last turn
                stop()
                url = start()
            with ThreadPoolExecutor(args.clients) as pool:  # --clients conversations at a time
                for r in pool.map(lambda i, t=t, u=url: one_turn(i, t, u), range(len(convs))):
                    records.append(r)
        if via_proxy:
            records.append({"metrics": proxy_metrics(proxy.metrics())})
    finally:
        stop()
    return records


def proxy_metrics(text: str) -> dict[str, float]:
    """The proxy's counters and duration sums (of the instance serving the last turn)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_total", "_sum", "_count", "_ratio")):
                out[s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    def part(rs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"requests": len(rs), "prompt_n": sum(r["prompt_n"] or 0 for r in rs),
                "prompt_total": sum((r["prompt_n"] or 0) + (r["cache_n"] or 0) for r in rs),
                "ttft_median_ms": round(1000 * statistics.median(r["ttft"] for r in rs), 1),
                "ttft_mean_ms": round(1000 * statistics.mean(r["ttft"] for r in rs), 1)}  # fmt: skip

    before = [r for r in records if not r["after_restart"]]
    after = [r for r in records if r["after_restart"]]
    return {"before_restart": part(before), "after_restart": part(after), "all": part(records)}


def kv_types(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The KV types change under the proxy: ``--conversations`` chats saved with f16 KV, llama-server
    restarted with ``-ctk q4_0 -ctv q4_0`` (same port, the same proxy process running throughout,
    told nothing), then with f16 again; a turn of
    every conversation in each phase. Per phase: prompt tokens evaluated per turn against the whole
    prompt (what llama-server alone evaluates after its restart), restores refused, files saved."""
    convs = workload(args.conversations, args.systems, 3, args.system_words, args.user_words)
    binary, model = ensure_llama_server(), ensure_model(args.model, cache_dir(), src_tree())
    mount = Mount(work / "store", work / "mnt", work / "mount.log")
    f16 = FixedPortServer(binary, model.path, work / "mnt", work / "llama.log", ctx=args.ctx, slots=args.slots,
                          cache_ram="0")  # fmt: skip
    q4 = FixedPortServer(binary, model.path, work / "mnt", work / "llama.log", ctx=args.ctx, slots=args.slots,
                         cache_ram="0", extra=["-ctk", "q4_0", "-ctv", "q4_0"])  # fmt: skip
    q4.port_fixed = f16.port_fixed = free_port()  # one address: the proxy keeps running across the restarts
    proxy = Proxy(work / "store", work / "mnt", work / "proxy.log")
    history = [[{"role": "system", "content": c["system"]}] for c in convs]
    phases: list[dict[str, Any]] = []
    mount.start()
    try:
        for phase, (name, server) in enumerate((("f16", f16), ("q4_0", q4), ("f16 again", f16))):
            server.start()
            if phase == 0:
                proxy.start(server.url)  # the proxy's checks at start: the mount, a probe save
            before = set(os.listdir(work / "mnt"))
            turns = []
            for i, c in enumerate(convs):
                messages = [*history[i], {"role": "user", "content": c["users"][phase]}]
                total = len(prompt_tokens(server.url, messages))
                r = ask(proxy.url, messages)
                turns.append({"conv": i, "prompt": total, "evaluated": r["prompt_n"], "cache_n": r["cache_n"]})
                history[i] = [*messages, {"role": "assistant", "content": r["text"]}]
            m = proxy_metrics(proxy.metrics())
            time.sleep(1)  # the last save lands
            phases.append({"phase": name, "turns": turns, "new_files": sorted(set(os.listdir(work / "mnt")) - before),
                           "refused": sum(v for k, v in m.items() if k.startswith("kvcfs_proxy_refused_restores")),
                           "restores": m.get("kvcfs_proxy_restore_seconds_count", 0.0)})  # fmt: skip
            server.stop()
        log = (work / "llama.log").read_text(errors="replace")
        return {"phases": phases, "server_refusals": log.count("Unable to restore slot") + log.count("incompatible")}
    finally:
        proxy.stop()
        f16.stop()
        q4.stop()
        mount.stop()


def kv_types_checks(res: dict[str, Any]) -> dict[str, bool]:
    f16, q4, back = res["phases"]
    tag = lambda name: name.split("-")[2]  # noqa: E731 - kvp-MODEL-LAYOUT-HASH
    return {
        "no restore attempted against an incompatible snapshot (llama-server refused none)":
            res["server_refusals"] == 0 and all(p["refused"] == 0 for p in res["phases"]),
        "no turn evaluates more than its whole prompt (llama-server alone after its restart)":
            all(t["evaluated"] <= t["prompt"] for p in res["phases"] for t in p["turns"]),
        "q4_0 snapshots saved beside the f16 ones, named apart":
            bool(q4["new_files"]) and not {tag(f) for f in q4["new_files"]} & {tag(f) for f in f16["new_files"]},
        "back on f16 the f16 conversations restore again":
            all(t["cache_n"] > 0.5 * t["prompt"] for t in back["turns"]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--systems", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--clients", type=int, default=1, help="conversations in flight at once (each its own turn order)")
    p.add_argument("--ctx", type=int, default=4096, help="tokens per slot")
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--user-words", type=int, default=25)
    p.add_argument("--modes", default="alone-cache-ram-0,alone-cache-ram,proxy")
    p.add_argument("--scenario", choices=["compare", "kv-types"], default="compare",
                   help="kv-types: f16 -> q4_0 -> f16 KV under one proxy (see kv_types)")  # fmt: skip
    p.add_argument("--out", type=Path)
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, stores)")
    args = p.parse_args(argv)
    convs = workload(args.conversations, args.systems, args.turns, args.system_words, args.user_words)
    work = Path(tempfile.mkdtemp(prefix="kvcfs-e2e-proxy-"))
    if args.scenario == "kv-types":
        try:
            res = kv_types(args, work)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        for p in res["phases"]:
            print(f"{p['phase']}: prompt tokens evaluated per turn "
                  f"{[t['evaluated'] for t in p['turns']]} of {[t['prompt'] for t in p['turns']]}; "
                  f"restores {int(p['restores'])}, refused {int(p['refused'])}; new {p['new_files']}")  # fmt: skip
        checks = kv_types_checks(res)
        for name, ok in checks.items():
            print(f"{'PASS' if ok else 'FAIL'} {name}")
        if args.out:
            args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": res,
                                            "checks": checks}, indent=1))  # fmt: skip
        return 0 if all(checks.values()) else 1
    results: dict[str, Any] = {}
    try:
        for mode in args.modes.split(","):
            t0 = time.monotonic()
            records = run(mode, convs, args, work)
            extra = [r for r in records if "metrics" in r]
            records = [r for r in records if "metrics" not in r]
            results[mode] = {"summary": summary(records), "records": records, "seconds": time.monotonic() - t0}
            if extra:
                results[mode]["proxy_metrics_after_restart"] = extra[0]["metrics"]
                m = extra[0]["metrics"]
                for step in ("restore", "save"):
                    n = m.get(f"kvcfs_proxy_{step}_seconds_count", 0)
                    if n:
                        print(f"{mode}: {int(n)} {step}s after the restart, mean "
                              f"{1000 * m[f'kvcfs_proxy_{step}_seconds_sum'] / n:.1f} ms")  # fmt: skip
            print(f"{mode}: {json.dumps(results[mode]['summary'])}", flush=True)
    finally:
        if args.keep:
            print(f"work directory: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    checks = check(results, args.clients)
    print(table(results))
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'} {name}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results,
                                        "checks": checks}, indent=1))  # fmt: skip
    return 0 if all(checks.values()) else 1


def check(results: dict[str, Any], clients: int = 1) -> dict[str, bool]:
    out: dict[str, bool] = {}
    texts = {mode: {(r["conv"], r["turn"]): r["text"] for r in res["records"]} for mode, res in results.items()}
    first = next(iter(texts.values()), {})
    differ = {mode: sum(t[k] != first.get(k) for k in t) for mode, t in texts.items()}
    if clients == 1:
        out["identical answers in every run"] = not any(differ.values())
    else:  # llama.cpp's results depend on what else is in the batch: parallel runs are not comparable
        print(f"answers differing from the first run (informational with --clients {clients}): {differ}")
    if "proxy" in results:
        after = [r for r in results["proxy"]["records"] if r["after_restart"]]
        shared = sum(r["shared"] for r in after)
        stored = sum(min(r["cache_n"] or 0, r["shared"]) for r in after)
        ratio = stored / shared if shared else 0.0
        results["proxy"]["summary"]["after_restart"]["from_store_ratio"] = round(ratio, 4)
        out[f"after the restart >= 90% of shared prompt tokens from the store ({100 * ratio:.1f}%)"] = ratio >= 0.9
    return out


def table(results: dict[str, Any]) -> str:
    lines = ["| run | prompt tokens evaluated (before restart / after) | of prompt tokens | TTFT median ms "
             "(before / after) | TTFT mean ms (before / after) |", "|---|---|---|---|---|"]  # fmt: skip
    for mode, res in results.items():
        s = res["summary"]
        b, a = s["before_restart"], s["after_restart"]
        lines.append(f"| {mode} | {b['prompt_n']} / {a['prompt_n']} | {b['prompt_total']} / {a['prompt_total']} | "
                     f"{b['ttft_median_ms']} / {a['ttft_median_ms']} | "
                     f"{b['ttft_mean_ms']} / {a['ttft_mean_ms']} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
