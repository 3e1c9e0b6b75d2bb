"""Garbage collection on a real mount: what it frees, what it must keep, and reads during compaction."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import SRC, Mount
from helpers import rand_bytes, sha, wait_closed, wait_for_log, write_in_pieces

from kvchunkfs.format.index import Index
from kvchunkfs.maint import fsck, gc, gcmarks, gcreport, gcsweep
from kvchunkfs.store import stubs
from kvchunkfs.store.repository import Repository

MiB = 1 << 20


def gc_now(m: Mount) -> None:
    n = m.log().count("gc finished")
    assert m.proc is not None
    m.proc.send_signal(signal.SIGUSR1)
    wait_for_log(m, "gc finished", n + 1)


def kv_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "kvchunkfs.cli", *args], capture_output=True, text=True, env=env)


def chunk_sizes(stub: Path) -> dict[bytes, int]:
    index = stubs.read_index(stub)
    return {cid: index.length(i) for i, cid in enumerate(index.ids)}


def pack_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in (store / "packs").glob("*.pack"))


def settled(m: Mount) -> Mount:
    wait_for_log(m, "gc finished", 1)  # the GC at mount ran
    return m


@pytest.fixture
def small_packs(tmp_path: Path):
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", ["--pack-size", "1MiB"])
    m.start()
    try:
        yield settled(m)
    finally:
        m.stop()


def test_gc_through_the_daemon_frees_exactly_the_dead_chunks(small_packs: Mount) -> None:
    m = small_packs
    a = rand_bytes(4 * MiB, 1)
    b = a[: 2 * MiB] + rand_bytes(3 * MiB, 2)  # shares a prefix with a
    write_in_pieces(m.path("a"), a, MiB)
    write_in_pieces(m.path("b"), b, MiB)
    m.ingested()  # the stubs name their chunks once the saves are stored
    live, doomed = chunk_sizes(m.store / "snapshots" / "a"), chunk_sizes(m.store / "snapshots" / "b")
    dead = {cid: n for cid, n in doomed.items() if cid not in live}
    assert 0 < len(dead) < len(doomed)
    before = pack_bytes(m.store)
    m.path("b").unlink()

    r = kv_cli("gc", "--store", str(m.store), "--json")  # mounted: the daemon collects (POST /gc)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["chunks_freed"] == len(dead)
    assert report["bytes_freed"] == sum(dead.values())
    assert report["packs_deleted"] >= 1
    assert report["live_chunks"] == len(live)
    assert report["disk_bytes_freed"] == before - pack_bytes(m.store) > 0
    assert "gc finished: freed" in m.log()
    m.remount([*m.extra, "--hot-tier-size", "0"])  # no hot copy: a is put back from the chunks GC kept
    assert m.path("a").read_bytes() == a
    report2 = json.loads(kv_cli("gc", "--store", str(m.store), "--json").stdout)
    assert report2["chunks_freed"] == 0


def test_gc_of_an_unmounted_store_runs_directly(kvfs) -> None:
    a = rand_bytes(3 * MiB, 3)
    write_in_pieces(kvfs.path("a"), a, MiB)
    write_in_pieces(kvfs.path("b"), rand_bytes(2 * MiB, 4), MiB)
    kvfs.ingested()  # b's chunks are in the store before it goes: they are what GC frees
    kvfs.path("b").unlink()
    kvfs.stop()
    (kvfs.store / "api.sock").unlink(missing_ok=True)
    r = kv_cli("gc", "--store", str(kvfs.store))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("gc finished: freed ") and "freed 0 chunks" not in r.stdout
    report, _ = fsck.check(kvfs.store)
    assert report.ok and report.garbage_chunks == 0
    kvfs.start(["--hot-tier-size", "0"])  # no hot copy: a is put back from the chunks GC kept
    assert kvfs.path("a").read_bytes() == a


def pack_files(store: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (store / "packs").glob("*.pack")}


@pytest.mark.parametrize("mounted", [True, False], ids=["through-the-daemon", "offline"])
def test_gc_dry_run_deletes_nothing_and_says_what_a_run_frees(tmp_path: Path, mounted: bool) -> None:
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", ["--pack-size", "1MiB"])
    m.start()
    try:
        settled(m)
        a = rand_bytes(4 * MiB, 11)
        b = a[: 2 * MiB] + rand_bytes(3 * MiB, 12)  # shares a prefix with a
        write_in_pieces(m.path("a"), a, MiB)
        write_in_pieces(m.path("b"), b, MiB)
        m.ingested()  # the stubs name their chunks once the saves are stored
        live, doomed = chunk_sizes(m.store / "snapshots" / "a"), chunk_sizes(m.store / "snapshots" / "b")
        dead = {cid: n for cid, n in doomed.items() if cid not in live}
        m.path("b").unlink()
        if not mounted:
            m.stop()
        before = pack_files(m.store)

        r = kv_cli("gc", "--store", str(m.store), "--dry-run", "--json")
        assert r.returncode == 0, r.stderr
        assert pack_files(m.store) == before, "the dry run deleted"
        dry = json.loads(r.stdout)
        assert dry["dry_run"] and dry["chunks_freed"] == len(dead) and dry["bytes_freed"] == sum(dead.values())
        assert dry["packs_deleted"] >= 1 and dry["disk_bytes_freed"] > 0 and dry["live_chunks"] == len(live)
        text = kv_cli("gc", "--store", str(m.store), "--dry-run")
        assert text.stdout.startswith(f"gc dry run, nothing deleted: would free {len(dead)} chunks"), text.stdout
        assert pack_files(m.store) == before  # not a byte deleted, twice

        r = kv_cli("gc", "--store", str(m.store), "--walk", "--json")  # the real run frees what it said
        assert r.returncode == 0, r.stderr
        real = json.loads(r.stdout)
        for key in ("chunks_freed", "bytes_freed", "packs_deleted", "packs_compacted", "disk_bytes_freed"):
            assert real[key] == dry[key], (key, real, dry)
        assert not real["dry_run"]
        assert sum(pack_files(m.store).values()) == sum(before.values()) - dry["disk_bytes_freed"]
        m.stop()
        m.start([*m.extra, "--hot-tier-size", "0"])  # no hot copy: a is put back from the chunks GC kept
        assert m.path("a").read_bytes() == a
    finally:
        m.stop()


def read_direct(fd: int, offset: int, size: int) -> bytes:
    """O_DIRECT read: the daemon answers, not the kernel's page cache."""
    buf = mmap.mmap(-1, size)
    try:
        return buf[: os.preadv(fd, [buf], offset)]
    finally:
        buf.close()


