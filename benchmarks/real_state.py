"""Real llama-server state files saved and restored: a plain directory, the FUSE floor, kv-chunk-fs.

    python3 benchmarks/real_state.py                                   # llama-server, all seven configs
    python3 benchmarks/real_state.py --configs f16-10M,q4-10M --runs 3 --json out.json
    python3 benchmarks/real_state.py --states DIR                      # keep the state files in DIR
    python3 benchmarks/real_state.py --files DIR/*                     # replay them, no llama-server
    python3 benchmarks/real_state.py --compare-src ../other/src ...    # + kv-chunk-fs from another tree

llama-server mode: one llama-server (the e2e harness's build and random-weight ``llama12`` model:
12 layers x 512, 4 KV heads of 64; one slot, ``-fa on --cache-ram 0``, f16 or ``-ctk q4_0 -ctv
q4_0``) saves and restores its slot itself; the figures are its own ``timings.save_ms`` and
``timings.restore_ms``. Its ``--slot-save-path`` is a directory of symlinks, one per target and
name, so the very same slot state is saved into every target: (a) a plain directory, (b) the
do-nothing filesystem on kv-chunk-fs's FUSE front end (benchmarks/nullfs.py, "floor"; restores read
a second nullfs that keeps the bytes, ``--keep-data``, because llama-server parses what it reads), (c) kv-chunk-fs with
default settings (plus (d), ``--compare-src``). Saves follow the proxy's pattern: ``NAME.tmp``,
then renamed over ``NAME``. Restores are also read through (e) "pass-through", a nullfs serving the
plain files from disk (``--backing``, one ``pread`` per read request, restarted with the kv-chunk-fs
daemons): the least any daemon of this binding that reads the disk costs a restore.

Each config's conversation (random prompt tokens, the config's size) is prefilled once and kept in
``--states`` (CPU flash attention is quadratic in the context: a 100 MiB f16 context takes ~15
minutes on 2 cores); a later run restores it instead. Every run, per config, targets interleaved
(the order rotates):

- first save: the conversation saved under a new name, with the kv-chunk-fs daemons freshly
  mounted on empty stores (warmed up with one small state file), so every byte is new to the store, as
  a new conversation's are;
- next-turn saves (``--turns``): the same conversation 200 prompt tokens (+4 generated) later,
  saved again under its name;
- cold restore: every kv-chunk-fs daemon unmounted and mounted again, ``sync`` and
  ``echo 3 > /proc/sys/vm/drop_caches`` before each target's restore; then warm restores.

``sync`` (not a cache drop) runs before every save, so no save pays for another's writeback.
Daemon CPU is utime+stime from /proc across the operation; peak RSS is sampled during the cold
restore. The restored files are compared byte for byte with the plain copy after every run.

``--files`` mode replays given state files with ordinary file calls, as llama-server makes them:
a save is ``open(wb)``, one ``write`` per piece of the file (header and tokens, then one per K or V
block, as ``llama_state_seq_save_file`` issues ``fwrite`` calls; buffered by st_blksize as stdio
is), ``close``, rename; a restore is an ``open``/12-byte read/``close`` header probe and then a
sequential read of the same pieces. A file ``F.t1`` next to ``F`` is its next turn. Each run uses
a fresh kv-chunk-fs store, so the first save is all new bytes, as in the llama-server mode.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))

import bench  # noqa: E402  (benchmarks/bench.py: mounts, cache drops, CPU and RSS sampling)

from e2e import ggsq  # noqa: E402
from e2e.build import cache_dir, ensure_llama_server, src_tree  # noqa: E402
from e2e.llama import LlamaServer  # noqa: E402
from e2e.models import ensure_model  # noqa: E402

MiB = 1 << 20
# e2e/models.py models: (layers, KV heads, head dim, description)
MODELS = {
    "llama12": (12, 4, 64, "12 layers x 512, 4 KV heads of 64"),
    "llama32": (32, 8, 128, "Llama-3-8B's KV shape: 32 layers, 8 KV heads of 128, on 1024 dims"),
}
SETTLE = 1.0  # seconds after the daemons' restart before the first timed restore
BLOCK_BYTES = {"f16": 64, "q4": 18}  # bytes of 32 K or V values
CELL_BYTES = 16  # per token: cell record (pos, n_seq_id, seq_id) + token id
# name: (KV type, MiB, model). q4_0 at >= 100 MiB on llama12 is 33K tokens: hours of CPU prefill.
CONFIGS = {
    "f16-10M": ("f16", 10, "llama12"),
    "f16-30M": ("f16", 30, "llama12"),
    "f16-110M": ("f16", 110, "llama12"),
    "q4-10M": ("q4", 10, "llama12"),
    "q4-30M": ("q4", 30, "llama12"),
    "q4-110M-l32": ("q4", 110, "llama32"),
    "f16-110M-l32": ("f16", 110, "llama32"),
}
TURN_TOKENS = 200
N_PREDICT = 4
VOCAB = (300, 32000)  # random prompt tokens: skip control and byte tokens
PLAIN, FLOOR, PASS, FS, FS2 = "plain", "floor", "pass-through", "kv-chunk-fs", "compare"
PFLOOR = "pt-floor"  # the front end passing every file through to one on a huge-page tmpfs, nothing else
FIRST, NEXT, COLD, WARM = "first save", "next-turn save", "cold restore", "warm restore"
OPS = (FIRST, NEXT, COLD, WARM)
TARGETS_MET = {  # passed through, the restores reading a whole copy: (op, against, at most)
    FIRST: (PLAIN, 1.1),
    NEXT: (PLAIN, 1.1),
    COLD: (PLAIN, 1.1),
    WARM: (PLAIN, 1.1),
}


# -- targets -------------------------------------------------------------------------------


@dataclass
class Target:
    """Where a save goes (``dir``) and a restore reads (``read_dir``: nullfs keeps no bytes)."""

    name: str
    dir: Path
    read_dir: Path
    mount: bench.Mount | None = None


@dataclass
class Bed:
    """The mounts of one benchmark: plain, the floor (two nullfs), kv-chunk-fs (and a second one)."""

    work: Path
    mount_args: list[str]
    compare_src: Path | None
    targets: list[Target] = field(default_factory=list)
    keep: bench.Mount | None = None  # the nullfs that keeps bytes: the floor's restores
    passthrough: Target | None = None  # restores only: a nullfs serving the plain files from disk
    ptback: Path | None = None  # the passthrough floor's huge-page tmpfs
    store_no: int = 0

    def fs_mounts(self) -> list[bench.Mount]:
        return [t.mount for t in self.targets if t.name in (FS, FS2) and t.mount is not None]

    def mounts(self) -> list[bench.Mount]:
        ms = [t.mount for t in self.targets if t.mount is not None]
        more = [self.keep, self.passthrough.mount if self.passthrough else None]
        return ms + [m for m in more if m is not None]

    def fs_argv(self, name: str) -> list[str]:
        store = self.work / f"store-{name}-{self.store_no}"
        mnt = self.work / name
        return [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(store), *self.mount_args, str(mnt)]

    def setup(self) -> None:
        cfg = bench.mount_config(self.mount_args)
        ra = cfg.kernel_readahead_kb
        wb = "--no-writeback-cache"  # as kv-chunk-fs: the kernel never caches writes
        null = [sys.executable, str(HERE / "nullfs.py"), "--kernel-readahead-kb", str(ra), wb]
        w = self.work
        (w / PLAIN).mkdir()
        self.keep = bench.Mount([*null, "--keep-data", str(w / "keep")], w / "keep", w / "keep.log", ra, None)
        passthrough = bench.Mount([*null, "--backing", str(w / PLAIN), str(w / "pass")], w / "pass",
                                  w / "pass.log", ra, None)  # fmt: skip
        self.passthrough = Target(PASS, w / PLAIN, w / "pass", passthrough)  # started by restart_fs
        self.targets = [
            Target(PLAIN, w / PLAIN, w / PLAIN),
            Target(FLOOR, w / "null", w / "keep", bench.Mount([*null, str(w / "null")], w / "null",
                                                              w / "null.log", ra, None)),
            Target(FS, w / "fs", w / "fs", bench.Mount(self.fs_argv("fs"), w / "fs", w / "fs.log", ra,
                                                       "gc finished")),
        ]  # fmt: skip
        if self.compare_src is not None:
            m = bench.Mount(self.fs_argv("fs2"), w / "fs2", w / "fs2.log", ra, "gc finished", src=self.compare_src)
            self.targets.append(Target(FS2, w / "fs2", w / "fs2", m))
        pfloor = self._passthrough_floor(null)
        if pfloor is not None:
            self.targets.insert(2, pfloor)
        for m in self.mounts():
            m.start()

    def _passthrough_floor(self, null: list[str]) -> Target | None:
        """The floor of a passed-through save or hot restore: nullfs naming, for every open, a file
        on a tmpfs with huge pages as its backing file (what kv-chunk-fs's whole files are on, as
        root); None where that tmpfs cannot be mounted (not root)."""
        w, back = self.work, self.work / "ptback"
        back.mkdir(mode=0o700)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,huge=within_size", "tmpfs", str(back)],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode != 0:
            print(f"no passthrough floor: {r.stderr.strip()}", file=sys.stderr)
            return None
        self.ptback = back
        m = bench.Mount([*null, "--backing", str(back), "--passthrough", str(w / "ptnull")], w / "ptnull",
                        w / "ptnull.log", bench.mount_config(self.mount_args).kernel_readahead_kb, None)  # fmt: skip
        return Target(PFLOOR, w / "ptnull", w / "ptnull", m)

    def fresh_stores(self) -> None:
        """Remount the kv-chunk-fs daemons on new, empty stores (replay: the first save is all new)."""
        self.store_no += 1
        for t in self.targets:
            if t.name in (FS, FS2) and t.mount is not None:
                t.mount.stop()
                t.mount.argv = self.fs_argv("fs" if t.name == FS else "fs2")
                t.mount.start()

    def restart_fs(self) -> None:
        pfloor = [t.mount for t in self.targets if t.name == PFLOOR and t.mount is not None]
        for m in self.fs_mounts() + pfloor:
            m.restart()  # a fresh daemon: nothing cached, as after a restart
        if self.passthrough is not None and self.passthrough.mount is not None:
            self.passthrough.mount.restart()  # it opens the plain files as they are now
        time.sleep(SETTLE)  # the daemons' start-up work done before the first restore is timed

    def teardown(self) -> None:
        for m in self.mounts():
            m.stop()
        if self.ptback is not None:
            subprocess.run(["umount", "-l", str(self.ptback)], check=False)

    def order(self, run_no: int, restores: bool = False) -> list[Target]:
        """The targets in this run's order. The kv-chunk-fs trees go one right after the other,
        which one first alternating each run, and that pair, plain and the floor (and, for
        restores, the pass-through) rotate: over a multiple of their count of runs every target
        holds every place equally (with the trees simply rotated among four places, the same tree
        in both slots differed by ~10%: one was restored first more often)."""
        plain, floor, *rest = self.targets
        trees = [t for t in rest if t.name in (FS, FS2)]
        if len(trees) == 2 and run_no % 2:
            trees.reverse()
        units: list[list[Target]] = [[plain], [floor], *[[t] for t in rest if t.name == PFLOOR], trees]
        if restores and self.passthrough is not None:
            units.insert(2, [self.passthrough])
        k = run_no % len(units)
        return [t for unit in units[k:] + units[:k] for t in unit]


# -- samples -------------------------------------------------------------------------------


@dataclass
class Sample:
    ms: float  # llama-server's timings (or the replay's wall time), open to close
    wall_ms: float  # around the whole call (HTTP round trip; + the rename for saves)
    cpu_ms: float | None = None  # daemon utime+stime
    rss_peak: int | None = None


@dataclass
class Results:
    samples: dict[str, dict[str, dict[str, list[Sample]]]] = field(default_factory=dict)  # config/op/target
    sizes: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    load: list[tuple[float, float, float]] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    def add(self, config: str, op: str, target: str, s: Sample) -> None:
        self.samples.setdefault(config, {}).setdefault(op, {}).setdefault(target, []).append(s)


def measured(t: Target, fn: Callable[[], float], rss: bool = False) -> Sample:
    """Run ``fn`` (which returns its own ms figure), with wall time, daemon CPU and RSS."""
    pid = t.mount.pid if t.mount is not None else None
    cpu0 = bench.cpu_seconds(pid) if pid else None
    t0 = time.perf_counter()
    if rss and pid:
        with bench.RssSampler(pid) as sampler:
            ms = fn()
        peak: int | None = sampler.peak
    else:
        ms, peak = fn(), None
    wall = (time.perf_counter() - t0) * 1e3
    cpu = (bench.cpu_seconds(pid) - cpu0) * 1e3 if pid and cpu0 is not None else None
    return Sample(ms, wall, cpu, peak)


# -- llama-server mode -----------------------------------------------------------------------


def tokens_for(kv: str, mib: int, model: str) -> int:
    layers, heads, dim, _ = MODELS[model]
    return (mib * MiB) // (2 * layers * heads * dim // 32 * BLOCK_BYTES[kv] + CELL_BYTES)


class Slot:
    """One llama-server whose slot-save path is a directory of symlinks into the targets."""

    def __init__(self, binary: Path, model: Path, work: Path, kv: str, ctx: int) -> None:
        self.links = work / f"slots-{model.stem}-{kv}"
        self.links.mkdir(exist_ok=True)
        extra = ["-ctk", "q4_0", "-ctv", "q4_0"] if kv == "q4" else []
        # the model's GGUF says 4096 and llama-server caps a slot at the training context
        extra += ["--override-kv", f"llama.context_length=int:{ctx}"]
        self.srv = LlamaServer(binary, model, self.links, work / f"llama-{model.stem}-{kv}.log", ctx=ctx, extra=extra)
        self.history: list[int] = []  # the conversation's tokens (the last one generated)
        self.n_cached = 0  # tokens in the slot's KV cache

    def link_to(self, path: Path) -> str:
        """The slot file name under which llama-server reaches ``path``."""
        ln = str(path).strip("/").replace("/", "_")
        p = self.links / ln
        if not p.is_symlink():
            p.symlink_to(path)
        return ln

    def complete(self, prompt: list[int]) -> None:
        body = {"prompt": prompt, "n_predict": N_PREDICT, "cache_prompt": True, "id_slot": 0, "temperature": 0.0,
                "top_k": 1, "seed": 1, "ignore_eos": True, "return_tokens": True, "stream": False}  # fmt: skip
        r = self.srv.request("POST", "/completion", body, timeout=4 * 3600)
        self.history = prompt + list(r["tokens"])
        self.n_cached = len(self.history) - 1  # the last generated token is not evaluated yet

    def new_conversation(self, n: int, rnd: random.Random) -> None:
        self.complete([rnd.randrange(*VOCAB) for _ in range(n - N_PREDICT + 1)])

    def next_turn(self, rnd: random.Random) -> None:
        self.complete(self.history + [rnd.randrange(*VOCAB) for _ in range(TURN_TOKENS)])

    def save_to(self, path: Path) -> float:
        """llama-server saves its slot to ``path``; its save_ms."""
        r = self.srv.slot_action("save", self.link_to(path))
        if r["n_saved"] != self.n_cached:
            raise RuntimeError(f"{path}: saved {r['n_saved']} tokens, expected {self.n_cached}")
        return float(r["timings"]["save_ms"])

    def save(self, t: Target, name: str) -> float:
        """``NAME.tmp`` saved by llama-server and renamed over ``NAME`` (the proxy's pattern); its save_ms."""
        ms = self.save_to(t.dir / f"{name}.tmp")
        os.rename(t.dir / f"{name}.tmp", t.dir / name)
        return ms

    def restore_from(self, path: Path, expect: int | None = None) -> float:
        r = self.srv.slot_action("restore", self.link_to(path))
        if expect is not None and r["n_restored"] != expect:
            raise RuntimeError(f"{path}: restored {r['n_restored']} tokens, expected {expect}")
        self.n_cached = r["n_restored"]
        return float(r["timings"]["restore_ms"])

    def restore(self, t: Target, name: str) -> float:
        return self.restore_from(t.read_dir / name, self.n_cached)

    def resume(self, path: Path) -> None:
        """Continue the conversation saved in ``path`` (untimed): its KV restored, its tokens read."""
        self.restore_from(path)
        self.history = read_tokens(path)
        if len(self.history) != self.n_cached:
            raise RuntimeError(f"{path}: {len(self.history)} tokens in the header, {self.n_cached} restored")


def read_tokens(path: Path) -> list[int]:
    with open(path, "rb") as f:
        _magic, _version, n = struct.unpack("<III", f.read(12))
        words = list(struct.unpack(f"<{n}I", f.read(4 * n)))
    return ggsq.parse_tokens(words)[0]


def sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while b := f.read(MiB):
            h.update(b)
    return h.hexdigest()


def copy_file(src: Path, dst: Path) -> None:
    with open(src, "rb") as a, open(dst, "wb") as b:
        shutil.copyfileobj(a, b, MiB)


def saves(bed: Bed, res: Results, config: str, op: str, run_no: int, save: Callable[[Target], float]) -> None:
    for t in bed.order(run_no):
        os.sync()
        res.add(config, op, t.name, measured(t, lambda t=t: save(t)))


def restores(bed: Bed, res: Results, config: str, run_no: int, restore: Callable[[Target], float]) -> None:
    bed.restart_fs()
    for t in bed.order(run_no, restores=True):
        bench.drop_caches()
        res.add(config, COLD, t.name, measured_restore(bed, t, restore, cold=True))
    for t in bed.order(run_no, restores=True):
        res.add(config, WARM, t.name, measured_restore(bed, t, restore, cold=False))


def measured_restore(bed: Bed, t: Target, restore: Callable[[Target], float], cold: bool) -> Sample:
    if t.name == FLOOR and bed.keep is not None:  # the keeping nullfs answers the floor's reads
        t = Target(FLOOR, t.read_dir, t.read_dir, bed.keep)
    return measured(t, lambda: restore(t), rss=cold)


def verify(bed: Bed, res: Results, name: str) -> None:
    """Every target's copy byte for byte against the plain one (a wrong byte voids the figures)."""
    ref = sha256(bed.targets[0].dir / name)
    for t in bed.targets[1:]:
        if t.name != FLOOR and sha256(t.dir / name) != ref:
            raise RuntimeError(f"{t.name}/{name} differs from the plain copy")
    res.checks.append(f"{name}: {len(bed.targets) - 2} kv-chunk-fs copies equal the plain one")


def base_state(slot: Slot, states: Path, config: str, n: int, model: str, seed: str) -> Path:
    """The config's conversation (prefilled once, kept in ``states``: CPU attention is quadratic, a
    100 MiB context takes many minutes), loaded into the slot."""
    path = states / config
    if not path.exists():
        states.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        slot.new_conversation(n, random.Random(f"{config}-{seed}"))
        prefill = time.perf_counter() - t0
        slot.save_to(path.with_name(path.name + ".tmp"))
        os.rename(path.with_name(path.name + ".tmp"), path)
        with open(states / "README", "a") as f:
            f.write(f"{config}: {path.stat().st_size} bytes; {state_origin(slot, model)}; {slot.n_cached} tokens\n")
        print(f"{config}: prefilled {slot.n_cached} tokens in {prefill:.0f} s, saved {path}", flush=True)
    slot.resume(path)
    return path


def state_origin(slot: Slot, model: str) -> str:
    flags = f"-c {slot.srv.ctx} -np 1 -fa on --cache-ram 0 " + " ".join(slot.srv.extra)
    return f"llama-server, model {model} (e2e/models.py: {MODELS[model][3]}, random weights), {flags}"


def warm_up(bed: Bed) -> None:
    """A freshly mounted daemon's first file is not what is measured: write and read a small state
    file (synthetic, 64 tokens of this model's shape), so the format and relayout paths have run."""
    spec = ggsq.Spec(n_layer=12, row_bytes=512, seed=os.urandom(8))
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(64, seed=int.from_bytes(os.urandom(4))), spec)
    for t in bed.targets:
        p = t.dir / "warm-up"
        p.write_bytes(data)
        p.read_bytes()
        p.unlink()


