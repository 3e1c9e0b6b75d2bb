"""The warm-up after a reboot: how long it takes per GB, and what it costs a client's restore of a
snapshot it does not warm, made while it runs.

Synthetic f16 state files (e2e/ggsq.py, a 12-layer model, 512-byte rows): ``--warm`` files of
9,500 tokens (111 MiB), saved last (the warm-up's plan, its budget set to just hold them), and
``--cold`` files of 2,400 tokens (28 MiB), saved first (outside it). Each run stands in for a
reboot (another boot id: the memory tier is wiped) and drops the page cache, then, interleaved:

- ``alone``: a mount with ``warm_up = 0``; a client restores one cold file (open, read to the end);
- ``during``: a mount with the warm-up on, held (``KVCFS_WARM_UP_HOLD``) after ``--after`` pieces
  until the mount's GC and catalog load are done and the page cache is dropped, then let go, and
  at once the client restores one cold file the same way;
- ``only``: the warm-up alone, held after its first piece the same way: the time from its release
  to its end, per GiB it put back after the release (the figure per GB).

Every mount waits for its GC and catalog load, and drops the page cache, before what is timed; a
timed restore is never the daemon's first (another file is restored before, untimed: the first
restore of a process pays for its first pack opens and map pages).

    python3 benchmarks/warmup.py                     # 10 x 111 MiB warmed, 10 x 28 MiB cold, 5 runs
    python3 benchmarks/warmup.py --warm 4 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT)]

from conftest import WHOLE_ROOT, Mount, remove_whole_files  # noqa: E402

from e2e import ggsq  # noqa: E402

MiB = 1 << 20
DONE = "kvchunkfs.file.warmup: warm-up "


def state(tokens: int, seed: int) -> bytes:
    spec = ggsq.Spec(n_layer=12, row_bytes=512, seed=f"warm-{seed}".encode())
    return ggsq.synthetic_bytes(ggsq.synthetic_tokens(tokens, seed=seed), spec)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def restore(path: Path) -> tuple[float, bytes]:
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        parts = []
        while piece := f.read(MiB):
            parts.append(piece)
    return time.perf_counter() - t, b"".join(parts)


def stats(m: Mount) -> dict[str, int]:
    return json.loads(os.getxattr(m.mnt, "user.kvcfs.stats"))


def wait(m: Mount, done: int) -> dict[str, int]:
    deadline = time.monotonic() + 600
    while m.log().count(DONE) <= done:
        if time.monotonic() > deadline:
            raise SystemExit(f"the warm-up did not end:\n{m.log()[-3000:]}")
        time.sleep(0.01)
    return stats(m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm", type=int, default=10, help="files the warm-up puts back (111 MiB each)")
    ap.add_argument("--cold", type=int, default=10, help="files outside its plan (28 MiB each; two per run)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--after", type=int, default=8, help="pieces the warm-up has written when the client restores")
    ap.add_argument("--dir", default="/var/tmp")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvcfs-warmup-", dir=args.dir))
    boot = work / "boot_id"
    boot.write_text("boot-0\n")
    os.environ["KVCFS_BOOT_ID_FILE"] = str(boot)
    cold = {f"cold{i}": state(2400, 100 + i) for i in range(args.cold)}
    warm = {f"warm{i}": state(9500, i) for i in range(args.warm)}
    planned = sum(len(d) for d in warm.values())
    # The warm-up's budget is half the tier: just the warm files (a cold one does not fit what is left).
    tier = 2 * (planned + MiB)
    base = ["--memory-tier-size", str(tier), "--cache-size", "64MiB"]
    m = Mount(work / "store", work / "mnt", work / "daemon.log", [*base, "--warm-up", "0"], jitter=False)
    m.start()
    try:
        primer = state(2400, 999)
        m.path("primer").write_bytes(primer)
        for name, data in [*cold.items(), *warm.items()]:  # the warm ones saved last: most recent
            m.path(name).write_bytes(data)
            time.sleep(0.01)
        m.ingested()
        samples: dict[str, list[float]] = {"alone": [], "during": []}
        per_gb: list[float] = []  # warm-up seconds per GiB, no client
        per_gb_busy: list[float] = []  # ... with the client's restore
        yields: list[int] = []
        n = 0
        hold = work / "hold"
        os.environ["KVCFS_WARM_UP_HOLD"] = str(hold)
        for run in range(args.runs):
            # Each cold file restored once: a restore makes it the most recently used (in later plans).
            names = {"alone": f"cold{(2 * run) % args.cold}", "during": f"cold{(2 * run + 1) % args.cold}"}
            order = ["alone", "during", "only"] if run % 2 == 0 else ["only", "during", "alone"]
            for kind in order:
                m.stop()
                n += 1
                boot.write_text(f"boot-{n}\n")  # a reboot: the tier is wiped
                done = m.log().count(DONE)
                hold.write_text(str(args.after if kind == "during" else 1))
                m.start_settled([*base, "--warm-up", "0" if kind == "alone" else "0.5"])  # the GC at mount done
                m.catalog_loaded()
                if kind != "alone":  # held after its first pieces
                    while stats(m)["warm_up_pieces"] < int(hold.read_text()):
                        time.sleep(0.005)
                if kind != "only" and restore(m.path("primer"))[1] != primer:  # the daemon's first restore: untimed
                    raise SystemExit("primer: restored bytes differ")
                drop_caches()
                before = stats(m)["warm_up_bytes"]
                t0 = time.perf_counter()
                hold.unlink()
                name = names.get(kind, "")
                if kind == "only":
                    st = wait(m, done)
                    per_gb.append((time.perf_counter() - t0) / ((st["warm_up_bytes"] - before) / (1 << 30)))
                    continue
                secs, got = restore(m.path(name))
                if got != cold[name]:
                    raise SystemExit(f"{kind}: {name} restored bytes differ")
                if kind == "alone":
                    samples["alone"].append(secs)
                    continue
                mid = stats(m)["warm_up_warming"]
                st = wait(m, done)
                if not mid:
                    print(f"run {run}: the warm-up ended before the restore did; sample dropped")
                else:
                    samples["during"].append(secs)
                per_gb_busy.append((time.perf_counter() - t0) / ((st["warm_up_bytes"] - before) / (1 << 30)))
                yields.append(st["warm_up_yields"])
        a, d = statistics.median(samples["alone"]), statistics.median(samples["during"])
        print(f"warm-up: budget {planned / MiB:.0f} MiB ({args.warm} files; cold files restored before join the "
              f"plan), page cache dropped, medians of {args.runs} runs")  # fmt: skip
        print(f"  no client:          {statistics.median(per_gb):.2f} s per GiB  (runs: "
              f"{', '.join(f'{x:.2f}' for x in per_gb)})")  # fmt: skip
        print(f"  with a restore:     {statistics.median(per_gb_busy):.2f} s per GiB  (times it waited for "
              f"the client: {yields})")  # fmt: skip
        print(f"cold restore of a 28 MiB file: alone {a * 1000:.0f} ms, during the warm-up {d * 1000:.0f} ms "
              f"({d / a:.2f}x; samples alone {[round(x * 1000) for x in samples['alone']]}, during "
              f"{[round(x * 1000) for x in samples['during']]})")  # fmt: skip
    finally:
        m.stop()
        remove_whole_files(WHOLE_ROOT)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