def test_gc_keeps_the_chunks_of_a_file_unlinked_while_open(tmp_path: Path) -> None:
    extra = ["--pack-size", "1MiB", "--cache-size", "0"]  # every read goes to the packs
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", extra)
    m.start()
    try:
        data = rand_bytes(3 * MiB, 5)
        write_in_pieces(m.path("x"), data, MiB)
        m.ingested()  # its chunks stored (and their ingestion's pins gone) before the unlink
        fd = os.open(m.path("x"), os.O_RDONLY | os.O_DIRECT)
        try:
            head = read_direct(fd, 0, MiB)
            m.path("x").unlink()
            gc_now(m)
            rest = read_direct(fd, MiB, 2 * MiB)
        finally:
            os.close(fd)
        assert head + rest == data
        wait_closed(m)  # close() returns before FUSE's RELEASE (which unpins) arrives
        gc_now(m)  # closed now: its chunks go
        last_gc = [line for line in m.log().splitlines() if "gc finished" in line][-1]
        assert "freed 0 chunks" not in last_gc
    finally:
        m.stop()


def test_gc_never_drops_a_chunk_a_save_is_reusing(small_packs: Mount) -> None:
    """The chunks of a deleted snapshot are found in the store by a new save and pinned: GC keeps them.

    A save is stored behind its close: ingestion finds the reused chunks first (the file's head),
    then stores the fresh tail and only then installs the stub that names them all. GC runs in
    between, while those chunks are named by no stub, only pinned by the save. Whether GC is done
    before the install is up to the scheduler: a round that missed the window is repeated."""
    m = small_packs
    saved: dict[str, bytes] = {}
    for attempt in range(5):
        head, tail = rand_bytes(8 * MiB, 6 + 2 * attempt), rand_bytes(32 * MiB, 7 + 2 * attempt)
        write_in_pieces(m.path("old"), head, MiB)
        m.ingested()
        m.path("old").unlink()  # its chunks are garbage now ...
        deduped = m.stats()["chunks_deduped"]
        name = f"new{attempt}"
        saved[name] = head + tail
        write_in_pieces(m.path(name), saved[name], 4 * MiB)  # ... until this save finds them again
        deadline = time.monotonic() + 30
        while m.stats()["chunks_deduped"] - deduped < 40:
            assert time.monotonic() < deadline, "the save did not reach the store"
            time.sleep(0.002)
        gc_now(m)
        # Still staged: GC finished before the save was installed, while its reused chunks were only pinned.
        in_window = stubs.read_staged(m.store / "snapshots" / name) is not None
        m.ingested()
        if in_window:
            break
    assert in_window, "GC never ran while a save was reusing chunks"
    m.remount([*m.extra, "--hot-tier-size", "0"])  # no hot copy: the files are put back from their chunks
    for name, data in saved.items():
        assert m.path(name).read_bytes() == data, name


