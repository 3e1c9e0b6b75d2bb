"""The shared tier on a local SeaweedFS: save latency with and without a remote, upload
throughput, and a restore on a second host: cold from the bucket, from its local packs, and against
downloading the plain file as one object with boto3 (what ``aws s3 cp`` does).

Per run, interleaved (the order of the two saves rotates): a save of all-new random bytes on host A
without a remote and on host A' with one (uploads drained before the next step, so each save is
measured alone; the drain time gives the upload throughput); then on host B, a new store each run:
the cold restore from the bucket (lookup, index GET, parallel chunk GETs into B's packs, read), the
restore again after a remount with the page cache dropped (B's packs only), and the boto3 download
of the same bytes stored as one object. Needs root (drops caches) and ``weed`` on PATH.

    python3 benchmarks/remote.py                      # 415 MiB, 3 runs
    python3 benchmarks/remote.py --size 100MiB --runs 2 --json out.json
    python3 benchmarks/remote.py --mount-args "--remote-pack-size 0"   # the loose layout
    python3 benchmarks/remote.py --file /var/tmp/kvstates/f16-110M --restore-only --runs 5

``--file`` saves that file's bytes (a state file: chunked as the daemon chunks llama-server's
saves) instead of random ones. ``--restore-only`` times just host B: the file is saved and uploaded
once from host A', then per run a new host B (empty store, its own whole-file directory, same
bucket, page cache dropped) opens and reads it (open, and open to last byte, timed apart), against
two downloads of the same bytes stored as one object, in rotating order: boto3's ``download_file``
(what ``aws s3 cp`` does: parallel ranged GETs for objects over 8 MiB) and one plain GET streamed
to a file (``get_object``). ``--baseline-src DIR`` adds a restore by the daemon of another source
tree in the same rotation (e.g. ``git archive`` of an older version's ``src``).

Requests and bytes per save (host A', upload included) and per cold restore (host B) come from the
daemons' counters (``remote_*`` in ``stats``).
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
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

import conftest  # noqa: E402
from conftest import WHOLE_ROOT, Mount, remove_whole_files  # noqa: E402
from seaweed import BUCKET, CREDENTIALS, Weed  # noqa: E402

from kvchunkfs.units import parse_size  # noqa: E402

MiB = 1 << 20
PIECE = MiB


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def write_file(path: Path, data: bytes) -> None:
    view = memoryview(data)
    with open(path, "wb") as f:
        for i in range(0, len(data), PIECE):
            f.write(view[i : i + PIECE])


def read_file(path: Path) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(PIECE):
            n += len(chunk)
    return n


PUTS = ("remote_pack_puts", "remote_packidx_puts", "remote_index_puts", "remote_chunk_puts", "remote_pack_touches")


def counted(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Requests and bytes between two stats."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("remote_")}
    return {"requests": d["remote_requests"], "puts": sum(d[k] for k in PUTS), "heads": d["remote_heads"],
            "gets": d["remote_chunk_gets"] + d["remote_range_gets"] + d["remote_index_gets"] + d["remote_packidx_gets"],
            "put_bytes": d["remote_pack_put_bytes"] + d["remote_chunk_put_bytes"],
            "get_bytes": d["remote_range_get_bytes"] + d["remote_chunk_get_bytes"]}  # fmt: skip


def wait_drained(m: Mount, timeout: float = 900) -> None:
    m.ingested(timeout)  # a save is uploaded once ingestion has stored it
    deadline = time.monotonic() + timeout
    while m.stats()["upload_queue"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"uploads did not drain: {m.log()[-2000:]}")
        time.sleep(0.01)


def timed_restore(path: Path) -> tuple[float, float]:
    """(open, open to last byte) of a read of the whole file, in seconds."""
    start = time.perf_counter()
    n = 0
    with open(path, "rb", buffering=0) as f:
        opened = time.perf_counter()
        while chunk := f.read(PIECE):
            n += len(chunk)
    return opened - start, time.perf_counter() - start


def get_one(client: object, key: str, target: Path) -> None:
    """One GET of the object, its body streamed to ``target``."""
    body = client.get_object(Bucket=BUCKET, Key=key)["Body"]  # type: ignore[attr-defined]
    with open(target, "wb") as f:
        while chunk := body.read(PIECE):
            f.write(chunk)


def cpu_seconds(pid: int) -> tuple[float, float, int]:
    """User and system CPU time of a process so far, and its minor page faults."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7])


