"""Packs are the truth, the map is a cache: a lost, unreadable, older or swapped chunks.db loses no snapshot.

Every pack describes its chunks (batch records written before the map rows), so recovery at mount
and ``fsck --repair`` rebuild what the map lacks; a map deleted or replaced under a running daemon
makes saves fail with EIO instead of going into the wrong file.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SRC, Mount, is_mounted
from helpers import rand_bytes, read_direct, write_in_pieces
from test_faults import Workload, gc_now, verify_and_check

from kvchunkfs.file.files import Files
from kvchunkfs.format import index as idx
from kvchunkfs.format.chunker import chunk_id
from kvchunkfs.maint import fsck
from kvchunkfs.maint.recovery import recover
from kvchunkfs.store import stubs
from kvchunkfs.store.packs import ChunkCorrupt
from kvchunkfs.store.repository import Repository

MiB = 1 << 20
DB_FILES = ("chunks.db", "chunks.db-wal", "chunks.db-shm")


def kv_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "kvchunkfs.cli", *args], capture_output=True, text=True, env=env)


def delete_map(store: Path) -> None:
    for name in DB_FILES:
        (store / name).unlink(missing_ok=True)


def copy_map(store: Path, dest: Path) -> None:
    dest.mkdir(exist_ok=True)
    for name in DB_FILES[:2]:
        if (store / name).exists():
            shutil.copy2(store / name, dest / name)


def put_map_back(backup: Path, store: Path) -> None:
    delete_map(store)
    for name in DB_FILES[:2]:
        if (backup / name).exists():
            shutil.copy2(backup / name, store / name)


def assert_clean(store: Path) -> None:
    report, _ = fsck.check(store)
    assert report.ok, report.problems
    assert report.garbage_chunks == 0


def pack_sizes(store: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (store / "packs").glob("*.pack")}


# -- the map lost, unreadable or older: the next mount rebuilds it --------------------------------


def test_lost_map_is_rebuilt_at_mount(kvfs) -> None:
    a, b = rand_bytes(3 * MiB, 1), rand_bytes(2 * MiB, 2)
    write_in_pieces(kvfs.path("a"), a, MiB)
    kvfs.remount()  # b goes to a pack of its own
    write_in_pieces(kvfs.path("b"), b, MiB)
    kvfs.stop()
    delete_map(kvfs.store)
    kvfs.start_settled()
    assert read_direct(kvfs.path("a")) == a and read_direct(kvfs.path("b")) == b
    assert "chunks it describes past the map's end (a pack the map did not know)" in kvfs.log()
    kvfs.stop()
    assert_clean(kvfs.store)


def test_older_map_put_back_keeps_the_saves_it_does_not_know(kvfs, tmp_path: Path) -> None:
    a, b = rand_bytes(3 * MiB, 3), rand_bytes(3 * MiB, 4)
    write_in_pieces(kvfs.path("a"), a, MiB)
    kvfs.stop()
    copy_map(kvfs.store, tmp_path / "old")
    kvfs.start()
    write_in_pieces(kvfs.path("b"), b, MiB)
    write_in_pieces(kvfs.path("a"), b[:MiB] + a[MiB:], MiB)  # a new version of a, partly new chunks
    kvfs.stop()
    put_map_back(tmp_path / "old", kvfs.store)
    kvfs.start_settled()
    assert read_direct(kvfs.path("b")) == b
    assert read_direct(kvfs.path("a")) == b[:MiB] + a[MiB:]
    kvfs.stop()
    assert_clean(kvfs.store)


def test_fsck_repair_with_an_older_map_keeps_the_pack_of_a_recent_save(kvfs, tmp_path: Path) -> None:
    a, b = rand_bytes(2 * MiB, 5), rand_bytes(2 * MiB, 6)
    write_in_pieces(kvfs.path("a"), a, MiB)
    kvfs.stop()
    copy_map(kvfs.store, tmp_path / "old")
    kvfs.start()
    write_in_pieces(kvfs.path("b"), b, MiB)
    kvfs.stop()
    packs_before = pack_sizes(kvfs.store)
    put_map_back(tmp_path / "old", kvfs.store)

    r = kv_cli("fsck", "--store", str(kvfs.store))
    assert r.returncode == 1 and "snapshot b: " in r.stdout, r.stdout
    stale = r.stdout
    r = kv_cli("fsck", "--store", str(kvfs.store), "--repair")
    assert set(pack_sizes(kvfs.store)) == set(packs_before), "a pack holding a snapshot's chunks was deleted"
    assert "snapshot b: the map lacks" in stale, stale  # a stale map, not a broken snapshot
    assert "chunks the packs describe to the map" in r.stdout, r.stdout
    r = kv_cli("fsck", "--store", str(kvfs.store), "--verify-data")
    assert r.returncode == 0, r.stdout
    kvfs.start()
    assert read_direct(kvfs.path("a")) == a and read_direct(kvfs.path("b")) == b


def test_fsck_repair_rebuilds_a_lost_map(kvfs) -> None:
    a = rand_bytes(3 * MiB, 7)
    write_in_pieces(kvfs.path("a"), a, MiB)
    kvfs.stop()
    delete_map(kvfs.store)
    r = kv_cli("fsck", "--store", str(kvfs.store))
    assert r.returncode == 1 and "chunks.db is missing" in r.stdout, r.stdout + r.stderr
    r = kv_cli("fsck", "--store", str(kvfs.store), "--repair")
    assert "chunks the packs describe to the map" in r.stdout, r.stdout + r.stderr
    r = kv_cli("fsck", "--store", str(kvfs.store), "--verify-data")
    assert r.returncode == 0, r.stdout
    kvfs.start()
    assert read_direct(kvfs.path("a")) == a


def test_unreadable_map_is_moved_aside_and_rebuilt(kvfs) -> None:
    a = rand_bytes(2 * MiB, 8)
    write_in_pieces(kvfs.path("a"), a, MiB)
    kvfs.stop()
    junk = b"this is not an SQLite database " * 100
    (kvfs.store / "chunks.db").write_bytes(junk)
    kvfs.start_settled()
    assert read_direct(kvfs.path("a")) == a
    aside = list(kvfs.store.glob("chunks.db.unreadable-*"))
    assert [p.read_bytes() for p in aside] == [junk], "the unreadable map is kept, not deleted"
    assert "is unreadable" in kvfs.log()


def test_compacted_packs_describe_their_chunks(tmp_path: Path) -> None:
    """GC's compaction writes packs too: after it, a lost map is rebuilt from them alone."""
    extra = ["--pack-size", "16MiB", "--gc-compact-threshold", "0.9"]
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", extra)
    m.start_settled()
    try:
        keep, drop = rand_bytes(6 * MiB, 9), rand_bytes(6 * MiB, 10)
        write_in_pieces(m.path("drop"), drop, MiB)  # first: GC cannot just cut it off the pack's end
        write_in_pieces(m.path("keep"), keep, MiB)
        m.stop()
        m.start_settled()  # the pack they share is closed now, so GC may compact it
        m.path("drop").unlink()
        gc_now(m)
        last = [line for line in m.log().splitlines() if "gc finished" in line][-1]
        assert "compacted 1 " in last, last
        m.stop()
        delete_map(m.store)
        m.start_settled()
        assert read_direct(m.path("keep")) == keep
        m.stop()
        assert_clean(m.store)
    finally:
        if m.proc is not None:
            m.stop()


