"""Save and restore a snapshot-sized file: plain directory, nullfs (the FUSE floor) and kv-chunk-fs.

The three targets are measured in the same run, interleaved (the order rotates every run), several
runs; medians and ratios are printed. nullfs (benchmarks/nullfs.py) is a filesystem on kv-chunk-fs's
front end, with its mount options and loop, whose handlers do nothing: what is left between it and
plain is the front end's cost, between kv-chunk-fs and it the store's. The plain directory and the
store live on the same disk. ``--baseline-src`` adds kv-chunk-fs from another tree (and that tree's
nullfs, "baseline floor"); ``--passthrough-floor`` a nullfs whose files the kernel serves from disk
itself (kernel passthrough: the floor of a file the daemon never sees a byte of).

Operations: save of all-new bytes; the same bytes saved again under a new name (every chunk already
stored); a "next turn" (the same state plus 8 MiB new, as a new file); cold restore (page cache
dropped, kv-chunk-fs remounted so its chunk cache is empty); warm restore (read again right away).
The page cache is dropped before every save too. Also measured: kv-chunk-fs's (and nullfs's) daemon
CPU time per GB moved, and their peak RSS during the cold restore.

    python3 benchmarks/bench.py                    # 415 MiB, 5 runs
    python3 benchmarks/bench.py --size 100MiB --runs 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(1, str(ROOT))  # e2e.ggsq: synthetic state files (--state)

from kvchunkfs import config as cfgmod  # noqa: E402
from kvchunkfs.cli.main import build_parser  # noqa: E402
from kvchunkfs.format.chunker import Chunker, chunk_id  # noqa: E402
from kvchunkfs.store import tierdir  # noqa: E402

MiB = 1 << 20
GB = 1e9
TURN_NEW = 8 * MiB  # new bytes in a "next turn" save (a few hundred tokens of a mid-size model)
PIECE = MiB  # llama-server writes tensors through stdio with a 1 MiB buffer (st_blksize)
CLK_TCK = os.sysconf("SC_CLK_TCK")
RSS_INTERVAL = 0.02
READY_TIMEOUT = 60.0

PLAIN, NULL, FS, BASE = "plain", "nullfs", "kv-chunk-fs", "baseline"
BASE_NULL, PASS_NULL = "baseline floor", "passthrough floor"
SAVES = {"save": "save (new)", "save_dup": "save (stored)", "save_turn": "save (turn)"}
RESTORES = {"cold": "restore cold", "warm": "restore warm"}
OPS = {**SAVES, **RESTORES}


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def is_mounted(path: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(path) for line in f)


def bdi_read_ahead_kb(path: Path) -> int:
    st = os.stat(path)
    return int(Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb").read_text())


def cpu_seconds(pid: int) -> float:
    """utime + stime of all the process's threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15, counted from after "(comm)"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_for(what: str, ready: Callable[[], bool], alive: Callable[[], bool], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while not ready():
        if not alive() or time.monotonic() > deadline:
            tail = log.read_text(errors="replace").splitlines()[-10:] if log.exists() else []
            raise RuntimeError("\n".join([f"{what}: not ready; end of {log}:", *tail]))
        time.sleep(0.02)


class Mount:
    """A FUSE daemon run as a subprocess; stop() always leaves the mountpoint unmounted."""

    def __init__(
        self, argv: list[str], mnt: Path, log: Path, readahead_kb: int, ready_line: str | None, src: Path = ROOT / "src"
    ) -> None:
        self.argv, self.mnt, self.log, self.src = argv, mnt, log, src
        self.readahead_kb, self.ready_line = readahead_kb, ready_line
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _log_count(self) -> int:
        if self.ready_line is None or not self.log.exists():
            return 0
        return self.log.read_text(errors="replace").count(self.ready_line)

    def start(self) -> None:
        self.mnt.mkdir(parents=True, exist_ok=True)
        seen = self._log_count()
        env = dict(os.environ, PYTHONPATH=str(self.src))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        alive = self._alive
        wait_for(f"mount {self.mnt}", lambda: is_mounted(self.mnt), alive, self.log)
        if self.readahead_kb > 0:  # timing starts once the daemon has tuned the bdi
            wait_for("read_ahead_kb", lambda: bdi_read_ahead_kb(self.mnt) == self.readahead_kb, alive, self.log)
        if self.ready_line is not None:  # e.g. kv-chunk-fs's GC at mount, which would overlap the restore
            wait_for(self.ready_line, lambda: self._log_count() > seen, alive, self.log)

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if is_mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", str(self.mnt)], check=False)
        elif self._alive():  # not mounted (yet): its SIGTERM handler unmounts if the mount comes up
            self.proc.terminate()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if is_mounted(self.mnt):  # a killed or stuck daemon: detach whatever is left
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], check=False)

    def restart(self) -> None:
        self.stop()
        self.start()