def restore_only(args: argparse.Namespace, data: bytes, work: Path, weed: Weed, remote: list[str]) -> int:
    """Host B's restore of a snapshot only the bucket has, against downloading it as one object."""
    size = len(data)
    client = weed.client()
    a = Mount(work / "ar/store", work / "ar/mnt", work / "ar/log", remote)
    a.start()
    try:
        write_file(a.path("snap"), data)
        wait_drained(a)
    finally:
        a.stop()
    client.put_object(Bucket=BUCKET, Key="plain/snap", Body=data)
    target = work / "download"
    trees = {"restore": conftest.SRC}
    if args.baseline_src:
        trees["restore_baseline"] = Path(args.baseline_src).resolve()
    keys = [*trees, "boto3_download", "one_get"]
    results: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in trees}
    system: dict[str, list[float]] = {k: [] for k in trees}  # of which in the kernel
    faults: dict[str, list[int]] = {k: [] for k in trees}  # minor page faults (fresh memory touched)
    requests: list[dict[str, int]] = []
    loads = []

    def restore(run: int, key: str) -> None:
        b = Mount(work / f"b{run}/store", work / f"b{run}/mnt", work / f"b{run}/log", remote)
        own, conftest.SRC = conftest.SRC, trees[key]  # the daemon's source tree (Mount.start reads it)
        try:
            b.start()
        finally:
            conftest.SRC = own
        try:
            drop_caches()
            assert b.proc is not None
            before, used = b.stats(), cpu_seconds(b.proc.pid)
            results[key].append(timed_restore(b.path("snap"))[1])
            now = cpu_seconds(b.proc.pid)
            cpu[key].append(now[0] + now[1] - used[0] - used[1])
            system[key].append(now[1] - used[1])
            faults[key].append(now[2] - used[2])
            if key == "restore":
                requests.append(counted(before, b.stats()))
        finally:
            b.stop()
            shutil.rmtree(work / f"b{run}")
            remove_whole_files(b.whole)

    def download(key: str, fn: Callable[[], object]) -> None:
        drop_caches()
        results[key].append(timed(fn))
        assert target.stat().st_size == size
        target.unlink()

    steps: list[Callable[[int], None]] = [
        *(lambda run, key=key: restore(run, key) for key in trees),
        lambda run: download("boto3_download", lambda: client.download_file(BUCKET, "plain/snap", str(target))),
        lambda run: download("one_get", lambda: get_one(client, "plain/snap", target)),
    ]
    for run in range(args.runs):
        for k in range(len(steps)):
            steps[(run + k) % len(steps)](run)
        loads.append(os.getloadavg()[0])
        print(f"run {run}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in results.items())
              + f"; restore {requests[-1]}; daemon CPU "
              + ", ".join(f"{k} {v[-1]:.2f}s (system {system[k][-1]:.2f}s, {faults[k][-1]} faults)"
                          for k, v in cpu.items())
              + f"; load {loads[-1]:.1f}", flush=True)  # fmt: skip
    med = {k: statistics.median(v) for k, v in results.items()}
    mb = size / 1e6
    print(f"\n{args.file or args.size} ({size} bytes), {args.runs} runs, medians "
          f"(load average {statistics.median(loads):.1f}):")  # fmt: skip
    for key in trees:
        print(f"  {key:17s} on B: open→last byte {med[key]:.3f} s  ({med[key] / med['boto3_download']:.2f}x "
              f"boto3 download_file, {med[key] / med['one_get']:.2f}x one GET), "
              f"daemon CPU {statistics.median(cpu[key]):.2f} s (system {statistics.median(system[key]):.2f} s, "
              f"{statistics.median(faults[key]):.0f} page faults)")  # fmt: skip
        ratios = [r / d for r, d in zip(results[key], results["boto3_download"], strict=True)]
        print("    per run / download_file: " + ", ".join(f"{r:.2f}x" for r in ratios))
    print(f"  boto3 download_file          {med['boto3_download']:.3f} s  ({mb / med['boto3_download']:.0f} MB/s)")
    print(f"  one GET (get_object)         {med['one_get']:.3f} s  ({mb / med['one_get']:.0f} MB/s)")
    print("  restore: " + ", ".join(f"{k} {statistics.median(r[k] for r in requests):.0f}" for k in requests[0]))
    if args.json:
        out = {"file": args.file, "size": size, "runs": results, "medians": med, "cpu": cpu, "system": system,
               "faults": faults, "requests": requests, "loads": loads}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="415MiB")
    p.add_argument("--file", default=None, help="save this file's bytes (e.g. a llama-server state file)")
    p.add_argument("--restore-only", action="store_true", help="time only host B's restore against the downloads")
    p.add_argument("--baseline-src", default=None,
                   help="with --restore-only: also restore with the daemon of this src/ tree")  # fmt: skip
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default=None, help="work directory (default: a new one under /var/tmp)")
    p.add_argument("--json", default=None)
    p.add_argument("--mount-args", default="", help="extra daemon flags, e.g. '--remote-upload-workers 16'")
    args = p.parse_args()
    size = Path(args.file).stat().st_size if args.file else parse_size(args.size)
    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    work = Path(tempfile.mkdtemp(prefix="kvcfs-remote-bench-", dir=args.dir or "/var/tmp"))
    weed = Weed(work / "weed")
    weed.start()
    url = f"s3://{BUCKET}/bench"
    remote = ["--remote", url, "--remote-endpoint", weed.endpoint, "--gc-interval", "0", *args.mount_args.split()]
    if args.restore_only:
        try:
            return restore_only(args, Path(args.file).read_bytes() if args.file else os.urandom(size), work, weed,
                                remote)  # fmt: skip
        finally:
            weed.stop()
            shutil.rmtree(work, ignore_errors=True)
            remove_whole_files(WHOLE_ROOT)
    a_local = Mount(work / "al/store", work / "al/mnt", work / "al/log", ["--gc-interval", "0"])
    a_remote = Mount(work / "ar/store", work / "ar/mnt", work / "ar/log", remote)
    results: dict[str, list[float]] = {k: [] for k in
                                       ("save_local", "save_remote", "upload", "restore_remote_cold",
                                        "restore_local_cold", "boto3_download")}  # fmt: skip
    client = weed.client()
    requests: dict[str, list[dict[str, int]]] = {"save": [], "restore": []}
    try:
        a_local.start()
        a_remote.start()
        for run in range(args.runs):
            data = Path(args.file).read_bytes() if args.file else os.urandom(size)  # random: all chunks new
            name = f"snap{run}"
            order = [(a_local, "save_local"), (a_remote, "save_remote")]
            for m, key in order if run % 2 == 0 else order[::-1]:
                drop_caches()
                before = m.stats()
                results[key].append(timed(write_file, m.path(name), data))
                if m is a_remote:
                    results["upload"].append(timed(wait_drained, a_remote))
                    requests["save"].append(counted(before, a_remote.stats()))
            client.put_object(Bucket=BUCKET, Key=f"plain/{name}", Body=data)
            b = Mount(work / f"b{run}/store", work / f"b{run}/mnt", work / f"b{run}/log", remote)
            b.start()
            try:
                drop_caches()
                before = b.stats()
                results["restore_remote_cold"].append(timed(read_file, b.path(name)))
                requests["restore"].append(counted(before, b.stats()))
                b.remount()
                drop_caches()
                results["restore_local_cold"].append(timed(read_file, b.path(name)))
                gets = b.stats()["remote_fetched_chunks"]
            finally:
                b.stop()
                shutil.rmtree(work / f"b{run}")
            target = work / "download"
            drop_caches()
            results["boto3_download"].append(timed(client.download_file, BUCKET, f"plain/{name}", str(target)))
            assert target.stat().st_size == size
            target.unlink()
            print(f"run {run}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in results.items())
                  + f"; chunks fetched after the remount: {gets}; save {requests['save'][-1]}; "
                  f"restore {requests['restore'][-1]}", flush=True)  # fmt: skip
    finally:
        for m in (a_local, a_remote):
            if m.proc is not None:
                m.stop()
        weed.stop()
        shutil.rmtree(work, ignore_errors=True)
        remove_whole_files(WHOLE_ROOT)
    med = {k: statistics.median(v) for k, v in results.items()}
    mb = size / 1e6
    print(f"\n{args.size}, {args.runs} runs, medians:")
    print(f"  save, no remote          {med['save_local']:.3f} s")
    print(f"  save, remote             {med['save_remote']:.3f} s  ({med['save_remote'] / med['save_local']:.2f}x)")
    print(f"  upload after the save    {med['upload']:.3f} s  ({mb / med['upload']:.0f} MB/s)")
    print(f"  restore on B, cold, S3   {med['restore_remote_cold']:.3f} s  "
          f"({med['restore_remote_cold'] / med['boto3_download']:.2f}x the boto3 download)")  # fmt: skip
    print(f"  restore on B, local packs {med['restore_local_cold']:.3f} s")
    print(f"  boto3 download, 1 object {med['boto3_download']:.3f} s  ({mb / med['boto3_download']:.0f} MB/s)")
    for what, rows in requests.items():
        print(f"  {what}: " + ", ".join(f"{k} {statistics.median(r[k] for r in rows):.0f}" for k in rows[0]))
    if args.json:
        out = {"size": size, "runs": results, "medians": med, "requests": requests}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