def test_restore_while_its_packs_are_compacted(tmp_path: Path) -> None:
    """Readers keep getting the right bytes while GC copies their chunks and deletes the old packs."""
    # No hot tier: every restore reads the chunks GC moves (a whole copy would never touch the packs).
    extra = ["--pack-size", "16MiB", "--gc-compact-threshold", "0.9", "--cache-size", "0",
             "--hot-tier-size", "0"]  # fmt: skip
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", extra)
    m.start()
    settled(m)
    files: dict[str, bytes] = {}
    errors: list[str] = []
    reads = 0
    stop = threading.Event()
    lock = threading.Lock()

    def reader() -> None:
        nonlocal reads
        buf = mmap.mmap(-1, 256 << 10)
        while not stop.is_set():
            with lock:
                name, data = next(iter(files.items()))
            fd = os.open(m.path(name), os.O_RDONLY | os.O_DIRECT)
            try:
                for off in range(0, len(data), len(buf)):
                    n = os.preadv(fd, [buf], off)
                    if buf[:n] != data[off : off + n]:
                        errors.append(f"{name} at {off}: wrong bytes")
                    reads += 1
            except OSError as e:
                errors.append(f"{name}: {e}")
            finally:
                os.close(fd)
        buf.close()

    try:
        for r in range(4):
            keep, drop = rand_bytes(6 * MiB, 100 + r), rand_bytes(6 * MiB, 200 + r)
            # Same packs as keep{r}, and before it: its dead chunks are not a tail GC could cut off.
            write_in_pieces(m.path(f"drop{r}"), drop, MiB)
            write_in_pieces(m.path(f"keep{r}"), keep, MiB)
            m.ingested()  # both in the packs, in that order, before the unlink and GC
            with lock:
                files[f"keep{r}"] = keep
                files.pop(f"keep{r - 2}", None)
            if r == 0:
                t = threading.Thread(target=reader)
                t.start()
            m.path(f"drop{r}").unlink()
            if r >= 2:
                m.path(f"keep{r - 2}").unlink()
            gc_now(m)
        stop.set()
        t.join()
    finally:
        stop.set()
        m.stop()
    lines = [line for line in m.log().splitlines() if "gc finished" in line]
    compacted = sum(int(line.split("compacted ")[1].split()[0]) for line in lines)
    assert compacted >= 3, m.log()
    assert not errors, errors[:5]
    assert reads > 100


# -- the mark phase against renames, without FUSE -------------------------------------------------


def make_repo(root: Path) -> tuple[Repository, bytes]:
    """A store with one snapshot ``a.tmp`` of one chunk."""
    repo = Repository(root)
    data = os.urandom(100_000)
    cid = bytes.fromhex(sha(data))
    owner = object()
    repo.store.put_many([(cid, data)], owner)
    repo.store.unpin(owner)
    index = Index(repo.chunker.min, repo.chunker.avg, repo.chunker.max)
    index.append(cid, len(data))
    repo.install(repo.prepare_stub(index, None, durable=False), "a.tmp")
    return repo, cid


