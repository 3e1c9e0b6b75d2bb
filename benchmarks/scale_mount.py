"""The scale benchmark through a real mount: how long until the mountpoint is ready, and how long a
file read waits while the daemon walks, collects, lists or is scraped.

Mounts a store built by ``scale.py --keep DIR`` with the real daemon (``kv-chunk-fs mount``), then:

* remount: seconds from starting the daemon to a mountpoint that answers, after a clean unmount
  and after kill -9;
* a probe thread that opens one snapshot, reads 4 KiB with O_DIRECT (the daemon answers, not the
  page cache) and closes it, over and over; the slowest probe and the 99th percentile are
  reported while nothing else runs, and while each of these runs through the API's unix socket:
  a GC walk of every stub, a GC of the changes after 100 snapshots were deleted through the
  mount, full listings, a prefix tree after a change, metrics scrapes, and 10 s of back-to-back
  saves of 1.75 MiB files (``NAME.tmp``, then rename) through the mount;
* the daemon's RSS and open fds afterwards, and its RSS once idle.

    python3 benchmarks/scale.py --sizes 50000 --keep /tmp/stores     # build (and measure in-process)
    python3 benchmarks/scale_mount.py /tmp/stores/store-50000
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kvchunkfs.service.apiclient import DaemonClient  # noqa: E402

DELETE = 100
SAVE_BYTES = 1_835_008  # 1.75 MiB: the saves another snapshot's reads wait beside
SAVE_SECONDS = 10.0


def back_to_back_saves(mnt: Path, seconds: float = SAVE_SECONDS) -> int:
    """Save 1.75 MiB files in a loop for ``seconds`` as llama-server's proxy does (``NAME.tmp``,
    1 MiB writes, close, rename over ``NAME``), each a different state of a few names."""
    rng = random.Random(5)
    saves, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        data = rng.randbytes(SAVE_BYTES)
        name = mnt / f"saver-{saves % 4}"
        tmp = name.with_name(name.name + ".tmp")
        with open(tmp, "wb") as f:
            for i in range(0, len(data), 1 << 20):
                f.write(data[i : i + (1 << 20)])
        os.rename(tmp, name)
        saves += 1
    return saves


def is_mounted(path: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(path) for line in f)


class Daemon:
    def __init__(self, store: Path, mnt: Path, log: Path) -> None:
        self.store, self.mnt, self.log = store, mnt, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Seconds until the mountpoint answers (a stat of a snapshot through it)."""
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        cmd = [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(self.store), "--gc-interval", "0",
               str(self.mnt)]  # fmt: skip
        mounted_before = self._mounted_lines()
        t0 = time.perf_counter()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        while not (is_mounted(self.mnt) and self._mounted_lines() > mounted_before):
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.005)
        os.listdir(self.mnt)
        return time.perf_counter() - t0

    def _mounted_lines(self) -> int:
        return self.log.read_text(errors="replace").count("kvchunkfs.fuse.daemon: mounted ") if self.log.exists() else 0

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mnt)], check=False, capture_output=True)
        assert self.proc is not None
        self.proc.wait(timeout=120)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], check=False, capture_output=True)

    def settle(self, timeout: float = 600) -> tuple[float, float]:
        """Wait for this start's catalog load and GC walk; their durations as logged."""
        done: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while len(done) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("no catalog load and GC after the mount")
            time.sleep(0.05)
            text = self.log.read_text(errors="replace")
            this_start = text[text.rindex("kvchunkfs.fuse.daemon: mounted ") :]
            for key, pattern in (("catalog", r"catalog: \d+ snapshots read in ([\d.]+)s"),
                                 ("gc", r"gc finished: .*; ([\d.]+)s; every stub read")):  # fmt: skip
                found = re.search(pattern, this_start)
                if found:
                    done[key] = float(found.group(1))
        return done["catalog"], done["gc"]

    def proc_status(self) -> tuple[float, int]:
        """(RSS MiB, open fds) of the daemon."""
        assert self.proc is not None
        pid = self.proc.pid
        rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))  # fmt: skip
        return rss / 1024, len(os.listdir(f"/proc/{pid}/fd"))


class Probe:
    """Open, read 4 KiB with O_DIRECT, close: the latency of each, in a loop on its own thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Probe:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def _run(self) -> None:
        buf = mmap.mmap(-1, 4096)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            try:
                os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
            self.times.append(time.perf_counter() - t0)
            time.sleep(0.002)


def during(probe_path: Path, work: Callable[[], object]) -> dict[str, float]:
    with Probe(probe_path) as probe:
        time.sleep(0.2)
        t0 = time.perf_counter()
        work()
        took = time.perf_counter() - t0
        time.sleep(0.2)
    times = sorted(probe.times)
    return {"took_s": took, "probes": len(times), "max_ms": 1000 * times[-1],
            "p99_ms": 1000 * times[int(0.99 * (len(times) - 1))],
            "median_ms": 1000 * statistics.median(times)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvcfs-scale-mount-"))
    mnt = work / "mnt"
    mnt.mkdir()
    daemon = Daemon(args.store.resolve(), mnt, work / "daemon.log")
    out: dict[str, object] = {}
    try:
        daemon.start()
        daemon.settle()
        daemon.stop()
        out["remount after a clean unmount: ready (s)"] = daemon.start()
        daemon.settle()
        daemon.kill()
        out["remount after kill -9: ready (s)"] = daemon.start()
        out["catalog load after it (s)"], out["GC walk at mount (s)"] = daemon.settle()
        client = DaemonClient(args.store, timeout=600)
        names = sorted(p.relative_to(mnt).as_posix() for p in (mnt / "00").iterdir())
        probe = mnt / names[0]
        out["idle"] = during(probe, lambda: time.sleep(2))
        out["GC walk of every stub"] = during(probe, lambda: client.json("POST", "/gc", {"walk": "true"}))
        for rel in names[1 : 1 + DELETE]:
            os.unlink(mnt / rel)
        out[f"GC of the changes after deleting {DELETE}"] = during(probe, lambda: client.json("POST", "/gc"))
        out["GET /snapshots (all) x5"] = during(probe, lambda: [client.request("GET", "/snapshots") for _ in range(5)])
        out["GET /stats x5"] = during(probe, lambda: [client.request("GET", "/stats") for _ in range(5)])
        os.utime(mnt / names[-1])  # a touch: the catalog re-reads that row, the tree is built again
        out["GET /prefix-tree after a change"] = during(probe, lambda: client.request("GET", "/prefix-tree"))
        out["GET /metrics x20"] = during(probe, lambda: [client.request("GET", "/metrics") for _ in range(20)])
        saves: list[int] = []
        out["back-to-back saves of 1.75 MiB"] = during(probe, lambda: saves.append(back_to_back_saves(mnt)))
        out["saves made"] = saves[0]
        rss, fds = daemon.proc_status()
        out["daemon RSS right after (MiB)"], out["daemon open fds"] = rss, fds
        time.sleep(4)  # no file open for 2 s: the daemon gives freed heap back (fuse/daemon.py trim_when_idle)
        out["daemon RSS when idle (MiB)"] = daemon.proc_status()[0]
        daemon.stop()
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.kill()
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
