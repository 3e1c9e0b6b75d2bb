"""What an index of a million chunks costs the daemon's memory when it is listed and opened.

Builds a store (through the store layer: real chunks in a real pack, real map rows, a real stub)
holding one snapshot ``big`` whose index names ``--chunks`` distinct chunks (1,000,000 by default:
the index of a 64 GiB file of 64 KiB chunks). The chunks are ``--chunk-bytes`` long (64 by default)
so the store stays small: what an index costs depends on its number of entries, not on the bytes
they name. Then mounts it with the real daemon (``kv-chunk-fs mount``; its whole files on a 32 MiB
tmpfs, too small to take the file, as /dev/shm would be for 64 GiB: it is served from its chunks,
not put back whole; the read-ahead as many chunks as the default's 32 MiB of 64 KiB chunks) and reports the daemon's
peak RSS growth (``VmHWM`` reset through ``/proc/PID/clear_refs`` before each step) for:

* mount: the daemon started on the store with ``big`` (its catalog load and GC walk at mount read
  every stub; its map holds the million chunks' rows) against one started on an empty store;
* (an open and read of a small snapshot first: the first open's fixed costs are not the index's)
* ``ls -l`` of the mount directory holding it;
* open, read of 4 KiB in the middle, close; then the RSS a few seconds later (what stays);
* a second open + 4 KiB read (the remembered load).

With ``--bucket``, instead: the index alone (``--chunks`` entries of 64 KiB chunks, 38 MiB for a
million) put as an index object into a real SeaweedFS bucket (tests/seaweed.py), and a daemon on a
new, empty store with that bucket as its remote tier: the peak RSS growth of the ``ls -l`` that
fetches it (the read-through), and what it keeps. With ``--bucket --open``, the store above
uploaded whole (packed layout, the tier's own upload, in process) and then, on the new store, the
``ls -l`` and an open + 4 KiB read (which fetches every chunk into the local packs first).

    python3 benchmarks/index_memory.py                       # 1,000,000 chunks
    python3 benchmarks/index_memory.py --chunks 200000 --keep /tmp/im
    python3 benchmarks/index_memory.py --bucket              # the index fetched from a bucket
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kvchunkfs.store.repository import Repository, StoreSettings  # noqa: E402

BATCH = 50_000
MiB = 1 << 20


def build(store: Path, chunks: int, chunk_bytes: int) -> None:
    """The store with snapshot ``big``: ``chunks`` distinct chunks of ``chunk_bytes`` each."""
    repo = Repository(store, StoreSettings(chunker="cdc"))
    try:
        index = repo.empty_index()
        owner = object()
        for lo in range(0, chunks, BATCH):
            batch = []
            for i in range(lo, min(chunks, lo + BATCH)):
                seed = hashlib.sha256(i.to_bytes(8, "little")).digest()
                data = (seed * (chunk_bytes // 32 + 1))[:chunk_bytes]
                cid = hashlib.sha256(data).digest()
                batch.append((cid, data))
                index.append(cid, chunk_bytes)
            repo.store.put_many(batch, owner)
        repo.install(repo.prepare_stub(index, None, False), "big")
        small = repo.empty_index()
        for cid, _ in batch[:128]:
            small.append(cid, chunk_bytes)
        repo.install(repo.prepare_stub(small, None, False), "small")  # opened first: the fixed costs
        repo.store.unpin(owner)
        repo.sync()
    finally:
        repo.close()


def is_mounted(path: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(path) for line in f)


class Daemon:
    def __init__(
        self, store: Path, mnt: Path, log: Path, readahead: int, whole: Path, extra: tuple[str, ...] = ()
    ) -> None:
        self.store, self.mnt, self.log, self.readahead, self.whole = store, mnt, log, readahead, whole
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        whole = self.whole / self.store.name
        cmd = [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(self.store), "--gc-interval", "0",
               "--hot-tier-size", "1MiB", "--whole-files-dir", str(whole),
               *self.extra, str(self.mnt)]  # fmt: skip
        before = self._settled_lines()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while not (is_mounted(self.mnt) and self._settled_lines() > before):  # catalog loaded, GC walked
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon exited or hung: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        time.sleep(1)

    def _settled_lines(self) -> int:
        """Mounts whose catalog load and GC walk at mount are both done."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return min(text.count("catalog: "), text.count("gc finished"))

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mnt)], check=False, capture_output=True)
        assert self.proc is not None
        self.proc.wait(timeout=300)

    def status(self, key: str) -> float:
        assert self.proc is not None
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return next(int(line.split()[1]) for line in text.splitlines() if line.startswith(key + ":")) / 1024

    def reset_peak(self) -> None:
        assert self.proc is not None
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS

    def peak_growth(self, work: object) -> tuple[float, float]:
        """(peak RSS growth, RSS growth) in MiB over ``work()``."""
        base = self.status("VmRSS")
        self.reset_peak()
        work()  # type: ignore[operator]
        return self.status("VmHWM") - base, self.status("VmRSS") - base