# -- the map deleted or replaced while mounted: saves are not stored, loudly ---------------------


def save_not_stored(m: Mount, name: str, data: bytes) -> None:
    """A save while the map is not the store's own: its close succeeds (the save is staged), but
    storing it fails loudly (a log line, ``ingest_failures``) and is tried again: no stub names
    chunks the map lacks, the staged copy, whole, stays the snapshot until a later mount stores it,
    and the store says it is degraded."""
    failures = m.stats()["ingest_failures"]
    write_in_pieces(m.path(name), data, MiB)
    deadline = time.monotonic() + 60
    while m.stats()["ingest_failures"] <= failures:
        assert time.monotonic() < deadline, m.log()[-3000:]
        time.sleep(0.05)
    assert m.stats()["ingest_degraded"] == 1
    stub = m.store / "snapshots" / name
    assert stubs.read_staged(stub) is not None, "the staged copy is no longer the snapshot"
    assert stubs.read_index(stub).ids == [], "a stub names chunks the map does not have"
    assert read_direct(m.path(name)) == data


def refused_at_open(m: Mount, name: str, data: bytes) -> None:
    """While the store cannot store what is staged, a new save is refused before a byte is written."""
    with pytest.raises(OSError) as e:
        write_in_pieces(m.path(name), data, MiB)
    assert e.value.errno == errno.EIO, e.value


