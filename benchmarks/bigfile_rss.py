"""A big state-shaped file saved and restored through a mount, byte-exact, with the daemon's peak
resident memory (VmHWM) of each step against ``cache_size`` + 64 MiB.

    python3 benchmarks/bigfile_rss.py                      # 4 GiB, with the hot tier, then chunks only
    python3 benchmarks/bigfile_rss.py --size 1G --dir /var/tmp/x

The file is llama-server's layout (e2e/ggsq.py, flash attention) with a Llama-3-8B's KV shape (32
layers, f16 rows of 2 KiB: 4 GiB is a 32k-token context), its rows random bytes (nothing dedups),
generated once into ``--dir``. Per mode (default settings;
``--hot-tier-size 0``: chunks only), a fresh store: the file is saved (written in 1 MiB pieces,
closed, stored by ingestion), the daemon restarted, and the file restored (read back and compared
with the source); with the hot tier the restore reads its whole copy, so its copies are then
deleted (as after a reboot) and it is restored again from the chunks. The peak is reset
(``/proc/PID/clear_refs``) before each step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(1, str(ROOT))

from benchmarks.bench import Mount, drop_caches, mount_config  # noqa: E402
from e2e import ggsq  # noqa: E402
from kvchunkfs.store import memfs  # noqa: E402
from kvchunkfs.units import parse_size  # noqa: E402

MiB = 1 << 20
PIECE = 1 << 20
SPEC = ggsq.Spec(n_layer=32, row_bytes=2048)


def generate(path: Path, size: int) -> None:
    """A state file of about ``size`` bytes in ggsq's layout, its rows random (fast: a pool of
    random bytes, sliced per row)."""
    tokens = ggsq.synthetic_tokens(max(1, size // SPEC.kv_bytes_per_token), seed=4)
    pool = np.random.default_rng(7).bytes(64 * MiB + SPEC.row_bytes)
    view = memoryview(pool)
    rows = (64 * MiB) // SPEC.row_bytes

    def row(h: bytes, layer: int, kind: bytes, n: int) -> memoryview:
        at = (int.from_bytes(h[:8], "little") + layer * 7919 + kind[0]) % rows * SPEC.row_bytes
        return view[at : at + n]

    saved = ggsq._row
    ggsq._row = row  # type: ignore[assignment]
    try:
        tmp = path.with_suffix(".part")
        ggsq.write_synthetic(tmp, tokens, SPEC, buffering=8 * MiB)
        tmp.rename(path)
    finally:
        ggsq._row = saved  # type: ignore[assignment]


def state_file(directory: Path, size: int) -> Path:
    """The generated state file of ``size`` bytes in ``directory`` (made once, then reused)."""
    directory.mkdir(parents=True, exist_ok=True)
    src = directory / f"state-{size >> 20}M"
    if not src.exists():
        print(f"generating {src} ...", flush=True)
        generate(src, size)
    return src


def file_sum(path: Path) -> bytes:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while piece := f.read(8 * MiB):
            h.update(piece)
    return h.digest()


def status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def stats(mnt: Path) -> dict[str, int]:
    return json.loads(os.getxattr(mnt, "user.kvcfs.stats"))


def wait_ingested(mnt: Path, timeout: float = 3600) -> None:
    deadline = time.monotonic() + timeout
    while stats(mnt).get("ingest_queue", 0):
        if time.monotonic() > deadline:
            raise RuntimeError("ingestion did not finish")
        time.sleep(0.2)


def save(src: Path, dst: Path) -> None:
    with open(src, "rb", buffering=0) as f, open(dst, "wb", buffering=0) as out:
        while piece := f.read(PIECE):
            out.write(piece)


def step(m: Mount, name: str, run: object, out: dict[str, dict[str, float]]) -> None:
    reset_peak(m.pid)
    t = time.perf_counter()
    result = run()  # type: ignore[operator]
    seconds = time.perf_counter() - t
    out[name] = {"seconds": round(seconds, 2), "peak_rss_mib": round(status(m.pid, "VmHWM") / MiB, 1)}
    if isinstance(result, dict):
        out[name].update(result)
    print(f"  {name}: {seconds:.1f} s, daemon peak RSS {out[name]['peak_rss_mib']:.0f} MiB", flush=True)


def mode(work: Path, src: Path, want: bytes, extra: list[str], whole: Path) -> dict[str, dict[str, float]]:
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    shutil.rmtree(whole, ignore_errors=True)
    argv = [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(work / "store"),
            "--whole-files-dir", str(whole), *extra, str(work / "mnt")]  # fmt: skip
    m = Mount(argv, work / "mnt", work / "daemon.log", mount_config(extra).kernel_readahead_kb, "gc finished")
    out: dict[str, dict[str, float]] = {}
    mnt = work / "mnt" / "state"

    def restore() -> dict[str, float]:
        drop_caches()
        before = stats(work / "mnt")
        ok = file_sum(mnt) == want
        if not ok:
            raise SystemExit(f"restored bytes differ ({' '.join(extra) or 'default settings'})")
        after = stats(work / "mnt")
        return {"put_back": after.get("hot_put_backs", 0) - before.get("hot_put_backs", 0), "byte_exact": 1}

    m.start()
    try:
        print(f"{' '.join(extra) or 'default settings'}: idle daemon RSS {status(m.pid, 'VmRSS') / MiB:.0f} MiB")
        step(m, "save + ingestion", lambda: (save(src, mnt), wait_ingested(work / "mnt")), out)
        m.restart()
        step(m, "restore after a restart", restore, out)
        if not any("hot-tier-size" in a for a in extra):
            m.stop()
            for f in (whole / "hot").iterdir():  # as after a reboot: chunks only
                f.unlink()
            m.start()
            step(m, "restore from the chunks", restore, out)
    finally:
        m.stop()
        memfs.unmount(whole)  # as root the daemon leaves its tmpfs there, mounted for its next start
        shutil.rmtree(whole, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="4G", help="state file size (default 4G)")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/kvcfs-bigfile"), help="file, stores (a disk)")
    ap.add_argument("--whole-files-dir", type=Path, default=None, help="default: /dev/shm/kvcfs-bigfile-PID")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    size = parse_size(args.size)
    src = state_file(args.dir, size)
    want = file_sum(src)
    bound = mount_config([]).cache_size + 64 * MiB
    print(f"{src}: {src.stat().st_size / MiB:.0f} MiB; bound cache_size + 64 MiB = {bound / MiB:.0f} MiB")
    whole = args.whole_files_dir or Path(f"/dev/shm/kvcfs-bigfile-{os.getpid()}")
    results = {}
    for extra in ([], ["--hot-tier-size", "0"]):
        results[" ".join(extra) or "default"] = mode(args.dir / "work", src, want, extra, whole)
    print("\nstep | peak RSS MiB | within bound")
    for name, steps in results.items():
        for s, r in steps.items():
            print(f"{name}: {s} | {r['peak_rss_mib']:.0f} | {'yes' if r['peak_rss_mib'] * MiB <= bound else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps({"bound_mib": bound / MiB, "size": src.stat().st_size, **results}, indent=1))
    shutil.rmtree(args.dir / "work", ignore_errors=True)


if __name__ == "__main__":
    main()
