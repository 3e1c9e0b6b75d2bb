"""A snapshot bigger than the memory tier's room, restored: where its whole file goes and what it
costs, against a plain file on the same disk.

    python3 benchmarks/big_restore.py --old-src /tmp/old/src    # 4 GiB, a 2 GiB memory tier

The file is bigfile_rss.py's (llama-server's layout, a Llama-3-8B's KV shape, random rows),
saved once through a mount with a tier large enough to stage it. Then, per variant, a daemon on
that store with its hot copies deleted (as after a reboot), the page cache dropped, and the file
read whole (open, read in 1 MiB pieces, close; checked against the source):

* ``disk``: this tree's code, ``--memory-tier-size`` of ``--room``: put back onto the store's disk;
* ``memory``: this tree's code, a tier of 2.5 times the file: put back into memory;
* ``old``: ``--old-src``'s code (if given) with the small tier: served from its chunks request by
  request;
* ``plain``: the source file itself, read from the same disk.

For each: seconds, and the bytes the daemon had the disk write (``/proc/PID/io`` write_bytes less
cancelled_write_bytes: dirty pages freed before writeback are not written), read 5 s after the
close (the reopen linger is over, the copy's last descriptor closed), plus the disk's written
sectors (``/sys/block/DEV/stat``: every process on the machine, for scale).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(1, str(ROOT))

from benchmarks.bench import Mount, drop_caches  # noqa: E402
from benchmarks.bigfile_rss import file_sum, save, state_file, stats, wait_ingested  # noqa: E402
from kvchunkfs.store import memfs  # noqa: E402
from kvchunkfs.units import parse_size  # noqa: E402

MiB = 1 << 20


def proc_io(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        k, v = line.split(":")
        out[k] = int(v)
    return out


def disk_sectors(path: Path) -> int:
    dev = os.stat(path).st_dev
    sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    stat = sys_dev / "stat"
    if not stat.exists():
        return 0
    return int(stat.read_text().split()[6])


def daemon(src: Path, work: Path, whole: Path, extra: list[str]) -> Mount:
    argv = [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(work / "store"),
            "--whole-files-dir", str(whole), *extra, str(work / "mnt")]  # fmt: skip
    return Mount(argv, work / "mnt", work / "daemon.log", 4096, "gc finished", src=src)


def restore(m: Mount, mnt: Path, want: bytes, disk: Path) -> dict[str, float]:
    drop_caches()
    io0, sec0 = proc_io(m.pid), disk_sectors(disk)
    t = time.perf_counter()
    ok = file_sum(mnt / "state") == want
    seconds = time.perf_counter() - t
    if not ok:
        raise SystemExit("restored bytes differ")
    st = stats(mnt)
    time.sleep(5)  # the reopen linger (1 s) is over: the disk copy's last descriptor is closed
    io1, sec1 = proc_io(m.pid), disk_sectors(disk)
    written = (io1["write_bytes"] - io0["write_bytes"]) - (io1["cancelled_write_bytes"] - io0["cancelled_write_bytes"])
    return {
        "seconds": round(seconds, 2),
        "daemon_disk_write_mib": round(written / MiB, 1),
        "daemon_dirtied_mib": round((io1["write_bytes"] - io0["write_bytes"]) / MiB, 1),
        "device_write_mib_all_processes": round((sec1 - sec0) * 512 / MiB, 1),
        "to_disk": st.get("restores_to_disk", -1),
        "to_memory": st.get("restores_to_memory", -1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="4G")
    ap.add_argument("--room", default="2G", help="memory_tier_size of the small-tier variants")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/kvcfs-bigfile"))
    ap.add_argument(
        "--old-src", type=Path, default=None, help="a src/ tree of the code before (the chunk-served fallback)"
    )
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    size = parse_size(args.size)
    src = state_file(args.dir, size)
    want = file_sum(src)
    real = src.stat().st_size
    work = args.dir / "restore-work"
    whole = Path(f"/dev/shm/kvcfs-bigrestore-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    mnt = work / "mnt"
    big = ["--memory-tier-size", str(int(real * 2.5))]
    small = ["--memory-tier-size", args.room]
    here = ROOT / "src"
    variants = [("disk", here, small), ("memory", here, big)]
    if args.old_src is not None:
        variants.append(("old", args.old_src, small))
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in variants}
    results["plain"] = []
    try:
        m = daemon(here, work, whole, big)
        m.start()
        t = time.perf_counter()
        save(src, mnt / "state")
        wait_ingested(mnt)
        print(f"saved {real / MiB:.0f} MiB in {time.perf_counter() - t:.0f} s", flush=True)
        m.stop()
        for rnd in range(args.repeat):
            for name, code, extra in variants:  # interleaved
                # No hot copy: a stop frees the tier (memory_tier_on_stop = free, the default).
                m = daemon(code, work, whole, extra)
                m.start()
                try:
                    r = restore(m, mnt, want, args.dir)
                finally:
                    m.stop()
                results[name].append(r)
                print(f"round {rnd} {name}: {r}", flush=True)
            drop_caches()
            sec0 = disk_sectors(args.dir)
            t = time.perf_counter()
            assert file_sum(src) == want
            seconds = round(time.perf_counter() - t, 2)
            device = round((disk_sectors(args.dir) - sec0) * 512 / MiB, 1)
            results["plain"].append({"seconds": seconds, "device_write_mib_all_processes": device})
            print(f"round {rnd} plain: {results['plain'][-1]}", flush=True)
    finally:
        memfs.unmount(whole)
        shutil.rmtree(whole, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nload average at the end: {os.getloadavg()}")
    plain = min(r["seconds"] for r in results["plain"])
    for name, rs in results.items():
        best = min(r["seconds"] for r in rs)
        print(f"{name}: best {best:.1f} s ({best / plain:.2f}x plain), {[r['seconds'] for r in rs]}")
    if args.json:
        args.json.write_text(
            json.dumps({"size": real, "room": args.room, "load": os.getloadavg(), **results}, indent=1)
        )


if __name__ == "__main__":
    main()