def llama_config(bed: Bed, res: Results, args: argparse.Namespace, config: str, binary: Path) -> None:
    kv, mib, model = CONFIGS[config]
    n = tokens_for(kv, mib, model)
    gguf = ensure_model(model, cache_dir(), src_tree()).path
    slot = Slot(binary, gguf, bed.work, kv, ctx=n + TURN_TOKENS * (args.turns + 2) + 256)
    slot.srv.start()
    try:
        base = base_state(slot, args.states, config, n, model, args.seed)
        for run_no in range(args.runs):
            res.load.append(os.getloadavg())
            if run_no:
                slot.resume(base)  # every run starts from the same conversation
            bed.fresh_stores()  # a new conversation's bytes are all new to the store
            warm_up(bed)
            rnd = random.Random(f"{config}-{run_no}-{args.seed}-turns")
            name = f"{config}-c{run_no}"
            saves(bed, res, config, FIRST, run_no, lambda t, name=name: slot.save(t, name))
            res.sizes[config] = (bed.targets[0].dir / name).stat().st_size
            res.tokens[config] = slot.n_cached
            for _turn in range(args.turns):
                slot.next_turn(rnd)
                saves(bed, res, config, NEXT, run_no, lambda t, name=name: slot.save(t, name))
                t1 = args.states / f"{config}.t1"
                if not t1.exists():
                    copy_file(bed.targets[0].dir / name, t1)
                    with open(args.states / "README", "a") as f:
                        f.write(f"{t1.name}: {t1.stat().st_size} bytes; {config} + {TURN_TOKENS} tokens "
                                f"+ {N_PREDICT} generated (its next turn)\n")  # fmt: skip
            copy_file(bed.targets[0].dir / name, bed.targets[1].read_dir / name)
            restores(bed, res, config, run_no, lambda t, name=name: slot.restore(t, name))
            verify(bed, res, name)
            drop_kept(bed, name)
            print(f"{config} run {run_no + 1}: " + run_line(res, config), flush=True)
    finally:
        slot.srv.stop()


