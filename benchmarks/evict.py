"""``local_cache_size`` on a local SeaweedFS: one snapshot saved past the limit, the eviction pass
(from the daemon's log), a restore of the evicted snapshot (only the evicted chunks are fetched back)
and a second restore (local packs only). Needs root (drops caches) and ``weed`` on PATH.

    python3 benchmarks/evict.py                          # 415 MiB, limit 128 MiB
    python3 benchmarks/evict.py --size 100MiB --limit 32MiB
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from conftest import Mount  # noqa: E402
from remote import drop_caches, read_file, timed, wait_drained, write_file  # noqa: E402
from seaweed import BUCKET, CREDENTIALS, Weed  # noqa: E402

from kvchunkfs.units import parse_size  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="415MiB")
    p.add_argument("--limit", default="128MiB")
    args = p.parse_args()
    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    work = Path(tempfile.mkdtemp(prefix="kvcfs-evict-bench-", dir="/var/tmp"))
    weed = Weed(work / "weed")
    weed.start()
    base = ["--remote", f"s3://{BUCKET}/evict", "--remote-endpoint", weed.endpoint, "--gc-interval", "0"]
    a = Mount(work / "a/store", work / "a/mnt", work / "a/log", [*base, "--local-cache-size", args.limit])
    try:
        a.start()
        write_file(a.path("old"), os.urandom(parse_size(args.size)))
        wait_drained(a)
        deadline = time.monotonic() + 300
        while a.stats()["evicted_chunks"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # the pass logs its summary after compacting
        passes = [line for line in a.log().splitlines() if "eviction:" in line]
        print(passes[-1].split("INFO ", 1)[-1] if passes else "no eviction pass logged")
        packs = sum(f.stat().st_size for f in (a.store / "packs").iterdir())
        print(f"packs after eviction: {packs} bytes (limit {parse_size(args.limit)})")
        a.remount(base)  # eviction off while restoring: no pass runs during the timing
        drop_caches()
        t = timed(read_file, a.path("old"))
        print(f"restore of the evicted snapshot: {t:.3f} s, {a.stats()['remote_chunk_gets']} chunk GETs")
        a.remount(base)
        drop_caches()
        t = timed(read_file, a.path("old"))
        print(f"second restore (local packs): {t:.3f} s, {a.stats()['remote_chunk_gets']} chunk GETs")
    finally:
        if a.proc is not None:
            a.stop()
        weed.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
