"""Save and restore a snapshot-sized file through kv-chunk-fs and to a plain directory.

Both targets live on the same disk and are measured in the same run, interleaved A/B, several
runs; medians and fs/plain ratios are printed. "cold" drops the page cache (and remounts, which
empties the daemon's chunk cache); "warm" reads again right away.

    python3 benchmarks/bench.py                    # 415 MiB, 5 runs
    python3 benchmarks/bench.py --size 100MiB --runs 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kvchunkfs.units import parse_size  # noqa: E402
from kvchunkfs.format.chunker import Chunker, chunk_id  # noqa: E402

MiB = 1 << 20
TURN_NEW = 8 * MiB  # new bytes in a "next turn" save (a few hundred tokens of a mid-size model)
PIECE = MiB  # llama-server writes tensors through stdio with a 1 MiB buffer (st_blksize)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def is_mounted(path: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(path) for line in f)


class Daemon:
    def __init__(self, store: Path, mnt: Path, log: Path, extra: list[str]) -> None:
        self.store, self.mnt, self.log, self.extra = store, mnt, log, extra
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.mnt.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(self.store), *self.extra,
                 str(self.mnt)],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        deadline = time.monotonic() + 30
        while not is_mounted(self.mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mount failed, see {self.log}")
            time.sleep(0.05)
        time.sleep(0.3)  # let the daemon tune the bdi (read-ahead) before timing

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mnt)], check=False)
        if self.proc is not None:
            self.proc.wait(timeout=60)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def save(path: Path, data: memoryview) -> None:
    with open(path, "wb") as f:
        for i in range(0, len(data), PIECE):
            f.write(data[i : i + PIECE])


def restore(path: Path) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(PIECE):
            n += len(chunk)
    return n


def make_snapshot(size: int) -> bytes:
    """Random bytes: every save is new data, no help from dedup (the worst case for saving)."""
    return os.urandom(size)


def chunk_hash_throughput(data: bytes) -> float:
    """MB/s of cutting and hashing in one thread, as the writer's worker does."""
    c = Chunker(16 << 10, 64 << 10, 256 << 10)
    t = time.perf_counter()
    for p in c.cut(data):
        chunk_id(p)
    return len(data) / (time.perf_counter() - t) / 1e6


def run(args: argparse.Namespace) -> dict:
    size = parse_size(args.size)
    base = Path(args.dir)
    work = Path(tempfile.mkdtemp(prefix="kvcfs-bench-", dir=base))
    plain, store, mnt = work / "plain", work / "store", work / "mnt"
    plain.mkdir()
    daemon = Daemon(store, mnt, work / "daemon.log", args.mount_args.split())
    kinds = ("save", "save_turn", "cold", "warm")
    results: dict[str, dict[str, list[float]]] = {k: {"fs": [], "plain": []} for k in kinds}
    throughput = []
    try:
        daemon.start()
        for run_no in range(args.runs):
            data = memoryview(make_snapshot(size))
            throughput.append(chunk_hash_throughput(bytes(data)))
            order = [("fs", mnt), ("plain", plain)] if run_no % 2 == 0 else [("plain", plain), ("fs", mnt)]
            name = f"snap{run_no}"
            # The next turn: the same state plus new tokens' worth of bytes, saved as a new file.
            turn = memoryview(bytes(data) + os.urandom(TURN_NEW))
            for kind, d in order:
                drop_caches()
                results["save"][kind].append(timed(lambda p=d / name, b=data: save(p, b)))
                drop_caches()
                results["save_turn"][kind].append(timed(lambda p=d / f"{name}.turn", b=turn: save(p, b)))
            daemon.stop()  # empties the daemon's chunk cache for the cold restore
            daemon.start()
            for kind, d in order:
                drop_caches()
                results["cold"][kind].append(timed(lambda p=d / name: restore(p)))
                results["warm"][kind].append(timed(lambda p=d / name: restore(p)))
            for _kind, d in order:
                assert (d / name).stat().st_size == size
            print(f"run {run_no + 1}/{args.runs}: " + ", ".join(
                f"{k} fs {v['fs'][-1]:.3f}s plain {v['plain'][-1]:.3f}s" for k, v in results.items()), flush=True)
    finally:
        daemon.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary = {"size_bytes": size, "runs": args.runs, "chunk_hash_MBps_median": statistics.median(throughput)}
    for k, v in results.items():
        fs, pl = statistics.median(v["fs"]), statistics.median(v["plain"])
        summary[k] = {"fs_median_s": fs, "plain_median_s": pl, "ratio": fs / pl, "fs_all": v["fs"],
                      "plain_all": v["plain"]}
    return summary


def report(s: dict) -> str:
    mib = s["size_bytes"] / MiB
    lines = [f"{mib:.0f} MiB snapshot, {s['runs']} interleaved runs, medians", "",
             f"{'':14}{'kv-chunk-fs':>14}{'plain':>10}{'ratio':>8}{'fs MiB/s':>10}"]
    names = {"save": "save (new)", "save_turn": "save (turn)", "cold": "restore cold", "warm": "restore warm"}
    for k, label in names.items():
        r = s[k]
        lines.append(f"{label:14}{r['fs_median_s']:>13.3f}s{r['plain_median_s']:>9.3f}s{r['ratio']:>7.2f}x"
                     f"{mib / r['fs_median_s']:>10.0f}")
    lines.append(f"chunk+hash (1 thread): {s['chunk_hash_MBps_median']:.0f} MB/s")
    lines.append("save (new): every byte new to the store; save (turn): the same state plus "
                 f"{TURN_NEW // MiB} MiB of new bytes, written as a new file (the next turn)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="415MiB")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--dir", default="/var/tmp", help="where plain files and the store go (same disk)")
    p.add_argument("--mount-args", default="", help="extra flags for kv-chunk-fs mount")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (store, daemon log)")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (drop_caches, FUSE)")
    s = run(args)
    print()
    print(report(s))
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=2))


if __name__ == "__main__":
    main()
