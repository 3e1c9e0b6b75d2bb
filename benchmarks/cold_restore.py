"""Cold restores after a daemon restart, split up: open, the first 4 KiB, the rest, against a plain
file on the same disk; and warm restores (the daemon's caches warm, the page cache dropped).

Every cold sample mounts a fresh daemon on the store holding the files (waiting for its GC at
mount), drops the page cache and reads one file the way a restore does (open, 4 KiB, then 1 MiB
reads to the end); the plain file is read the same way right before or after it (the order
alternates). Medians of ``--runs``, ratios to plain.

    python3 benchmarks/cold_restore.py                        # synthetic llama-shaped files (below)
    python3 benchmarks/cold_restore.py --files /path/a.bin /path/b.bin
    python3 benchmarks/cold_restore.py --baseline-src /tmp/old/src   # also an older tree, interleaved
    python3 benchmarks/cold_restore.py --baseline-args "--chunker format"   # other settings, interleaved
    python3 benchmarks/cold_restore.py --llama --files ...    # llama-server's own read pattern, split up

Synthetic files (e2e/ggsq.py, a 12-layer model, 4 KV heads x 64): q4_0-like 8 MiB (144-byte rows,
2,400 tokens), f16 28 MiB (512-byte rows, 2,400 tokens), f16 111 MiB (9,500 tokens); ``--v-trans``
writes V transposed (llama-server with flash attention off).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(1, str(ROOT))

from benchmarks import bench  # noqa: E402
from benchmarks.bench import Mount, cpu_seconds, drop_caches, mount_config  # noqa: E402
from e2e import ggsq  # noqa: E402

HEAD = 4096
PIECE = 1 << 20
SHAPES = {  # name: (row bytes, tokens)
    "q4_0-8M": (144, 2400),
    "f16-28M": (512, 2400),
    "f16-111M": (512, 9500),
}


def llama_read(path: Path) -> tuple[float, ...]:
    """llama-server's restore, split up in seconds: (open, the last 8 KiB, the first 32 KiB, close
    and open again, the first 1 MiB, the rest). Its stdio sizes a buffer by reading the end before
    the header, then reads the file again from a second descriptor."""
    t = [time.perf_counter()]
    fd = os.open(path, os.O_RDONLY)
    t.append(time.perf_counter())
    try:
        os.pread(fd, 8192, max(0, os.fstat(fd).st_size - 8192))
        t.append(time.perf_counter())
        os.pread(fd, 32768, 0)
        t.append(time.perf_counter())
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        t.append(time.perf_counter())
        os.read(fd, PIECE)
        t.append(time.perf_counter())
        while os.read(fd, PIECE):
            pass
        t.append(time.perf_counter())
    finally:
        os.close(fd)
    return tuple(b - a for a, b in zip(t, t[1:], strict=False))


def timed_read(path: Path) -> tuple[float, float, float]:
    """(open, first 4 KiB, the rest) in seconds."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        t1 = time.perf_counter()
        os.read(fd, HEAD)
        t2 = time.perf_counter()
        while os.read(fd, PIECE):
            pass
        t3 = time.perf_counter()
    finally:
        os.close(fd)
    return t1 - t0, t2 - t1, t3 - t2


def synthetic(name: str, v_trans: bool) -> bytes:
    row, tokens = SHAPES[name]
    spec = ggsq.Spec(n_layer=12, row_bytes=row, v_trans=v_trans, seed=name.encode())
    return ggsq.synthetic_bytes(ggsq.synthetic_tokens(tokens, seed=len(name)), spec)


