"""Per-request profile of the daemon: CPU and wall time per CREATE, OPEN of a hot snapshot, the
writer's FLUSH and RELEASE (and the reader's), as the daemon spends them.

A daemon is mounted on a fresh store (default memory tier) with its session's request dispatch
timed: for each request, the wall time from its dispatch to its reply and the process CPU time
(``time.process_time``: every thread's, so a request's worker-thread hops count) spent meanwhile.
One client makes one request at a time, and waits for ingestion to finish between saves, so the
CPU time of a request is its own (ingestion's runs in between, not counted). Phases:

* saves: ``--saves`` files of ``--size`` random bytes, each created (CREATE), written (WRITE) and
  closed (FLUSH, then RELEASE);
* restores: each saved file (a hot copy once ingested) opened read-only (OPEN), its header read,
  closed (FLUSH, RELEASE), one file after another (``--reopen-linger 0``: no content kept).

The whole phase's daemon CPU is also sampled from /proc/PID/stat (utime+stime) as a cross-check.
``--src`` runs the daemon from another source tree (e.g. a ``git archive`` of main):

    python3 benchmarks/request_profile.py --saves 30 --size 10MiB
    KV_CHUNK_FS_FUSE_PASSTHROUGH=false python3 benchmarks/request_profile.py --src /tmp/main/src
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPS = ("CREATE", "OPEN", "WRITE", "FLUSH", "RELEASE")


def daemon(dump: str, argv: list[str]) -> None:
    """The daemon's process: ``kv-chunk-fs mount`` with the session's dispatch timed. SIGUSR2
    writes the figures so far to ``dump`` and starts afresh."""
    from kvchunkfs.cli.main import main
    from kvchunkfs.fuse import protocol, session

    figures: dict[str, list[float]] = {}  # opcode name -> [count, wall seconds, cpu seconds]
    handle = session.Session._handle

    async def timed(self: session.Session, view: memoryview, n: int) -> None:
        opcode = view[4] | view[5] << 8 | view[6] << 16 | view[7] << 24
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            await handle(self, view, n)
        finally:
            name = protocol.Op(opcode).name if opcode in protocol.Op._value2member_map_ else str(opcode)
            f = figures.setdefault(name, [0, 0.0, 0.0])
            f[0] += 1
            f[1] += time.perf_counter() - w0
            f[2] += time.process_time() - c0

    def write_out(*_: object) -> None:
        Path(dump).write_text(json.dumps(figures))
        figures.clear()

    session.Session._handle = timed  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR2, write_out)
    sys.exit(main(argv))


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * m)
    return int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--saves", type=int, default=30)
    ap.add_argument("--size", default="10MiB")
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the source tree the daemon runs")
    ap.add_argument("--json", type=Path, help="also write the table here")
    args = ap.parse_args()
    size = _size(args.size)
    base = Path(tempfile.mkdtemp(prefix="kvcfs-reqprof-"))
    store, mnt, log, dump = base / "store", base / "mnt", base / "daemon.log", base / "figures.json"
    mnt.mkdir()
    env = dict(os.environ, PYTHONPATH=f"{args.src}{os.pathsep}{Path(__file__).resolve().parent}")
    mount = ["mount", "--store", str(store), "--whole-files-dir", "", "--reopen-linger", "0", str(mnt)]
    code = f"import request_profile as p; p.daemon({str(dump)!r}, {mount!r})"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=env)
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        while "fuse.daemon: mounted" not in log.read_text():
            if proc.poll() is not None:
                sys.exit(log.read_text())
            time.sleep(0.05)

        def stats() -> dict[str, int]:
            return json.loads(os.getxattr(mnt, "user.kvcfs.stats"))

        def settle() -> None:
            deadline = time.monotonic() + 120
            while (stats().get("ingest_queue") or stats().get("open_files")) and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.05)

        def collect(phase: str, cpu0: float, n: int) -> None:
            dump.unlink(missing_ok=True)
            proc.send_signal(signal.SIGUSR2)
            while not dump.exists():
                time.sleep(0.01)
            time.sleep(0.05)
            figs = json.loads(dump.read_text())
            results[phase] = {
                op: {"count": f[0], "wall_ms": f[1] / f[0] * 1000, "cpu_ms": f[2] / f[0] * 1000}
                for op, f in figs.items()
                if op in OPS and f[0]
            }
            per_file = (_cpu(proc.pid) - cpu0) / n * 1000  # every request and ingestion: a cross-check
            results[phase]["(phase, /proc)"] = {"count": n, "wall_ms": 0.0, "cpu_ms": per_file}

        settle()
        proc.send_signal(signal.SIGUSR2)  # mount's own requests: not counted
        time.sleep(0.2)
        data = [os.urandom(size) for _ in range(2)]
        cpu0 = _cpu(proc.pid)
        for i in range(args.saves):
            fd = os.open(mnt / f"s{i}", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            view = memoryview(data[i % 2])
            for k in range(0, size, 1 << 20):
                os.write(fd, view[k : k + (1 << 20)])
            os.close(fd)
            settle()  # ingestion's CPU between requests, not in them
        collect("saves", cpu0, args.saves)
        cpu0 = _cpu(proc.pid)
        for i in range(args.saves):
            fd = os.open(mnt / f"s{i}", os.O_RDONLY)
            os.pread(fd, 4096, 0)
            os.close(fd)
            settle()
        collect("restores", cpu0, args.saves)
        st = stats()
        mode = "passthrough" if st.get("fuse_passthrough") else "served"
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        proc.wait(timeout=300)
        shutil.rmtree(base, ignore_errors=True)
    load = os.getloadavg()
    print(f"daemon from {args.src}; {mode}; {args.saves} saves of {size >> 20} MiB; load {load[0]:.2f} {load[1]:.2f}")
    print(f"{'phase':9} {'request':15} {'count':>5} {'wall ms':>9} {'cpu ms':>8}")
    for phase, ops in results.items():
        for op, f in ops.items():
            print(f"{phase:9} {op:15} {f['count']:5d} {f['wall_ms']:9.3f} {f['cpu_ms']:8.3f}")
    if args.json:
        args.json.write_text(json.dumps({"mode": mode, "load": load, "results": results}, indent=1))


if __name__ == "__main__":
    main()
