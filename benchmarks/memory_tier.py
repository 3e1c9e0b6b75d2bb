"""The memory tier's figures: its defaults on this machine, how far ingestion falls behind
back-to-back saves (with ``durability = close``, the saves a power cut could lose), and what a
stopped daemon still holds.

A daemon is mounted on a fresh store with the default memory tier; one writer saves SIZE-byte
files back to back (new random bytes each, the worst case for ingestion) for SECONDS. After each
close the daemon's ``ingest_behind_ms`` (the oldest save not yet stored plus the time the queue
needs) is sampled: the age a save acknowledged then could reach before it is stored. Then the
daemon stops (``memory_tier_on_stop`` as given) and the tier's directory is measured.

    python3 benchmarks/memory_tier.py                       # 100 MiB saves for 30 s
    python3 benchmarks/memory_tier.py --size 32MiB --seconds 20 --on-stop keep
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kvchunkfs.store import memfs, tierdir  # noqa: E402
from kvchunkfs.units import parse_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100MiB")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--on-stop", choices=("free", "keep"), default="free")
    args = ap.parse_args()
    size = parse_size(args.size)
    base = Path(tempfile.mkdtemp(prefix="kvcfs-memtier-"))
    store, mnt, log = base / "store", base / "mnt", base / "daemon.log"
    mnt.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(store), "--whole-files-dir", "",
           "--memory-tier-on-stop", args.on_stop, str(mnt)]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        while "fuse.daemon: mounted" not in log.read_text():
            if proc.poll() is not None:
                sys.exit(log.read_text())
            time.sleep(0.05)
        stats = lambda: json.loads(os.getxattr(mnt, "user.kvcfs.stats"))  # noqa: E731
        st = stats()
        print(
            f"defaults: tier_size {st['tier_size'] >> 20} MiB, hot_budget {st['hot_budget'] >> 20} MiB, "
            f"ingest_backlog_limit {st['ingest_backlog_limit'] >> 20} MiB, tmpfs {st['tier_fs_size'] >> 20} MiB"
        )
        lags, closes = [], []
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < args.seconds:
            data = os.urandom(size)
            t0 = time.monotonic()
            with open(mnt / f"s{i % 50}", "wb") as f:
                for k in range(0, size, 1 << 20):
                    f.write(data[k : k + (1 << 20)])
            closes.append(time.monotonic() - t0)
            lags.append(stats()["ingest_behind_ms"] / 1000)
            i += 1
        st = stats()
        elapsed = time.monotonic() - start
        print(
            f"{i} saves of {size >> 20} MiB in {elapsed:.1f} s ({i * size / elapsed / 1e6:.0f} MB/s acknowledged); "
            f"closes that waited: {st['ingest_waits']}; save (write+close) median {statistics.median(closes):.2f} s, "
            f"max {max(closes):.2f} s"
        )
        q = statistics.quantiles(lags, n=20)
        print(
            f"ingestion lag after each close: median {statistics.median(lags):.1f} s, p95 {q[18]:.1f} s, "
            f"max {max(lags):.1f} s (a power cut may lose saves that old, plus the 5 s checkpoint interval)"
        )
        root = Path(re.findall(r"memory tier (\S+): staged saves", log.read_text())[-1])
        deadline = time.monotonic() + 300
        while stats()["ingest_queue"] and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"before stop: the tier holds {tierdir.held_bytes(root) >> 20} MiB")
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        proc.wait(timeout=300)
    held = tierdir.held_bytes(root) if root.exists() else 0
    print(
        f"after a clean stop ({args.on_stop}): {held >> 20} MiB held in {root}, "
        f"its own tmpfs {'still mounted' if memfs.own_mount(root) else 'gone'}"
    )
    if root.exists():
        tierdir.free(root)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