def read_4k(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        assert len(os.pread(fd, 4096, offset)) == 4096
    finally:
        os.close(fd)


def bucket_index(chunks: int) -> bytes:
    """An index of ``chunks`` distinct 64 KiB chunks (their bytes are never read: only listed)."""
    import numpy as np

    from kvchunkfs.format import index as idx

    table = np.zeros(chunks, dtype=[("end", "<u8"), ("id", "V32")])
    table["end"] = np.arange(1, chunks + 1, dtype=np.uint64) * 65536
    table["id"] = np.frombuffer(np.random.default_rng(1).bytes(32 * chunks), "V32")
    return idx.encode(idx.Index._shared((16 << 10, 64 << 10, 256 << 10), table.tobytes(), 0, chunks))


def upload(store: Path, args: argparse.Namespace, bucket: object) -> None:
    """The store with ``big`` built (``build``) and uploaded whole to ``bucket`` (packed layout)."""
    from kvchunkfs.store.bucketformat import BucketFormat
    from kvchunkfs.store.remote import RemoteTier

    if not (store / "snapshots" / "big").exists():
        build(store, args.chunks, args.chunk_bytes)
    repo = Repository(store, StoreSettings(chunker="cdc"))
    try:
        c = repo.chunker
        tier = RemoteTier(repo, bucket, fmt=BucketFormat(2, "cdc", c.min, c.avg, c.max, 0))  # type: ignore[arg-type]
        try:
            tier.check_format()
            tier._sync("big")
        finally:
            tier.close()
    finally:
        repo.close()


def bucket_case(args: argparse.Namespace, work: Path, mnt: Path, whole: Path) -> dict[str, float]:
    """The daemon's memory for an ``ls -l`` that fetches a bucket-only snapshot's index."""
    sys.path.insert(0, str(ROOT / "tests"))
    from seaweed import BUCKET, CREDENTIALS, Weed

    from kvchunkfs.store.s3 import Bucket

    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    weed = Weed(work / "weed")
    weed.start()
    out: dict[str, float] = {}
    try:
        url = f"s3://{BUCKET}/index-memory"
        if args.open:
            upload(work / "store", args, Bucket(url, weed.endpoint, client=weed.client()))
        else:
            data = bucket_index(args.chunks)
            out["index object MiB"] = len(data) / MiB
            Bucket(url, weed.endpoint, client=weed.client()).put_index("big", data, "plain")
            del data
        fresh = work / "fresh"
        shutil.rmtree(fresh, ignore_errors=True)
        Repository(fresh, StoreSettings(chunker="cdc")).close()
        remote = ("--remote", url, "--remote-endpoint", weed.endpoint, "--remote-list-ttl", "0")
        readahead = 512 * (args.chunk_bytes if args.open else 65536)
        daemon = Daemon(fresh, mnt, work / "bucket.log", readahead, whole, remote)
        try:
            daemon.start()
            time.sleep(3)  # the first listing, started at mount
            base = daemon.status("VmRSS")
            out["bucket: ls -l (fetches the index): peak RSS growth MiB"], _ = daemon.peak_growth(
                lambda: subprocess.run(["ls", "-l", str(mnt)], check=True, capture_output=True)
            )
            assert (fresh / "snapshots" / "big").exists(), "ls did not fetch the index"
            if args.open:
                size = args.chunks * args.chunk_bytes
                out["bucket: open+read 4 KiB (fetches every chunk): peak RSS growth MiB"], _ = daemon.peak_growth(
                    lambda: read_4k(mnt / "big", size // 2)
                )
            time.sleep(4)
            out["bucket: RSS kept 4 s later MiB"] = daemon.status("VmRSS") - base
            out["daemon RSS at the end MiB"] = daemon.status("VmRSS")
            daemon.stop()
        finally:
            if daemon.proc is not None and daemon.proc.poll() is None:
                daemon.proc.kill()
                daemon.proc.wait()
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False, capture_output=True)
    finally:
        weed.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=1_000_000)
    ap.add_argument("--chunk-bytes", type=int, default=64)
    ap.add_argument("--keep", type=Path, help="build the store here (reused if it is there)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--bucket", action="store_true", help="the index fetched from a bucket (SeaweedFS) instead")
    ap.add_argument("--open", action="store_true", help="with --bucket: the chunks uploaded too, and an open")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="kvcfs-index-memory-"))
    store, empty, mnt = work / "store", work / "empty", work / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    if args.bucket:
        whole = work / "whole"
        whole.mkdir(exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs", str(whole)], check=True)
        try:
            out = bucket_case(args, work, mnt, whole)
        finally:
            subprocess.run(["umount", "-R", str(whole)], check=False)
            if args.keep is None:
                shutil.rmtree(work, ignore_errors=True)
        return report(out, args.json)
    if not (store / "snapshots" / "big").exists():
        t0 = time.perf_counter()
        build(store, args.chunks, args.chunk_bytes)
        print(f"built {args.chunks} chunks in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    # The default read-ahead (32 MiB) is 512 chunks of 64 KiB: as many of these small ones.
    readahead = 512 * args.chunk_bytes
    whole = work / "whole"
    whole.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs", str(whole)], check=True)
    shutil.rmtree(empty, ignore_errors=True)
    Repository(empty, StoreSettings(chunker="cdc")).close()
    daemon = Daemon(empty, mnt, work / "empty.log", readahead, whole)
    out: dict[str, float] = {}
    size = args.chunks * args.chunk_bytes
    try:
        daemon.start()
        without = daemon.status("VmHWM"), daemon.status("VmRSS")
        daemon.stop()
        daemon = Daemon(store, mnt, work / "daemon.log", readahead, whole)
        daemon.start()
        out["mount (catalog load): peak RSS growth MiB"] = daemon.status("VmHWM") - without[0]
        out["mount: RSS growth after MiB"] = daemon.status("VmRSS") - without[1]
        read_4k(mnt / "small", 0)  # the first open's fixed costs (threads, buffers) are not the index's
        time.sleep(4)
        out["ls -l: peak RSS growth MiB"], _ = daemon.peak_growth(
            lambda: subprocess.run(["ls", "-l", str(mnt)], check=True, capture_output=True)
        )
        base = daemon.status("VmRSS")
        out["open+read 4 KiB: peak RSS growth MiB"], _ = daemon.peak_growth(lambda: read_4k(mnt / "big", size // 2))
        time.sleep(4)  # past reopen_linger and the idle trim
        out["open+read 4 KiB: RSS kept 4 s later MiB"] = daemon.status("VmRSS") - base
        out["second open+read 4 KiB: peak RSS growth MiB"], _ = daemon.peak_growth(
            lambda: read_4k(mnt / "big", size // 3)
        )
        out["daemon RSS at the end MiB"] = daemon.status("VmRSS")
        daemon.stop()
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False, capture_output=True)
        subprocess.run(["umount", "-R", str(whole)], check=False)  # with the tmpfs each daemon mounted in it
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return report(out, args.json)


def report(out: dict[str, float], path: Path | None) -> int:
    out = {k: round(v, 1) for k, v in out.items()}
    print(json.dumps(out, indent=1))
    if path:
        path.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
