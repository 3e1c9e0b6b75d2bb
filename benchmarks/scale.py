"""How the daemon's per-request costs grow with the number of snapshots in a store.

Builds stores of N snapshots through the store layer (real chunks in real packs, real stubs and
map rows; no FUSE), shaped like llama-server slot saves: every snapshot is a ggsq file whose first
chunk holds its token header, then chunks of its group's shared system prompt, chunks it shares with
the earlier turns of its conversation, and chunks of its own (~40 chunk references a snapshot, ~2 M
at 50,000). Then measures, in one process over the same code the daemon runs (``api.Service``):

* remount: opening the store and recovery (not the FUSE mount itself), with every stub checked, after
  a clean unmount, and as after kill -9;
* the catalog's one-time load (in the background after mounting) and the process RSS after it;
* ``GET /snapshots`` in full and its first page, ``GET /stats``, ``GET /prefix-tree``, ``GET /metrics``
  (each rendered to JSON/text as the API does), and a listing right after one more save;
* GC: a walk of every stub with nothing to free; a collection of the changes with nothing to
  free and after deleting 100 snapshots (then a walk, which must find nothing more); and the old
  way (``catalog.snapshots``: every stub read per listing).

    python3 benchmarks/scale.py                      # N = 1000 10000 50000
    python3 benchmarks/scale.py --sizes 1000 10000 --keep /tmp/stores
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kvchunkfs.config import Config  # noqa: E402
from kvchunkfs.file.files import Files  # noqa: E402
from kvchunkfs.format.index import Index  # noqa: E402
from kvchunkfs.maint.gc import run_gc  # noqa: E402
from kvchunkfs.maint.gcchanges import collect_changes  # noqa: E402
from kvchunkfs.maint.recovery import recover  # noqa: E402
from kvchunkfs.service import catalog, prefixtree  # noqa: E402
from kvchunkfs.service.api import JSONResponse, Service  # noqa: E402
from kvchunkfs.store.repository import Repository, StoreSettings  # noqa: E402

SETTINGS = StoreSettings(chunk_min=256, chunk_avg=512, chunk_max=1024, cache_size=64 << 20)
GROUPS = 16  # system prompts
TURNS = 10  # snapshots per conversation
PROMPT_CHUNKS = 24  # chunks of a group's system prompt, shared by every snapshot of the group
TURN_CHUNKS = 2  # chunks each turn adds to its conversation (later turns name the earlier ones)
OWN_CHUNKS = 4
CHUNK = 512
BATCH = 250  # snapshots per put_many call
DELETE = 100  # snapshots deleted before a GC of the changes (the same at every N: its cost should not grow)


def _data(key: str, size: int = CHUNK) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (seed * (size // 64 + 1))[:size]


def _header(g: int, c: int, t: int) -> bytes:
    tokens = [1000 + g] * 200 + [c] * (20 * (t + 1)) + [t]
    return struct.pack(f"<3I{len(tokens)}i", prefixtree.MAGIC, 4, len(tokens), *tokens)


def _snapshot(s: int) -> tuple[str, list[tuple[str, bytes | None]]]:
    """(path, chunk keys in order; data given for the header, made from the key otherwise)."""
    c, t = divmod(s, TURNS)
    g = c % GROUPS
    keys: list[tuple[str, bytes | None]] = [(f"h{s}", _header(g, c, t))]
    keys += [(f"g{g}.{j}", None) for j in range(PROMPT_CHUNKS)]
    keys += [(f"c{c}.{j}", None) for j in range(TURN_CHUNKS * (t + 1))]
    keys += [(f"s{s}.{j}", None) for j in range(OWN_CHUNKS)]
    return f"{g:02d}/conv{c:05d}-turn{t:02d}.bin", keys


def build(root: Path, n: int, start: int = 0) -> None:
    repo = Repository(root, SETTINGS)
    known: dict[str, bytes] = {}  # key -> chunk id (shared chunks are hashed once)
    try:
        for lo in range(start, start + n, BATCH):
            owner = object()
            new: dict[bytes, bytes] = {}
            stubs: list[tuple[str, Index]] = []
            for s in range(lo, min(start + n, lo + BATCH)):
                rel, keys = _snapshot(s)
                index = repo.empty_index()
                for key, data in keys:
                    cid = known.get(key) if data is None else None
                    if cid is None:
                        data = data if data is not None else _data(key)
                        cid = hashlib.sha256(data).digest()
                        new[cid] = data
                        if key[0] in "gc":
                            known[key] = cid
                        index.append(cid, len(data))
                    else:
                        index.append(cid, CHUNK)
                stubs.append((rel, index))
            repo.store.put_many(list(new.items()), owner)
            for rel, index in stubs:
                repo.path(rel).parent.mkdir(exist_ok=True)
                repo.install(repo.prepare_stub(index, None, False), rel)
            repo.store.unpin(owner)
        repo.sync()
    finally:
        repo.close()


def timed(fn: Callable[[], Any], runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def measure(root: Path, n: int, old_way: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    repo = Repository(root, SETTINGS)
    repo.store._commit([("DELETE FROM meta WHERE key = 'snapshots_checked_at'", [()])])
    repo.close()
    t0 = time.perf_counter()
    repo = Repository(root, SETTINGS)
    recover(repo)  # no mark, no earlier check: every stub read
    out["remount, full check (first mount)"] = time.perf_counter() - t0
    time.sleep(6)  # the stubs were just written: let them age past recovery's clock slack
    repo.store.set_clean_mark()
    repo.close()
    t0 = time.perf_counter()
    repo = Repository(root, SETTINGS)
    recover(repo)
    out["remount after clean unmount"] = time.perf_counter() - t0
    repo.close()
    t0 = time.perf_counter()
    repo = Repository(root, SETTINGS)
    recover(repo)  # no mark: as after kill -9 (stubs changed since the last check are read)
    out["remount after kill -9"] = time.perf_counter() - t0
    files = Files(repo)
    rss0 = rss_mib()
    service = Service(files, root / "mnt", Config())
    service.live.wait()
    out["catalog load (background)"] = service.live.load_seconds
    out["catalog RSS (MiB)"] = rss_mib() - rss0
    out["GET /snapshots (all)"] = timed(lambda: JSONResponse(service.listing({})))
    out["GET /snapshots?limit=100"] = timed(lambda: JSONResponse(service.listing({"limit": "100"})))
    out["GET /stats"] = timed(lambda: JSONResponse(service.totals()))

    some = _snapshot(0)[0]
    # The rendered tree is kept until a row changes: measure a rebuild (one stub re-read) and a repeat.
    out["GET /prefix-tree (after a change)"] = timed(
        lambda: (service.live.changed(some), service.prefix_tree_body("", "json")), runs=1
    )
    out["GET /prefix-tree (unchanged)"] = timed(lambda: service.prefix_tree_body("", "json"))
    # The proxy's question before every request: a conversation continued (one best row), and a new
    # conversation with a known system prompt (every row of its group ties on the prompt).
    g0, c0 = 0, 0
    cont = [1000 + g0] * 200 + [c0] * 20 + [0] + [7] * 50
    new = [1000 + g0] * 200 + [99_999] * 50
    live = service.live
    out["POST /prefix-match (continued)"] = timed(lambda: live.prefix_match(cont, exclude_suffix=".tmp"))
    out["POST /prefix-match (new, shared prompt)"] = timed(lambda: live.prefix_match(new, exclude_suffix=".tmp"))
    assert service.metrics is not None
    out["GET /metrics"] = timed(service.metrics.render)
    out["save + next listing page"] = timed(lambda: save_and_list(repo, service, n), runs=1)
    out["GC walk, nothing to free"] = timed(lambda: run_gc(repo, 0.5), runs=1)
    out["GC of the changes, nothing to free"] = timed(lambda: collect_changes(repo, live, 0.5))
    doomed = [p for p in live.sorted_paths()[:: max(1, n // DELETE)]][:DELETE]
    for rel in doomed:
        repo.unlink(rel)
    t0 = time.perf_counter()
    report = collect_changes(repo, live, 0.5)
    out[f"GC of the changes after deleting {DELETE} snapshots"] = time.perf_counter() - t0
    assert report is not None and report.chunks_freed > 0, report
    out["GC walk right after it (frees nothing more)"] = timed(lambda: _walk_frees_nothing(repo), runs=1)
    if old_way:
        out["old: every stub read per listing"] = timed(lambda: catalog.snapshots(root / "snapshots"), runs=1)
    files.close()
    repo.close()
    return out


def _walk_frees_nothing(repo: Repository) -> None:
    report = run_gc(repo, 0.5)
    assert report.chunks_freed == 0, report.summary()


def save_and_list(repo: Repository, service: Service, n: int) -> None:
    """One more snapshot committed (chunks, stub, rename), then the first page of the listing."""
    rel, keys = _snapshot(n + 10 * TURNS)  # a conversation of its own
    index = repo.empty_index()
    chunks = []
    for key, data in keys:
        data = data if data is not None else _data(key)
        chunks.append((hashlib.sha256(data).digest(), data))
        index.append(chunks[-1][0], len(data))
    owner = object()
    repo.store.put_many(chunks, owner)
    repo.path(rel).parent.mkdir(exist_ok=True)
    repo.install(repo.prepare_stub(index, None, False), rel)
    repo.store.unpin(owner)
    page = service.listing({"limit": "100"})
    JSONResponse(page)


def table(results: dict[int, dict[str, float]]) -> str:
    sizes = sorted(results)
    names = list(dict.fromkeys(k for r in results.values() for k in r))
    head = ["operation", *(f"N={n:,}" for n in sizes)]
    head += [f"x {b // a}N: {a:,}->{b:,}" for a, b in zip(sizes, sizes[1:], strict=False)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        unit = "" if "MiB" in name else " s"
        cells = [name] + [f"{results[n][name]:.3f}{unit}" if name in results[n] else "-" for n in sizes]
        for a, b in zip(sizes, sizes[1:], strict=False):
            va, vb = results[a].get(name), results[b].get(name)
            cells.append(f"x{vb / va:.1f}" if va and vb else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 50000])
    ap.add_argument("--old-way-max", type=int, default=10000, help="measure the old listing up to this N")
    ap.add_argument("--keep", type=Path, help="build stores here and keep them (reused when present)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results: dict[int, dict[str, float]] = {}
    for n in args.sizes:
        base = args.keep or Path(tempfile.mkdtemp(prefix="kvcfs-scale-"))
        root = base / f"store-{n}"
        t0 = time.perf_counter()
        if not (root / "snapshots").is_dir():
            build(root, n)
        built = time.perf_counter() - t0
        refs = n * (1 + PROMPT_CHUNKS + OWN_CHUNKS) + sum(TURN_CHUNKS * (s % TURNS + 1) for s in range(n))
        print(f"N={n:,}: built in {built:.1f}s ({refs:,} chunk references)", file=sys.stderr, flush=True)
        results[n] = measure(root, n, n <= args.old_way_max)
        print(json.dumps(results[n], indent=1), file=sys.stderr, flush=True)
        if args.keep is None:
            shutil.rmtree(base)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