@dataclass
class Target:
    name: str
    dir: Path
    mount: Mount | None = None


@dataclass
class Sample:
    seconds: float
    cpu: float | None = None  # daemon CPU seconds during the operation
    rss_start: int | None = None
    rss_peak: int | None = None


class RssSampler:
    """Peak VmRSS of a process, sampled from a thread while the operation runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = self.peak = rss_bytes(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(RSS_INTERVAL):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes(self.pid))


def measure(target: Target, fn: Callable[[], object], rss: bool = False) -> Sample:
    if target.mount is None:
        return Sample(timed(fn))
    pid = target.mount.pid
    cpu = cpu_seconds(pid)
    if rss:
        with RssSampler(pid) as sampler:
            seconds = timed(fn)
        return Sample(seconds, cpu_seconds(pid) - cpu, sampler.start, sampler.peak)
    seconds = timed(fn)
    return Sample(seconds, cpu_seconds(pid) - cpu)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def save(path: Path, data: memoryview) -> None:
    with open(path, "wb") as f:
        for i in range(0, len(data), PIECE):
            f.write(data[i : i + PIECE])


def restore(path: Path, size: int) -> None:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(PIECE):
            n += len(chunk)
    if n != size:
        raise RuntimeError(f"{path}: read {n} bytes, expected {size}")


def make_snapshot(size: int, state: bool) -> tuple[bytes, bytes]:
    """(snapshot, next turn). Random bytes: every save is new data, no help from dedup (the worst
    case for saving); the turn adds TURN_NEW random bytes at the end. ``state``: a llama.cpp state
    file instead (e2e/ggsq.py: 32 layers, 1 KiB rows, fresh contents every run), the turn the same
    conversation TURN_NEW bytes of KV later (its rows land at the end of every K and V block)."""
    if not state:
        data = os.urandom(size)
        return data, data + os.urandom(TURN_NEW)
    from e2e import ggsq

    spec = ggsq.Spec(n_layer=32, row_bytes=1024, seed=os.urandom(8))
    per = spec.bytes_per_token
    tokens = ggsq.synthetic_tokens(size // per, seed=int.from_bytes(os.urandom(4)))
    more = tokens + ggsq.synthetic_tokens(TURN_NEW // per, seed=int.from_bytes(os.urandom(4)))
    return ggsq.synthetic_bytes(tokens, spec), ggsq.synthetic_bytes(more, spec)


def chunk_hash_throughput(data: bytes) -> float:
    """MB/s of cutting and hashing in one thread, as the writer's worker does."""
    c = Chunker(16 << 10, 64 << 10, 256 << 10)
    t = time.perf_counter()
    for p in c.cut(data):
        chunk_id(p)
    return len(data) / (time.perf_counter() - t) / 1e6


def mount_config(extra: list[str]) -> cfgmod.Config:
    """kv-chunk-fs's effective settings with these flags: nullfs copies the ones the kernel sees."""
    return cfgmod.load(build_parser().parse_args(["mount", *extra, "MOUNTPOINT"]))


def make_targets(
    work: Path,
    extra: list[str],
    baseline_src: Path | None = None,
    baseline_extra: list[str] | None = None,
    passthrough_floor: bool = False,
) -> list[Target]:
    cfg = mount_config(extra)
    py = sys.executable
    fs_argv = [py, "-m", "kvchunkfs.cli", "mount", "--store", str(work / "store"), *extra, str(work / "mnt")]
    null_argv = [
        py,
        str(ROOT / "benchmarks" / "nullfs.py"),
        "--kernel-readahead-kb",
        str(cfg.kernel_readahead_kb),
        "--no-writeback-cache",  # as kv-chunk-fs: the kernel never caches writes
        str(work / "null"),
    ]
    (work / PLAIN).mkdir()
    return [
        Target(PLAIN, work / PLAIN),
        Target(
            NULL, work / "null", Mount(null_argv, work / "null", work / "nullfs.log", cfg.kernel_readahead_kb, None)
        ),
        Target(
            FS, work / "mnt", Mount(fs_argv, work / "mnt", work / "daemon.log", cfg.kernel_readahead_kb, "gc finished")
        ),
        *_baseline(work, extra if baseline_extra is None else baseline_extra, cfg.kernel_readahead_kb, baseline_src),
        *_more_floors(work, null_argv, baseline_src, passthrough_floor, cfg.kernel_readahead_kb),
    ]