def stored_from_chunks(m: Mount, names: dict[str, bytes]) -> None:
    """After a mount: every save is stored in the chunk store (no staged copy left), and reads
    back from the chunks alone (no hot tier)."""
    m.ingested()
    for name in names:
        assert stubs.read_staged(m.store / "snapshots" / name) is None, name
    m.remount(["--hot-tier-size", "0"])
    for name, data in names.items():
        assert read_direct(m.path(name)) == data, name
    m.stop()
    assert_clean(m.store)
    m.start([])


def test_map_deleted_while_mounted_refuses_saves(kvfs) -> None:
    kvfs.remount(["--stop-timeout", "2"])  # a stop waits that long for the saves a degraded store holds
    a, b, c = rand_bytes(2 * MiB, 11), rand_bytes(2 * MiB, 12), rand_bytes(2 * MiB, 13)
    write_in_pieces(kvfs.path("a"), a, MiB)
    kvfs.ingested()
    (kvfs.store / "chunks.db").unlink()
    save_not_stored(kvfs, "b", b)
    refused_at_open(kvfs, "a2", a)  # all chunks known: still refused
    assert "chunks.db was deleted while the store is in use" in kvfs.log()
    assert read_direct(kvfs.path("a")) == a  # reads go on
    kvfs.remount()  # the map is rebuilt from the packs; the staged save is stored now
    stored_from_chunks(kvfs, {"a": a, "b": b})
    write_in_pieces(kvfs.path("c"), c, MiB)
    kvfs.remount()
    assert read_direct(kvfs.path("c")) == c


def test_map_replaced_while_mounted_refuses_saves(kvfs, tmp_path: Path) -> None:
    kvfs.remount(["--stop-timeout", "2"])  # a stop waits that long for the saves a degraded store holds
    a, b = rand_bytes(2 * MiB, 14), rand_bytes(2 * MiB, 15)
    write_in_pieces(kvfs.path("a"), a, MiB)
    kvfs.ingested()
    shutil.copy2(kvfs.store / "chunks.db", tmp_path / "copy.db")
    os.replace(tmp_path / "copy.db", kvfs.store / "chunks.db")
    save_not_stored(kvfs, "b", b)
    assert "chunks.db was replaced by another file while the store is in use" in kvfs.log()
    kvfs.remount()
    stored_from_chunks(kvfs, {"a": a, "b": b})
    write_in_pieces(kvfs.path("b"), a, MiB)
    kvfs.remount()
    assert read_direct(kvfs.path("b")) == a


# -- legacy stores (packs without records) --------------------------------------------------------


def make_legacy_store(root: Path, data: bytes) -> None:
    """A store as the code before batch records wrote it: bare chunk bytes, a map without ``packs``."""
    for d in ("snapshots", "packs", "tmp", "staging"):
        (root / d).mkdir(parents=True)
    cid = chunk_id(data)
    (root / "packs" / "00000001.pack").write_bytes(data)
    db = sqlite3.connect(root / "chunks.db")
    db.executescript(
        """
        CREATE TABLE chunks (id BLOB PRIMARY KEY, pack INTEGER NOT NULL, offset INTEGER NOT NULL,
                             length INTEGER NOT NULL) WITHOUT ROWID;
        CREATE INDEX chunks_by_pack ON chunks (pack, offset);
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        """
    )
    db.execute("INSERT INTO chunks VALUES (?, 1, 0, ?)", (cid, len(data)))
    db.executemany("INSERT INTO meta VALUES (?, ?)", [("chunk_params", "16384,65536,262144"), ("last_pack", "1")])
    db.commit()
    db.close()
    index = idx.Index(16384, 65536, 262144)
    index.append(cid, len(data))
    stub = root / "snapshots" / "old"
    stub.write_bytes(idx.encode(index))
    os.setxattr(stub, stubs.SIZE, str(len(data)).encode())


