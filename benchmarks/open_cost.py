"""The daemon's cost per open of a hot snapshot: CPU (utime + stime of the daemon) and wall time
per open + read + close of a 10 MiB snapshot whose whole copy is in the memory tier.

    python3 benchmarks/open_cost.py --src A=src --src B=/tmp/old/src [--opens 1000]

Per code tree and mode (passthrough, served: ``KV_CHUNK_FS_FUSE_PASSTHROUGH=false``) and per
``reopen_linger`` (0: every open loads the snapshot from its hot copy; 1: the default, a reopen
within a second takes the content still loaded), a fresh store: the file saved and ingested, read
once (its hot copy), then ``--opens`` times opened, read whole in 1 MiB reads and closed. Trees
and modes are interleaved, ``--rounds`` times; the best round is reported.
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

from benchmarks.bench import Mount  # noqa: E402
from benchmarks.bigfile_rss import stats, wait_ingested  # noqa: E402
from kvchunkfs.store import memfs  # noqa: E402

MiB = 1 << 20
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def run(src: Path, served: bool, linger: int, data: bytes, opens: int, work: Path) -> dict[str, float]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    whole = Path(f"/dev/shm/kvcfs-opencost-{os.getpid()}")
    shutil.rmtree(whole, ignore_errors=True)
    argv = [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(work / "store"), "--whole-files-dir",
            str(whole), "--reopen-linger", str(linger), str(work / "mnt")]  # fmt: skip
    old = os.environ.get("KV_CHUNK_FS_FUSE_PASSTHROUGH")
    os.environ["KV_CHUNK_FS_FUSE_PASSTHROUGH"] = "false" if served else "true"
    m = Mount(argv, work / "mnt", work / "daemon.log", 4096, "gc finished", src=src)
    try:
        m.start()
        path = work / "mnt" / "s"
        path.write_bytes(data)
        wait_ingested(work / "mnt")
        assert path.read_bytes() == data
        time.sleep(1.5)  # the linger of that read is over
        c0, t0 = cpu_seconds(m.pid), time.perf_counter()
        for _ in range(opens):
            fd = os.open(path, os.O_RDONLY)
            try:
                while os.read(fd, MiB):
                    pass
            finally:
                os.close(fd)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(m.pid) - c0
        st = stats(work / "mnt")
        return {"wall_ms_per_open": round(1000 * wall / opens, 3), "cpu_ms_per_open": round(1000 * cpu / opens, 3),
                "reopens": st.get("reopens", 0), "restores": st.get("restores", 0)}  # fmt: skip
    finally:
        m.stop()
        if old is None:
            os.environ.pop("KV_CHUNK_FS_FUSE_PASSTHROUGH", None)
        else:
            os.environ["KV_CHUNK_FS_FUSE_PASSTHROUGH"] = old
        memfs.unmount(whole)
        shutil.rmtree(whole, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", action="append", required=True, help="NAME=PATH of a src/ tree (repeatable)")
    ap.add_argument("--opens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/kvcfs-opencost"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    trees = [(s.split("=", 1)[0], Path(s.split("=", 1)[1]).resolve()) for s in args.src]
    data = os.urandom(10 * MiB)
    results: dict[str, list[dict[str, float]]] = {}
    for rnd in range(args.rounds):
        for served in (False, True):
            for linger in (0, 1):
                for name, src in trees:
                    key = f"{name} {'served' if served else 'passthrough'} linger={linger}"
                    r = run(src, served, linger, data, args.opens, args.dir / "work")
                    results.setdefault(key, []).append(r)
                    print(f"round {rnd} {key}: {r} load {os.getloadavg()[0]:.2f}", flush=True)
    print()
    for key, rs in results.items():
        best = min(rs, key=lambda r: r["cpu_ms_per_open"])
        print(f"{key}: cpu {best['cpu_ms_per_open']:.3f} ms/open (best of {len(rs)}), "
              f"wall {min(r['wall_ms_per_open'] for r in rs):.3f} ms/open")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