def _more_floors(
    work: Path, null_argv: list[str], baseline_src: Path | None, passthrough: bool, readahead_kb: int
) -> list[Target]:
    """The baseline tree's nullfs (its front end's floor), and a nullfs passing its files through."""
    out = []
    base_null = baseline_src.resolve().parent / "benchmarks" / "nullfs.py" if baseline_src else None
    if base_null is not None and baseline_src is not None and base_null.exists():
        argv = [null_argv[0], str(base_null), *null_argv[2:-1], str(work / "base-null")]
        mount = Mount(argv, work / "base-null", work / "base-nullfs.log", readahead_kb, None, src=baseline_src)
        out.append(Target(BASE_NULL, work / "base-null", mount))
    if passthrough:
        (work / "pass-back").mkdir()
        argv = [*null_argv[:-1], "--backing", str(work / "pass-back"), "--passthrough", str(work / "pass")]
        mount = Mount(argv, work / "pass", work / "pass-nullfs.log", readahead_kb, "passthrough mode")
        out.append(Target(PASS_NULL, work / "pass", mount))
    return out


def _baseline(work: Path, extra: list[str], readahead_kb: int, src: Path | None) -> list[Target]:
    """kv-chunk-fs from another source tree (e.g. an older commit), with its own store: before/after
    in one interleaved run."""
    if src is None:
        return []
    argv = [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(work / "base-store"), *extra,
            str(work / "base")]  # fmt: skip
    return [Target(BASE, work / "base", Mount(argv, work / "base", work / "baseline.log", readahead_kb,
                                               "gc finished", src=src))]  # fmt: skip


@dataclass
class Results:
    size: int
    state: bool = False  # llama.cpp state files instead of random bytes
    samples: dict[str, dict[str, list[Sample]]] = field(default_factory=dict)
    orders: list[list[str]] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)

    def add(self, op: str, target: str, s: Sample) -> None:
        self.samples.setdefault(op, {}).setdefault(target, []).append(s)

    def last(self, op: str, target: str) -> float:
        return self.samples[op][target][-1].seconds


def one_run(run_no: int, targets: list[Target], fs: list[Mount], res: Results) -> None:
    first, second = make_snapshot(res.size, res.state)
    data, turn = memoryview(first), memoryview(second)
    size = len(first)  # a state file is whole tokens long, not exactly --size
    res.throughput.append(chunk_hash_throughput(first))
    k = run_no % len(targets)
    order = targets[k:] + targets[:k]
    res.orders.append([t.name for t in order])
    name = f"snap{run_no}"
    saves = (("save", name, data), ("save_dup", f"{name}.dup", data), ("save_turn", f"{name}.turn", turn))
    for op, fname, buf in saves:
        for t in order:
            drop_caches()
            res.add(op, t.name, measure(t, lambda p=t.dir / fname, b=buf: save(p, b)))
    for m in fs:
        m.restart()  # empties the daemon's chunk cache for the cold restore
    for t in order:
        drop_caches()
        res.add("cold", t.name, measure(t, lambda p=t.dir / name: restore(p, size), rss=True))
        res.add("warm", t.name, measure(t, lambda p=t.dir / name: restore(p, size)))
    print(
        f"run {run_no + 1} ({', '.join(res.orders[-1])}): "
        + "; ".join(f"{op} " + " ".join(f"{t.name} {res.last(op, t.name):.3f}s" for t in targets) for op in OPS),
        flush=True,
    )


def remove_work(work: Path) -> None:
    """Delete a benchmark's work directory, then the memory tiers of the stores that were in it
    (a daemon stopped with ``memory_tier_on_stop = keep`` leaves its tier mounted)."""
    shutil.rmtree(work, ignore_errors=True)
    for root, why, freed in tierdir.sweep():
        print(f"freed memory tier {root} ({why}, {freed >> 20} MiB)", file=sys.stderr)


def run(args: argparse.Namespace) -> dict:
    size = cfgmod.parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="kvcfs-bench-", dir=Path(args.dir)))
    res = Results(size, args.state)
    targets: list[Target] = []
    try:
        base_extra = None if args.baseline_mount_args is None else args.baseline_mount_args.split()
        targets = make_targets(work, args.mount_args.split(), args.baseline_src, base_extra, args.passthrough_floor)
        for t in targets:
            if t.mount is not None:
                t.mount.start()
        fs = [t.mount for t in targets if t.name in (FS, BASE) and t.mount is not None]
        for run_no in range(args.runs):
            one_run(run_no, targets, fs, res)
    finally:
        for t in targets:
            if t.mount is not None:
                t.mount.stop()
        if not args.keep:
            remove_work(work)
        else:
            print(f"kept {work}")
    return summarize(res, args.runs)