def test_legacy_pack_is_kept_when_the_map_is_lost(tmp_path: Path) -> None:
    data = rand_bytes(200_000, 16)
    store = tmp_path / "store"
    make_legacy_store(store, data)
    copy_map(store, tmp_path / "legacy-map")
    m = Mount(store, tmp_path / "mnt", tmp_path / "daemon.log")
    m.start_settled()
    try:
        assert read_direct(m.path("old")) == data  # the legacy map is taken as it is
        m.stop()
        delete_map(store)
        m.start_settled(["--hot-tier-size", "0"])  # from the chunks: a whole copy would still hold the bytes
        assert (store / "packs" / "00000001.pack").read_bytes() == data, "a legacy pack was deleted or cut"
        assert "pack 1 has no batch records" in m.log()
        with pytest.raises(OSError) as e:
            read_direct(m.path("old"))
        assert e.value.errno == errno.EIO
        m.stop()
        put_map_back(tmp_path / "legacy-map", store)
        m.start_settled([])
        assert read_direct(m.path("old")) == data
    finally:
        if m.proc is not None:
            m.stop()


# -- crash windows of a batch, in process ---------------------------------------------------------

_CRASH_IN_COMMIT = """
import os, signal, sys
from kvchunkfs.store.repository import Repository
repo = Repository(__import__("pathlib").Path(sys.argv[1]))
owner = object()
chunks = [(bytes.fromhex(h), bytes.fromhex(d)) for h, d in (line.split() for line in sys.stdin)]
repo.store.put_many(chunks[:2], owner)  # committed
repo.store._insert_rows = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # dies before the commit
repo.store.put_many(chunks[2:], owner)
"""


def crash_in_commit(root: Path, chunks: list[tuple[bytes, bytes]]) -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    lines = "".join(f"{cid.hex()} {data.hex()}\n" for cid, data in chunks)
    r = subprocess.run([sys.executable, "-c", _CRASH_IN_COMMIT, str(root)], input=lines, text=True, env=env)
    assert r.returncode == -9


def some_chunks(n: int, seed: int) -> list[tuple[bytes, bytes]]:
    rng = random.Random(seed)
    datas = [rng.randbytes(rng.randrange(20_000, 90_000)) for _ in range(n)]
    return [(chunk_id(d), d) for d in datas]


def test_crash_between_pack_write_and_commit_keeps_the_batch(tmp_path: Path) -> None:
    """The batch is described in the pack: recovery maps it (GC frees it later if no stub names it)."""
    chunks = some_chunks(6, 17)
    crash_in_commit(tmp_path, chunks)
    repo = Repository(tmp_path)
    try:
        report = recover(repo)
        for cid, data in chunks:
            loc = repo.store.locate(cid)
            assert repo.store.read_run(loc.pack, loc.offset, loc.length) == data
        assert report.chunks_added == 4 and report.packs_truncated == 0
    finally:
        repo.close()