def fmt(xs: list[float]) -> str:
    return f"{1000 * statistics.median(xs):7.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", nargs="*", type=Path, help="state files to restore (default: synthetic)")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--v-trans", action="store_true")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--mount-args", default="")
    ap.add_argument("--baseline-src", type=Path, help="also an older src/ tree, its own store, interleaved")
    ap.add_argument(
        "--baseline-args", help="the baseline's mount arguments instead of --mount-args (no --baseline-src: this tree)"
    )
    ap.add_argument("--warm", action="store_true", help="also warm restores (daemon warm, page cache dropped)")
    ap.add_argument("--llama", action="store_true", help="read as llama-server does (end, header, reopen)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    extra = args.mount_args.split()
    ra = mount_config(extra).kernel_readahead_kb
    work = Path(tempfile.mkdtemp(prefix="kvcfs-cold-", dir=args.dir))
    names: dict[str, bytes] = {}
    if args.files:
        names = {p.name: p.read_bytes() for p in args.files}
    else:
        names = {n: synthetic(n, args.v_trans) for n in args.shapes}
    (work / "plain").mkdir()
    py = sys.executable
    kinds = {"new": ROOT / "src"}
    if args.baseline_src or args.baseline_args is not None:
        kinds["base"] = (args.baseline_src or ROOT / "src").resolve()
    margs = {k: extra for k in kinds}
    if args.baseline_args is not None:
        margs["base"] = args.baseline_args.split()
    for k in kinds:  # a restore from chunks: no warm-up puts the file back first (an older tree has none)
        if kinds[k] == (ROOT / "src").resolve() or k == "new":
            margs[k] = ["--warm-up", "0", *margs[k]]
    mounts = {}
    for k, src in kinds.items():
        store, mnt = str(work / f"store-{k}"), str(work / f"mnt-{k}")
        argv = [py, "-m", "kvchunkfs.cli", "mount", "--store", store, *margs[k], mnt]
        mounts[k] = Mount(argv, work / f"mnt-{k}", work / f"{k}.log", ra, "gc finished", src=src)
    res: dict[tuple[str, str], list[tuple[float, ...]]] = {}
    read = llama_read if args.llama else timed_read
    warm: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}  # daemon CPU seconds of each cold restore
    try:
        for m in mounts.values():
            m.start()
        for n, data in names.items():
            (work / "plain" / n).write_bytes(data)
            for k in kinds:
                (work / f"mnt-{k}" / n).write_bytes(data)
        for m in mounts.values():
            m.stop()
        for run in range(args.runs):
            for n, data in names.items():
                order = ["plain", *kinds]
                order = order[run % len(order) :] + order[: run % len(order)]
                for k in order:
                    if k == "plain":
                        path = work / "plain" / n
                    else:
                        mounts[k].start()
                        path = work / f"mnt-{k}" / n
                    drop_caches()
                    c0 = cpu_seconds(mounts[k].pid) if k != "plain" else 0.0
                    res.setdefault((n, k), []).append(read(path))
                    cpu.setdefault((n, k), []).append(cpu_seconds(mounts[k].pid) - c0 if k != "plain" else 0.0)
                    if args.warm:
                        drop_caches()
                        t = time.perf_counter()
                        read(path)
                        warm.setdefault((n, k), []).append(time.perf_counter() - t)
                    if run == 0 and path.read_bytes() != data:
                        raise SystemExit(f"{k} {n}: restored bytes differ")
                    if k != "plain":
                        mounts[k].stop()
        phases = ("open", "end8K", "head32K", "reopen", "1MiB", "rest") if args.llama else ("open", "4KiB", "rest")
        cols = (*phases, "total", "x plain", "cpu")
        print(
            f"{'file':10s} {'target':6s} "
            + " ".join(f"{c:>7s}" for c in cols)
            + ("   warm  x plain" if args.warm else "")
            + f"   (ms, medians of {args.runs})"
        )
        for n in names:
            plain_total = statistics.median(sum(s) for s in res[(n, "plain")])
            plain_warm = statistics.median(warm[(n, "plain")]) if args.warm else 0.0
            for k in ["plain", *kinds]:
                s = res[(n, k)]
                total = [sum(x) for x in s]
                split = " ".join(fmt([x[i] for x in s]) for i in range(len(phases)))
                line = (
                    f"{n:10s} {k:6s} {split} {fmt(total)} {statistics.median(total) / plain_total:7.2f}"
                    f"{fmt(cpu[(n, k)])[1:]}"
                )
                if args.warm:
                    line += f" {fmt(warm[(n, k)])} {statistics.median(warm[(n, k)]) / plain_warm:7.2f}"
                print(line)
    finally:
        for m in mounts.values():
            m.stop()
        if not args.keep:
            bench.remove_work(work)
        else:
            print("kept", work)


if __name__ == "__main__":
    main()