def drop_kept(bed: Bed, name: str) -> None:
    """The keeping nullfs holds files in memory: only the current one is needed."""
    (bed.targets[1].read_dir / name).unlink(missing_ok=True)


def run_line(res: Results, config: str) -> str:
    parts = []
    for op, by in res.samples[config].items():
        parts.append(f"{op} " + " ".join(f"{t} {s[-1].ms:.1f}" for t, s in by.items()))
    return "; ".join(parts) + " ms"


# -- replay mode ---------------------------------------------------------------------------


def pieces(data: bytes) -> list[tuple[int, int]]:
    """(offset, length) of the writes llama-server makes for this file: header and tokens, then one
    per K/V block (its 12-byte type/row header separately), then whatever follows the KV section."""
    info = ggsq.parse_state(data)
    cuts = [0, info.kv_offset]
    for b in info.blocks:
        cuts += [b.offset - 12, b.offset, b.end]
    cuts.append(len(data))
    cuts = sorted(set(cuts))
    return [(a, b - a) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


@dataclass
class StateFile:
    label: str
    data: bytes
    next: bytes | None

    @staticmethod
    def load(path: Path) -> StateFile:
        nxt = path.with_name(path.name + ".t1")
        return StateFile(path.name, path.read_bytes(), nxt.read_bytes() if nxt.exists() else None)


def replay_save(path: Path, data: bytes) -> float:
    t0 = time.perf_counter()
    view = memoryview(data)
    with open(path.with_name(path.name + ".tmp"), "wb") as f:  # buffered by st_blksize, as stdio
        for off, n in pieces(data):
            f.write(view[off : off + n])
    ms = (time.perf_counter() - t0) * 1e3
    os.rename(path.with_name(path.name + ".tmp"), path)
    return ms


def replay_restore(path: Path, data: bytes) -> float:
    t0 = time.perf_counter()
    with open(path, "rb") as f:  # the probe: header and token count
        f.seek(0, os.SEEK_END)
        f.seek(0)
        head = f.read(12)
    parts = pieces(data)
    buf = memoryview(bytearray(max(n for _off, n in parts)))  # llama-server reuses one buffer too
    got = 0
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(0)
        for _off, n in parts:
            got += f.readinto(buf[:n])
    ms = (time.perf_counter() - t0) * 1e3
    if head != data[:12] or size != len(data) or got != len(data):
        raise RuntimeError(f"{path}: short or wrong read")
    return ms


def replay(bed: Bed, res: Results, args: argparse.Namespace, files: list[StateFile]) -> None:
    for f in files:
        res.sizes[f.label] = len(f.data)
        res.tokens[f.label] = len(ggsq.parse_state(f.data).tokens)
    for run_no in range(args.runs):
        res.load.append(os.getloadavg())
        bed.fresh_stores()
        warm_up(bed)
        for f in files:
            saves(bed, res, f.label, FIRST, run_no, lambda t, f=f: replay_save(t.dir / f.label, f.data))
            if f.next is not None:
                saves(bed, res, f.label, NEXT, run_no, lambda t, f=f: replay_save(t.dir / f.label, f.next))
        for f in files:
            content = f.next if f.next is not None else f.data
            copy_file(bed.targets[0].dir / f.label, bed.targets[1].read_dir / f.label)
            restores(bed, res, f.label, run_no, lambda t, f=f, c=content: replay_restore(t.read_dir / f.label, c))
            verify(bed, res, f.label)
            drop_kept(bed, f.label)
        print(f"run {run_no + 1}: " + " | ".join(f"{f.label}: {run_line(res, f.label)}" for f in files), flush=True)


# -- summary -------------------------------------------------------------------------------


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def summarize(res: Results, cache_size: int) -> dict:
    out: dict = {"configs": {}, "load_avg_at_runs": res.load, "checks": res.checks, "cache_size": cache_size}
    for config, by_op in res.samples.items():
        c: dict = {"size_bytes": res.sizes.get(config), "tokens": res.tokens.get(config), "ops": {}}
        for op, by_t in by_op.items():
            e: dict = {}
            for t, ss in by_t.items():
                e[t] = {"ms": stats([s.ms for s in ss]), "wall_ms": stats([s.wall_ms for s in ss])}
                cpus = [s.cpu_ms for s in ss if s.cpu_ms is not None]
                if cpus:
                    e[t]["cpu_ms"] = stats(cpus)
                peaks = [float(s.rss_peak) for s in ss if s.rss_peak is not None]
                if peaks:
                    e[t]["rss_peak_bytes"] = stats(peaks)
            for fs in (FS, FS2):
                if fs in e:
                    e[f"{fs}/plain"] = e[fs]["ms"]["median"] / e[PLAIN]["ms"]["median"]
                    e[f"{fs}/floor"] = e[fs]["ms"]["median"] / e[FLOOR]["ms"]["median"]
            e["floor/plain"] = e[FLOOR]["ms"]["median"] / e[PLAIN]["ms"]["median"]
            if PFLOOR in e:
                e["pt-floor/plain"] = e[PFLOOR]["ms"]["median"] / e[PLAIN]["ms"]["median"]
                for fs in (FS, FS2):
                    if fs in e:
                        e[f"{fs}/pt-floor"] = e[fs]["ms"]["median"] / e[PFLOOR]["ms"]["median"]
            if PASS in e:
                e["pass/plain"] = e[PASS]["ms"]["median"] / e[PLAIN]["ms"]["median"]
            c["ops"][op] = e
        out["configs"][config] = c
    return out


def _cell(e: dict, t: str) -> str:
    m = e[t]["ms"]
    return f"{m['median']:.1f} ({m['min']:.0f}–{m['max']:.0f})"


def _verdict(op: str, e: dict, fs: str) -> str:
    against, limit = TARGETS_MET[op]
    r = e[f"{fs}/{against}"]
    return f"{r:.2f}x {against} ({'met' if r <= limit else 'missed'}: ≤ {limit}x)"


def report(s: dict) -> str:
    fss = [fs for fs in (FS, FS2) if any(fs in op for c in s["configs"].values() for op in c["ops"].values())]
    lines = []
    name = {fs: s.get("labels", {}).get(fs, fs) for fs in fss}
    head = ["config", "op", "plain ms", "floor ms", "pt-floor ms", "pass-through ms", *[f"{name[fs]} ms" for fs in fss],
            *[f"{name[fs]} vs target" for fs in fss], *[f"{name[fs]}/pt-floor" for fs in fss], "floor/plain",
            "pt-floor/plain", "pass-through/plain", *[f"{name[fs]} CPU ms" for fs in fss]]  # fmt: skip
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for config, c in s["configs"].items():
        label = f"{config} ({c['size_bytes'] / MiB:.1f} MiB, {c['tokens']} tok)"
        for op in OPS:
            e = c["ops"].get(op)
            if e is None:
                continue
            cpu = [f"{e[fs]['cpu_ms']['median']:.0f}" if "cpu_ms" in e[fs] else "" for fs in fss]
            passed = (_cell(e, PASS), f"{e['pass/plain']:.2f}x") if PASS in e else ("", "")
            pf = PFLOOR in e
            cells = [label, op, _cell(e, PLAIN), _cell(e, FLOOR), _cell(e, PFLOOR) if pf else "", passed[0],
                     *[_cell(e, fs) for fs in fss], *[_verdict(op, e, fs) for fs in fss],
                     *[f"{e[f'{fs}/pt-floor']:.2f}x" if pf else "" for fs in fss], f"{e['floor/plain']:.2f}x",
                     f"{e['pt-floor/plain']:.2f}x" if pf else "", passed[1], *cpu]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
            label = ""
    lines.append("")
    lines.append("medians (min–max) over runs, ms; plain/floor/kv-chunk-fs interleaved, order balanced over runs;")
    lines.append("pass-through: restores only, the plain files served from disk by nullfs, one pread per read;")
    lines.append("pt-floor: nullfs passing each file through to one on a huge-page tmpfs (saves and hot restores)")
    limit = s["cache_size"] + 64 * MiB
    for config, c in s["configs"].items():
        cold = c["ops"].get(COLD, {})
        for fs in fss:
            if fs in cold and "rss_peak_bytes" in cold[fs]:
                peak = cold[fs]["rss_peak_bytes"]["max"]
                ok = "met" if peak <= limit or c["size_bytes"] < 100 * MiB else "missed"
                lines.append(f"{config}: {name[fs]} peak RSS during cold restore {peak / MiB:.0f} MiB "
                             f"(cache_size + 64 MiB = {limit / MiB:.0f} MiB: {ok})")  # fmt: skip
    loads = s["load_avg_at_runs"]
    if loads:
        l1 = [x[0] for x in loads]
        lines.append(f"1-min load average at the start of runs: median {statistics.median(l1):.2f}, "
                     f"{min(l1):.2f}–{max(l1):.2f} (2 CPUs)")  # fmt: skip
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------


def iter_configs(spec: str) -> Iterator[str]:
    for c in spec.split(","):
        if c not in CONFIGS:
            sys.exit(f"unknown config {c!r}; choose from {', '.join(CONFIGS)}")
        yield c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = f"llama-server mode: which, of {', '.join(CONFIGS)} (default: all)"
    p.add_argument("--configs", default=",".join(CONFIGS), help=which)
    p.add_argument("--files", nargs="+", type=Path, help="replay these state files instead (F.t1: F's next turn)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--turns", type=int, default=2, help="next-turn saves per run (llama-server mode)")
    p.add_argument("--dir", default="/var/tmp", help="where the plain files and the stores go (same disk)")
    p.add_argument("--mount-args", default="", help="extra flags for kv-chunk-fs mount (default: none)")
    p.add_argument("--compare-src", type=Path, help="also measure kv-chunk-fs from this src/ (another tree)")
    p.add_argument("--compare-label", default="compare", help="its name in the table")
    p.add_argument("--states", type=Path, default=cache_dir() / "states",
                   help="conversations reused across runs (CONFIG, and CONFIG.t1 a turn later; prefilled if "
                   "missing); --files takes them. Default: %(default)s")  # fmt: skip
    p.add_argument("--seed", default="0", help="varies the random conversations")
    p.add_argument("--json", type=Path, help="write all figures here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (stores, logs)")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (drop_caches, FUSE)")
    signal.signal(signal.SIGTERM, bench.on_sigterm)
    work = Path(tempfile.mkdtemp(prefix="kvcfs-real-", dir=args.dir))
    bed = Bed(work, args.mount_args.split(), args.compare_src.resolve() if args.compare_src else None)
    res = Results()
    try:
        bed.setup()
        if args.files:
            replay(bed, res, args, [StateFile.load(f) for f in args.files if not f.name.endswith((".t1", "README"))])
        else:
            binary = ensure_llama_server()
            for config in iter_configs(args.configs):
                llama_config(bed, res, args, config, binary)
    finally:
        bed.teardown()
        if args.keep:
            print(f"kept {work}")
        else:
            bench.remove_work(work)
    s = summarize(res, bench.mount_config(args.mount_args.split()).cache_size)
    s["command"] = " ".join(sys.argv)
    s["labels"] = {FS2: args.compare_label}
    print()
    print(report(s))
    if args.json:
        args.json.write_text(json.dumps(s, indent=2))


if __name__ == "__main__":
    main()
