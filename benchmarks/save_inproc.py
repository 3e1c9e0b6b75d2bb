"""A save stored in process, no FUSE: what ingestion does with a staged file, alone.

Random bytes in a staged file (in /dev/shm, as the memory tier), stored as a save is
(``FileContent.prepare``: file/chunking.py); "new" is a save of bytes the store lacks, "stored"
the same bytes again under a new file (its chunks predicted). Each round uses a fresh store per
setting, ``predict_chunks`` on and off, alternating; medians of wall and process CPU time (every
thread). The store goes under ``--dir``.
``--state`` saves an f16-shaped llama.cpp state file instead (32 layers, 1 KiB rows, as many cells
as fit ``--size``): the relayout path with its groups, checksums and stored-form check; "next" is
then its next turn (2% more tokens) saved after it.

    PYTHONPATH=src python3 benchmarks/save_inproc.py --size 200MiB --rounds 5
    PYTHONPATH=src python3 benchmarks/save_inproc.py --size 40MiB --rounds 9 --state
    PYTHONPATH=src python3 benchmarks/save_inproc.py --size 1GiB --rounds 6 --state
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(1, str(ROOT))  # e2e/ggsq.py: the state files of --state

from kvchunkfs import config as cfgmod  # noqa: E402
from kvchunkfs.file.files import Files  # noqa: E402
from kvchunkfs.store.repository import Repository, StoreSettings  # noqa: E402

MiB = 1 << 20
OPS = {False: ("new", "stored"), True: ("new", "next", "stored")}


def save(files: Files, data: bytes) -> tuple[float, float]:
    """(wall, CPU) seconds of storing one staged save."""
    fd, path = tempfile.mkstemp(prefix="kvcfs-staged-", dir="/dev/shm")
    try:
        os.unlink(path)
        for off in range(0, len(data), MiB):
            os.pwrite(fd, data[off : off + MiB], off)
        content = files.content(files.repo.empty_index())
        content.use_whole(os.dup(fd), None)
        t0, c0 = time.perf_counter(), time.process_time()
        content.prepare()
        took = time.perf_counter() - t0, time.process_time() - c0
        content.close()
    finally:
        os.close(fd)
    return took


def state_file(size: int, seed: int, more: float = 0.0) -> bytes:
    """A state file of about ``size`` bytes: 32 layers of 1 KiB K and V rows (64 KiB a cell);
    ``more``: that many more tokens of the same conversation (a next turn)."""
    from e2e import ggsq

    spec = ggsq.Spec(n_layer=32, row_bytes=1024)
    n = max(1, size // spec.bytes_per_token)
    return ggsq.synthetic_bytes(ggsq.synthetic_tokens(n + int(n * more), seed), spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="200MiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--state", action="store_true", help="a llama.cpp state file (f16-shaped), not random bytes")
    args = p.parse_args()
    size = cfgmod.parse_size(args.size)
    res: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for rnd in range(args.rounds):
        data = state_file(size, rnd) if args.state else os.urandom(size)
        turn = state_file(size, rnd, 0.02) if args.state else data
        for predict in (True, False) if rnd % 2 == 0 else (False, True):
            root = Path(tempfile.mkdtemp(prefix="kvcfs-inproc-", dir=args.dir))
            files = Files(Repository(root, StoreSettings(predict_chunks=predict)))
            try:
                for op in OPS[args.state]:
                    res.setdefault((op, predict), []).append(save(files, turn if op == "next" else data))
            finally:
                files.close()
                files.repo.close()
                shutil.rmtree(root, ignore_errors=True)
    print(f"{args.size}, {args.rounds} rounds, medians: wall s / CPU s")
    for op in OPS[args.state]:
        on, off = res[(op, True)], res[(op, False)]
        cells = [f"{statistics.median(x[i] for x in runs):.3f}" for runs in (off, on) for i in (0, 1)]
        print(f"{op:7} predict off {cells[0]} / {cells[1]}   on {cells[2]} / {cells[3]}")


if __name__ == "__main__":
    main()
