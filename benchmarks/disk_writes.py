"""Bytes a next-turn save writes to the store's disk, counted by the block device.

    python3 benchmarks/disk_writes.py /var/tmp/kvstates/f16-30M /var/tmp/kvstates/q4_0-10M
    python3 benchmarks/disk_writes.py --mount-args "--durability fsync" FILE ...

For each state file F (and its next turn F.t1): a fresh store is mounted, F is saved (the proxy's
``NAME.tmp`` then rename) and stored; then ``sync``, the device's written-sectors counter
(/sys/block/DEV/stat) is read, F.t1 is saved the same way, the daemon is waited for until
ingestion has stored it, ``sync`` again, and the counter read again. The difference is what the
next-turn save cost the disk: its chunks, pack records, map rows, the new stub, and the file
system's journal. It is set against the chunk bytes the save added (the daemon's ``bytes_written``)
and against the same save into a plain directory on the same disk. Nothing else should write to
the disk meanwhile (the figure is the whole device's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(1, str(HERE))

import bench  # noqa: E402

from kvchunkfs.store import memfs  # noqa: E402

MiB = 1 << 20


def device_of(path: Path) -> str:
    st = os.stat(path)
    sysdev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    name = sysdev.resolve().name
    if not (Path("/sys/block") / name).exists():  # a partition: its disk's stat has it too, use its own
        return str(sysdev.resolve())
    return str(Path("/sys/block") / name)


def written_bytes(dev: str) -> int:
    fields = (Path(dev) / "stat").read_text().split()
    return int(fields[6]) * 512  # sectors written


def save(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, path)


def stats(mnt: Path) -> dict[str, int]:
    return json.loads(os.getxattr(mnt, "user.kvcfs.stats"))


def ingested(mnt: Path) -> None:
    while stats(mnt).get("ingest_queue", 0):
        time.sleep(0.01)


def measure_one(work: Path, f: Path, mount_args: list[str], dev: str) -> dict[str, float]:
    first, nxt = f.read_bytes(), f.with_name(f.name + ".t1").read_bytes()
    store, mnt, plain = work / "store", work / "mnt", work / "plain"
    for d in (mnt, plain):
        d.mkdir()
    env = dict(os.environ, PYTHONPATH=str(HERE.parent / "src"))
    whole = Path(tempfile.mkdtemp(prefix="kvcfs-disk-", dir="/dev/shm"))  # default place, removed after
    mount_args = ["--whole-files-dir", str(whole), *mount_args]
    log = open(work / "daemon.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(store), *mount_args,
                             str(mnt)], stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        while not os.path.ismount(mnt):
            time.sleep(0.05)
            assert proc.poll() is None, (work / "daemon.log").read_text()
        save(mnt / f.name, first)
        ingested(mnt)
        save(plain / f.name, first)
        os.sync()
        time.sleep(1)
        b0, s0 = written_bytes(dev), stats(mnt)["bytes_written"]
        save(mnt / f.name, nxt)
        ingested(mnt)
        os.sync()
        time.sleep(1)
        b1, s1 = written_bytes(dev), stats(mnt)["bytes_written"]
        save(plain / f.name, nxt)
        os.sync()
        time.sleep(1)
        b2 = written_bytes(dev)
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        proc.wait(timeout=60)
        log.close()
        memfs.unmount(whole)
        shutil.rmtree(whole, ignore_errors=True)
    return {"file_bytes": len(nxt), "chunk_bytes_added": s1 - s0, "disk_bytes": b1 - b0, "plain_disk_bytes": b2 - b1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="state files F, each with its next turn F.t1 beside it")
    ap.add_argument("--dir", default="/var/tmp", help="where the store and the plain directory go (one disk)")
    ap.add_argument("--mount-args", default="")
    args = ap.parse_args()
    rows = []
    for f in args.files:
        work = Path(tempfile.mkdtemp(prefix="kvcfs-disk-", dir=args.dir))
        try:
            r = measure_one(work, f, args.mount_args.split(), device_of(work))
        finally:
            bench.remove_work(work)
        rows.append((f.name, r))
    print("| state file | next turn | chunk bytes added | disk bytes (kv-chunk-fs) | ratio | plain file's disk bytes |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        ratio = r["disk_bytes"] / r["chunk_bytes_added"] if r["chunk_bytes_added"] else float("nan")
        print(f"| {name} | {r['file_bytes'] / MiB:.1f} MiB | {r['chunk_bytes_added'] / MiB:.2f} MiB | "
              f"{r['disk_bytes'] / MiB:.2f} MiB | {ratio:.2f}x | {r['plain_disk_bytes'] / MiB:.1f} MiB |")  # fmt: skip


if __name__ == "__main__":
    main()
