"""Restore one llama.cpp state file (synthetic, e2e/ggsq.py) from a `format` store, a `relayout`
store and a plain directory on the same disk: cold (page cache dropped, daemon restarted, so its
chunk cache is empty) and warm (read again right away), several runs, medians.

    python3 benchmarks/restore_state.py                       # 200 MiB: 3,200 tokens x 32 layers x 1 KiB
    python3 benchmarks/restore_state.py --tokens 2182 --layers 12 --row 512 --v-trans
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "src"))

from benchmarks import bench  # noqa: E402
from e2e import ggsq  # noqa: E402

KINDS = ("format", "relayout", "plain")


def mount(store: Path, mnt: Path, kind: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    argv = [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(store), "--chunker", kind, str(mnt)]
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log.open("a"), env=env)
    deadline = time.monotonic() + 60
    while not os.path.ismount(mnt):
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"mount failed, see {log}")
        time.sleep(0.05)
    return p


def unmount(p: subprocess.Popen, mnt: Path) -> None:
    subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
    p.wait(timeout=60)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def read_all(path: Path) -> float:
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=3200)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--row", type=int, default=1024, help="bytes per K (and V) row")
    ap.add_argument("--v-trans", action="store_true", help="V transposed (llama-server -fa off)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp", help="where the stores and the plain file go")
    args = ap.parse_args()

    spec = ggsq.Spec(n_layer=args.layers, row_bytes=args.row, v_trans=args.v_trans)
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(args.tokens, seed=5), spec)
    print(f"{len(data) / 2**20:.1f} MiB, {args.layers} layers x {args.row} B rows, v_trans={args.v_trans}")
    work = Path(tempfile.mkdtemp(prefix="kvcfs-restore-", dir=args.dir))
    mounts: dict[str, subprocess.Popen | None] = {}
    cold: dict[str, list[float]] = {k: [] for k in KINDS}
    warm: dict[str, list[float]] = {k: [] for k in KINDS}
    try:
        for kind in KINDS:
            (work / f"mnt-{kind}").mkdir()
            mounts[kind] = mount(work / f"store-{kind}", work / f"mnt-{kind}", kind, work / f"{kind}.log") \
                if kind != "plain" else None  # fmt: skip
            (work / f"mnt-{kind}" / "snap").write_bytes(data)
        for run in range(args.runs):  # interleaved, the order rotating every run
            order = KINDS[run % 3 :] + KINDS[: run % 3]
            for kind in order:
                mnt = work / f"mnt-{kind}"
                p = mounts[kind]
                if p is not None:  # an empty chunk cache
                    unmount(p, mnt)
                    mounts[kind] = mount(work / f"store-{kind}", mnt, kind, work / f"{kind}.log")
                drop_caches()
                cold[kind].append(read_all(mnt / "snap"))
                warm[kind].append(read_all(mnt / "snap"))
        for kind in KINDS:
            if (work / f"mnt-{kind}" / "snap").read_bytes() != data:
                raise SystemExit(f"{kind}: restored bytes differ")
        base = statistics.median(cold["format"])
        for kind in KINDS:
            c, w = statistics.median(cold[kind]), statistics.median(warm[kind])
            print(f"{kind:9s} cold median {1000 * c:7.1f} ms (min {1000 * min(cold[kind]):.1f}, max "
                  f"{1000 * max(cold[kind]):.1f}, {c / base:.2f}x format)  warm median {1000 * w:6.1f} ms")  # fmt: skip
    finally:
        for kind, p in mounts.items():
            if p is not None:
                unmount(p, work / f"mnt-{kind}")
        bench.remove_work(work)


if __name__ == "__main__":
    main()