def op_bytes(op: str, size: int) -> int:
    return size + TURN_NEW if op == "save_turn" else size


def summarize(res: Results, runs: int) -> dict:
    s: dict = {
        "size_bytes": res.size,
        "runs": runs,
        "orders": res.orders,
        "chunk_hash_MBps_median": statistics.median(res.throughput),
        "ops": {},
    }
    for op, by_target in res.samples.items():
        entry: dict = {}
        for name, samples in by_target.items():
            secs = [x.seconds for x in samples]
            t: dict = {"median_s": statistics.median(secs), "all_s": secs}
            cpus = [x.cpu for x in samples if x.cpu is not None]
            if cpus:
                t["cpu_s_per_GB_median"] = statistics.median(cpus) / (op_bytes(op, res.size) / GB)
                t["cpu_s_all"] = cpus
            peaks = [x.rss_peak for x in samples if x.rss_peak is not None]
            if peaks:
                t["rss_peak_bytes_median"] = statistics.median(peaks)
                t["rss_start_bytes_median"] = statistics.median(x.rss_start for x in samples if x.rss_start)
                t["rss_peak_bytes_all"] = peaks
            entry[name] = t
        fs, null, plain = (entry[n]["median_s"] for n in (FS, NULL, PLAIN))
        entry["ratio_vs_plain"] = fs / plain
        entry["ratio_vs_floor"] = fs / null
        entry["floor_vs_plain"] = null / plain
        if BASE in entry:
            entry["ratio_vs_baseline"] = fs / entry[BASE]["median_s"]
        if BASE_NULL in entry:
            entry["floor_vs_baseline_floor"] = null / entry[BASE_NULL]["median_s"]
        if PASS_NULL in entry:
            entry["passthrough_floor_vs_plain"] = entry[PASS_NULL]["median_s"] / plain
        s["ops"][op] = entry
    return s


COLUMNS = (PLAIN, NULL, FS, "fs/plain", "fs/floor", "floor/plain", "fs CPU s/GB", "floor CPU s/GB")
WIDTHS = (9, 9, 12, 10, 10, 12, 13, 16)


def _row(label: str, cells: list[str]) -> str:
    return f"{label:15}" + "".join(f"{c:>{w}}" for c, w in zip(cells, WIDTHS, strict=True))


def _op_row(label: str, e: dict) -> str:
    times = [f"{e[n]['median_s']:.3f}s" for n in (PLAIN, NULL, FS)]
    ratios = [f"{e[k]:.2f}x" for k in ("ratio_vs_plain", "ratio_vs_floor", "floor_vs_plain")]
    cpu = [f"{e[n]['cpu_s_per_GB_median']:.2f}" for n in (FS, NULL)]
    return _row(label, times + ratios + cpu)


def _notes(s: dict) -> list[str]:
    cold = s["ops"]["cold"]
    peak = {n: cold[n]["rss_peak_bytes_median"] / MiB for n in (FS, NULL)}
    start = {n: cold[n]["rss_start_bytes_median"] / MiB for n in (FS, NULL)}
    rss = ", ".join(f"{n} {peak[n]:.0f} MiB (at its start {start[n]:.0f})" for n in (FS, NULL))
    return [
        f"daemon peak RSS during the cold restore: {rss}",
        f"chunk+hash (1 thread): {s['chunk_hash_MBps_median']:.0f} MB/s",
        "save (new): every byte new to the store; save (stored): the same bytes again under a new name;",
        f"save (turn): the same state plus {TURN_NEW // MiB} MiB new, as a new file. floor = nullfs.",
        f"CPU: daemon utime+stime per GB (1e9 bytes) of the file, counted in 1/{CLK_TCK} s ticks.",
    ]


def _baseline_rows(s: dict) -> list[str]:
    """kv-chunk-fs against the baseline tree, when one was measured."""
    if "ratio_vs_baseline" not in s["ops"]["cold"]:
        return []
    lines = [
        "",
        f"{'':15}{'baseline':>12}{'kv-chunk-fs':>12}{'fs/baseline':>13}{'base CPU s/GB':>15}{'fs CPU s/GB':>13}",
    ]
    for op, label in OPS.items():
        e = s["ops"][op]
        lines.append(
            f"{label:15}{e[BASE]['median_s']:>11.3f}s{e[FS]['median_s']:>11.3f}s{e['ratio_vs_baseline']:>12.2f}x"
            f"{e[BASE]['cpu_s_per_GB_median']:>15.2f}{e[FS]['cpu_s_per_GB_median']:>13.2f}"
        )
    cold = s["ops"]["cold"]
    lines.append(f"baseline peak RSS during the cold restore: {cold[BASE]['rss_peak_bytes_median'] / MiB:.0f} MiB")
    return lines