def test_a_walk_over_more_rows_than_the_map_counted_keeps_what_stubs_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saves go on during a walk: the map holds more rows than its count said when the walk began."""
    repo, cid = make_repo(tmp_path)
    repo.rename("a.tmp", "a")
    garbage = [os.urandom(5000) for _ in range(40)]
    owner = object()
    repo.store.put_many([(bytes.fromhex(sha(d)), d) for d in garbage], owner)
    repo.store.unpin(owner)
    monkeypatch.setattr(repo.store, "stats", lambda: (1, 0))  # a count from before the saves
    monkeypatch.setattr("kvchunkfs.store.chunkmap.PAGE_ROWS", 3)
    report = gc.run_gc(repo, 0.5)
    assert not report.errors and report.chunks_freed == len(garbage)
    assert repo.store.locate(cid)
    repo.close()


def test_a_rename_during_the_walk_is_caught_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The listing misses a stub renamed meanwhile; GC reads the renamed path before it sweeps."""
    repo, cid = make_repo(tmp_path)

    def racing_walk(repo: Repository, report: gcreport.GCReport) -> gcmarks.Marks:
        repo.rename("a.tmp", "a")  # the walk listed the directory before, so it saw nothing
        return gcmarks.Marks(repo.store)

    monkeypatch.setattr(gcsweep, "named_ids", racing_walk)
    report = gc.run_gc(repo, 0.5)
    assert report.walks == 1 and report.catch_ups == 0 and report.chunks_freed == 0
    assert repo.store.locate(cid)
    repo.close()


def test_renames_during_the_catch_up_are_caught_up_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round of reading renamed paths may race with more renames; the sweep waits for a quiet round."""
    repo, cid = make_repo(tmp_path)
    real_add = gcsweep.add_created
    renames = iter(["b", "c", "d"])
    current = "a.tmp"

    def racing_walk(repo: Repository, report: gcreport.GCReport) -> gcmarks.Marks:
        nonlocal current
        repo.rename(current, "a")
        current = "a"
        return gcmarks.Marks(repo.store)

    def racing_add(repo: Repository, paths: list[str], named: gcmarks.Marks, report: gcreport.GCReport) -> None:
        nonlocal current
        nxt = next(renames, None)
        if nxt is not None:  # the stub moves again right before we read the paths we were given
            repo.rename(current, nxt)
            current = nxt
        real_add(repo, paths, named, report)

    monkeypatch.setattr(gcsweep, "named_ids", racing_walk)
    monkeypatch.setattr(gcsweep, "add_created", racing_add)
    report = gc.run_gc(repo, 0.5)
    assert report.catch_ups == 3 and report.chunks_freed == 0 and not report.errors
    assert repo.store.locate(cid)
    repo.close()


def test_endless_renames_skip_the_sweep_instead_of_blocking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, cid = make_repo(tmp_path)
    names = iter(f"n{i}" for i in range(1000))
    current = "a.tmp"

    def always_racing(repo: Repository, paths: list[str], named: gcmarks.Marks, report: gcreport.GCReport) -> None:
        nonlocal current
        nxt = next(names)
        repo.rename(current, nxt)
        current = nxt

    monkeypatch.setattr(gcsweep, "named_ids", lambda repo, report: gcmarks.Marks(repo.store))
    monkeypatch.setattr(gcsweep, "add_created", always_racing)
    report = gc.run_gc(repo, 0.5)
    assert report.catch_ups == gcmarks.MAX_CATCH_UPS and report.chunks_freed == 0
    assert report.errors and "sweep skipped" in report.errors[0]
    assert repo.store.locate(cid)
    repo.close()


def test_periodic_gc_walks_after_changes_and_skips_an_unchanged_store(tmp_path: Path) -> None:
    """The hourly GC of an idle store costs nothing: it walks only when something was saved,
    renamed or deleted since the last clean run."""
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", ["--gc-interval", "1"])
    m.start()
    try:
        wait_for_log(m, "gc finished", 1, timeout=10)  # at mount: always
        wait_for_log(m, "gc skipped", 2, timeout=10)
        assert m.log().count("gc finished") == 1, "an unchanged store was walked again"
        (m.mnt / "a").write_bytes(rand_bytes(300_000, 1))
        wait_closed(m)
        wait_for_log(m, "gc finished", 2, timeout=10)
        (m.mnt / "a").unlink()
        wait_for_log(m, "gc finished", 3, timeout=10)
        last = [line for line in m.log().splitlines() if "gc finished" in line][-1]
        assert "freed 0 chunks" not in last, last  # the unlinked file's chunks went at the next tick
        skips = m.log().count("gc skipped")
        wait_for_log(m, "gc skipped", skips + 1, timeout=10)
        assert m.log().count("gc finished") == 3
    finally:
        m.stop()
