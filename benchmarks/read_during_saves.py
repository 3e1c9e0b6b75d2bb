"""How long a small read of one snapshot takes while another is saved back to back.

    python3 benchmarks/read_during_saves.py /var/tmp/kvstates/f16-30M --seconds 60
    python3 benchmarks/read_during_saves.py FILE --mount-args "--no-fuse-passthrough"

A fresh store is mounted with default settings. The state file is saved as ``b`` and stored.
Then, for ``--seconds``: one thread saves the file (and its next turn, ``FILE.t1``, alternately)
as ``a`` back to back, as the proxy does (``a.tmp``, written in 1 MiB pieces, then renamed over
``a``); another opens ``b`` every 20 ms, reads 4 KiB at a random offset, checks the bytes and
closes it. Reported: the read's latency (open to close; median, p99, worst) and the saves'
(median), next to the same read of a plain file on the store's disk beside the same saves. Half
of the reads drop the page cache first (``drop_caches``): a read then comes from ``b``'s whole
copy (memory) or the store, not from the kernel's cache of the mount.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(1, str(HERE))

import bench  # noqa: E402

MiB = 1 << 20
READ = 4096
PERIOD = 0.02


def stats(mnt: Path) -> dict[str, int]:
    return json.loads(os.getxattr(mnt, "user.kvcfs.stats"))


def save(path: Path, data: bytes) -> float:
    t0 = time.perf_counter()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        view = memoryview(data)
        for off in range(0, len(data), MiB):
            f.write(view[off : off + MiB])
    os.rename(tmp, path)
    return (time.perf_counter() - t0) * 1e3


def read_once(path: Path, want: bytes, rnd: random.Random, cold: bool) -> float:
    if cold:
        bench.drop_caches()
    off = rnd.randrange(0, len(want) - READ)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        got = os.pread(fd, READ, off)
    finally:
        os.close(fd)
    ms = (time.perf_counter() - t0) * 1e3
    if got != want[off : off + READ]:
        raise RuntimeError(f"{path}: wrong bytes at {off}")
    return ms


def run(target: Path, first: bytes, nxt: bytes, seconds: float) -> dict[str, list[float]]:
    save(target / "b", first)
    try:
        while stats(target).get("ingest_queue", 0):  # b stored before the clock starts
            time.sleep(0.05)
    except OSError:
        pass  # the plain directory
    stop = threading.Event()
    saves: list[float] = []

    def saver() -> None:
        turn = 0
        while not stop.is_set():
            saves.append(save(target / "a", nxt if turn % 2 else first))
            turn += 1

    t = threading.Thread(target=saver)
    t.start()
    rnd = random.Random(1)
    reads: list[float] = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            reads.append(read_once(target / "b", first, rnd, cold=len(reads) % 2 == 1))
            time.sleep(PERIOD)
    finally:
        stop.set()
        t.join()
    return {"reads": reads, "saves": saves}


def summary(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    return f"median {statistics.median(xs):.2f}, p99 {p99:.2f}, worst {xs[-1]:.2f} ms (n={len(xs)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", type=Path)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--mount-args", default="")
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    args = p.parse_args()
    first = args.file.read_bytes()
    t1 = args.file.with_name(args.file.name + ".t1")
    nxt = t1.read_bytes() if t1.exists() else first
    work = Path(tempfile.mkdtemp(prefix="kvcfs-reads-", dir=args.dir))
    plain, mnt, store = work / "plain", work / "mnt", work / "store"
    plain.mkdir()
    argv = [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(store), *args.mount_args.split(), str(mnt)]
    m = bench.Mount(argv, mnt, work / "daemon.log", 4096, "gc finished")
    out = {}
    try:
        m.start()
        out["kv-chunk-fs"] = run(mnt, first, nxt, args.seconds)
        out["plain"] = run(plain, first, nxt, args.seconds)
    finally:
        m.stop()
        subprocess.run(["sync"], check=False)
        bench.remove_work(work)
    print(f"{args.file.name} ({len(first) / MiB:.1f} MiB), 4 KiB reads every {PERIOD * 1e3:.0f} ms during saves:")
    for name, r in out.items():
        print(f"  {name:12s} reads: {summary(r['reads'])}; saves: median {statistics.median(r['saves']):.1f} ms")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