def _floor_rows(s: dict) -> list[str]:
    """The floors beside nullfs, when measured: the baseline tree's, and kernel passthrough."""
    cold = s["ops"]["cold"]
    lines = []
    if "floor_vs_baseline_floor" in cold:
        lines += ["", f"{'':15}{'base floor':>12}{'floor':>12}{'floor/base':>12}{'base CPU s/GB':>15}{'CPU s/GB':>10}"]
        for op, label in OPS.items():
            e = s["ops"][op]
            lines.append(f"{label:15}{e[BASE_NULL]['median_s']:>11.3f}s{e[NULL]['median_s']:>11.3f}s"
                         f"{e['floor_vs_baseline_floor']:>11.2f}x{e[BASE_NULL]['cpu_s_per_GB_median']:>15.2f}"
                         f"{e[NULL]['cpu_s_per_GB_median']:>10.2f}")  # fmt: skip
    if "passthrough_floor_vs_plain" in cold:
        lines += ["", f"{'':15}{'plain':>10}{'passthrough':>13}{'pass/plain':>12}{'CPU s/GB':>10}"]
        for op, label in OPS.items():
            e = s["ops"][op]
            cpu = e[PASS_NULL]["cpu_s_per_GB_median"]
            lines.append(f"{label:15}{e[PLAIN]['median_s']:>9.3f}s{e[PASS_NULL]['median_s']:>12.3f}s"
                         f"{e['passthrough_floor_vs_plain']:>11.2f}x{cpu:>10.2f}")  # fmt: skip
    return lines


def report(s: dict) -> str:
    mib = s["size_bytes"] / MiB
    title = f"{mib:.0f} MiB snapshot, {s['runs']} runs, targets interleaved (order rotated per run), medians"
    rows = [_op_row(label, s["ops"][op]) for op, label in OPS.items()]
    return "\n".join([title, "", _row("", list(COLUMNS)), *rows, *_baseline_rows(s), *_floor_rows(s), "",
                      *_notes(s)])  # fmt: skip


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through run()'s finally, which unmounts


BLKIO = Path("/sys/fs/cgroup/blkio")


def throttle_reads(directory: Path, bps: int) -> None:
    """Move this process (and so every daemon it starts) into a blkio cgroup whose reads of
    ``directory``'s disk are throttled to ``bps``: both plain files and packs then come off a slow
    disk, cold. cgroup v1 (this machine); the cgroup stays for the next run."""
    dev = os.stat(directory).st_dev
    group = BLKIO / "kvcfs-bench"
    group.mkdir(exist_ok=True)
    (group / "blkio.throttle.read_bps_device").write_text(f"{os.major(dev)}:{os.minor(dev)} {bps}\n")
    (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
    print(f"reads of {directory} throttled to {bps / 1e6:.0f} MB/s (blkio cgroup {group})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="415MiB")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument(
        "--state",
        action="store_true",
        help="save llama.cpp state files (32 layers, 1 KiB rows) instead of random bytes",
    )
    p.add_argument("--dir", default="/var/tmp", help="where plain files and the store go (same disk)")
    p.add_argument("--mount-args", default="", help="extra flags for kv-chunk-fs mount")
    p.add_argument("--baseline-src", type=Path, help="also measure kv-chunk-fs from this src/ (e.g. an older commit's)")
    p.add_argument(
        "--baseline-mount-args",
        help="the baseline's mount flags (default: --mount-args); "
        "with --baseline-src src, an A/B of a setting in one interleaved run",
    )
    p.add_argument("--passthrough-floor", action="store_true", help="also a nullfs the kernel passes through to disk")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (store, daemon logs)")
    p.add_argument(
        "--read-bps",
        help="throttle reads of --dir's disk to this many bytes/s (e.g. 200MB) for "
        "this process and the daemons it starts (cgroup v1 blkio): the disk-bound regime",
    )
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (drop_caches, FUSE)")
    signal.signal(signal.SIGTERM, on_sigterm)
    if args.read_bps:
        throttle_reads(Path(args.dir), cfgmod.parse_size(args.read_bps))
    s = run(args)
    print()
    print(report(s))
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=2))


if __name__ == "__main__":
    main()