def test_torn_batch_keeps_its_complete_chunks(tmp_path: Path) -> None:
    """A kill in the middle of the pwritev: the chunks wholly written are mapped, the torn rest is cut."""
    chunks = some_chunks(6, 18)
    crash_in_commit(tmp_path, chunks)
    pack = next((tmp_path / "packs").glob("*.pack"))
    torn_at = pack.read_bytes().find(chunks[4][1])
    os.truncate(pack, torn_at + len(chunks[4][1]) // 2)  # the 5th chunk half written
    repo = Repository(tmp_path)
    try:
        report = recover(repo)
        for cid, data in chunks[:4]:
            loc = repo.store.locate(cid)
            assert repo.store.read_run(loc.pack, loc.offset, loc.length) == data
        assert not repo.store.locate_many([cid for cid, _ in chunks[4:]])
        assert report.chunks_added == 2 and report.packs_truncated == 1
        assert pack.stat().st_size == torn_at
    finally:
        repo.close()
    report, _ = fsck.check(tmp_path)
    assert report.ok, report.problems


def test_recovery_rescues_a_row_the_map_lost(tmp_path: Path) -> None:
    """A chunk a snapshot names is re-mapped from its pack's record if its bytes hash right."""
    repo = Repository(tmp_path)
    chunks = some_chunks(3, 19)
    repo.store.put_many(chunks, object())
    index = repo.empty_index()
    for cid, data in chunks:
        index.append(cid, len(data))
    repo.install(repo.prepare_stub(index, None, durable=False), "s")
    repo.store.delete_chunks([chunks[1][0]])
    repo.close()
    repo = Repository(tmp_path)
    files = Files(repo)
    try:
        report = recover(repo)
        assert files.read_chunks(index, 0, index.size) == b"".join(d for _, d in chunks)
        assert report.chunks_rescued == 1 and not report.missing, report
    finally:
        files.close()
        repo.close()


# -- B: an index that disagrees with the map ------------------------------------------------------


def rewrite_stub(stub: Path, ends: list[int]) -> None:
    index = stubs.read_index(stub)
    index.ends = ends
    size = os.getxattr(stub, stubs.SIZE)
    stub.write_bytes(idx.encode(index))
    os.setxattr(stub, stubs.SIZE, str(ends[-1]).encode() if ends[-1] != int(size) else size)


@pytest.mark.parametrize("damage", ["first end +1000", "size 2**62"])
def test_index_lengths_must_agree_with_the_map(kvfs, damage: str) -> None:
    data = rand_bytes(3 * MiB, 20)
    write_in_pieces(kvfs.path("s"), data, MiB)
    write_in_pieces(kvfs.path("fine"), rand_bytes(MiB, 21), MiB)
    kvfs.stop()
    stub = kvfs.store / "snapshots" / "s"
    ends = list(stubs.read_index(stub).ends)
    if damage == "first end +1000":
        ends[0] += 1000
    else:
        ends[-1] = 2**62
    rewrite_stub(stub, ends)

    r = kv_cli("fsck", "--store", str(kvfs.store), "--verify-data")
    assert r.returncode == 1
    assert "snapshot s: " in r.stdout and "length disagrees with the map" in r.stdout, r.stdout
    assert "snapshot fine" not in r.stdout
    kvfs.start_settled()
    assert "snapshot s disagrees with the map" in kvfs.log()
    with pytest.raises(OSError) as e:
        read_direct(kvfs.path("s"))
    assert e.value.errno == errno.EIO
    assert "cannot open snapshot s" in kvfs.log()


def test_read_never_assembles_chunks_of_other_lengths(tmp_path: Path) -> None:
    """The reader checks each chunk against the index, whatever the caller validated before."""
    repo = Repository(tmp_path)
    files = Files(repo)
    try:
        chunks = some_chunks(3, 22)
        repo.store.put_many(chunks, object())
        index = repo.empty_index()
        for cid, data in chunks:
            index.append(cid, len(data))
        index.ends[0] += 1000
        with pytest.raises(ChunkCorrupt):
            files.read_chunks(index, 0, index.size)
    finally:
        files.close()
        repo.close()


# -- kill -9 with the map lost or put back --------------------------------------------------------


def test_kill9_with_the_map_lost_or_older(tmp_path: Path) -> None:
    """The proxy workload killed at random; between runs the map is kept, deleted, or an older copy is put back."""
    iterations = int(os.environ.get("KVCFS_MAP_KILL_ITERATIONS", "12"))
    seed = int(os.environ.get("KVCFS_KILL_SEED", str(random.randrange(1 << 32))))
    rng = random.Random(seed)
    base = ["--pack-size", "1MiB", "--gc-compact-threshold", "0.6"]
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", base)
    work = Workload(m, rng)
    backup = tmp_path / "older-map"
    actions: dict[str, int] = {}
    try:
        for i in range(iterations):
            context = f"seed {seed}, iteration {i}"
            m.start_settled()
            verify_and_check(m, work, context)
            work.killed.clear()
            work.run_until_kill(rng.uniform(0.2, 1.5))
            action = rng.choice(("keep", "delete", "older") if backup.exists() else ("keep", "delete"))
            actions[action] = actions.get(action, 0) + 1
            fresh = tmp_path / "fresh-map"
            copy_map(m.store, fresh)  # the map as the crash left it: next round's older copy
            if action == "delete":
                delete_map(m.store)
            elif action == "older":
                put_map_back(backup, m.store)
            shutil.rmtree(backup, ignore_errors=True)
            fresh.rename(backup)
        m.start_settled()
        verify_and_check(m, work, f"seed {seed}, final")
    finally:
        if m.proc is not None:
            m.stop()
        elif is_mounted(m.mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(m.mnt)], check=False)
    print(f"\nkill -9 with map damage: {iterations} iterations (seed {seed}), {work.saves} saves, {actions}")
    assert work.saves > iterations // 4
