"""Fault injection on a real mount: kill -9 under a proxy-like workload, a full disk, corruption.

KVCFS_KILL_ITERATIONS sets the number of kill -9 rounds (default 50; use >= 500 locally) and
KVCFS_KILL_SEED makes a run repeatable (the seed is printed and named in every failure).
"""

from __future__ import annotations

import errno
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import MOUNTED, Mount, is_mounted
from helpers import rand_bytes, sha, wait_closed, wait_for_log, write_in_pieces

from kvchunkfs.maint import fsck
from kvchunkfs.service import catalog
from kvchunkfs.service.apiclient import DaemonClient
from kvchunkfs.store import stubs

MiB = 1 << 20
ABSENT = "absent"
EMPTY = sha(b"")
SRC = Path(__file__).resolve().parent.parent / "src"
THRESHOLD = 0.6


# -- helpers ------------------------------------------------------------------------------------


def gc_now(m: Mount) -> None:
    """Ask the daemon for a GC (SIGUSR1) and wait until it finished."""
    wait_closed(m)
    n = m.log().count("gc finished")
    assert m.proc is not None
    m.proc.send_signal(signal.SIGUSR1)
    wait_for_log(m, "gc finished", n + 1)


def file_state(path: Path) -> str:
    try:
        return sha(path.read_bytes())
    except FileNotFoundError:
        return ABSENT


def kv_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "kvchunkfs.cli", *args], capture_output=True, text=True, env=env)


# -- kill -9 --------------------------------------------------------------------------------------


class Workload:
    """A proxy-like client: save NAME.tmp, rename to NAME, touch, delete, restore, GC.

    ``expected[name]`` holds every state (sha256 or ABSENT) the name may be in after a crash: one
    state once an operation returned, old and new while it is in flight.
    """

    NAMES = ("conv0", "conv1", "conv2", "conv3")

    def __init__(self, m: Mount, rng: random.Random) -> None:
        self.m = m
        self.rng = rng
        self.system = rand_bytes(MiB, 4242)  # a shared "system prompt": dedup across conversations
        self.expected: dict[str, set[str]] = {}
        for name in self.NAMES:
            self.expected[name] = {ABSENT}
            self.expected[name + ".tmp"] = {ABSENT}
        self.killed = threading.Event()
        self.in_flight: dict[str, int] = {}
        self.saves = 0
        self.discarded = 0

    def content(self) -> bytes:
        head = self.system[: self.rng.randrange(0, MiB)]
        return head + self.rng.randbytes(self.rng.randrange(MiB, 3 * MiB))

    def run_until_kill(self, delay: float) -> None:
        """Run the workload while a thread kill -9s the daemon after ``delay`` seconds."""
        proc = self.m.proc
        assert proc is not None

        def kill() -> None:
            time.sleep(delay)
            self.killed.set()
            proc.kill()

        killer = threading.Thread(target=kill)
        killer.start()
        self.run_until_killed()
        killer.join()
        self.m.kill()

    def run_until_killed(self) -> None:
        try:
            while True:
                self.step()
        except OSError as e:
            if not self.killed.is_set():
                raise
            assert e.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO, errno.ENOENT), e

    def step(self) -> None:
        op = self.rng.choices(("save", "touch", "delete", "restore", "gc"), weights=(6, 2, 1, 2, 1))[0]
        self.in_flight[op] = self.in_flight.get(op, 0) + 1
        name = self.rng.choice(self.NAMES)
        path = self.m.path(name)
        if op == "save":
            self.save(name)
        elif op == "touch" and self.expected[name] != {ABSENT}:
            os.utime(path)
        elif op == "delete" and self.expected[name] != {ABSENT}:
            self.expected[name].add(ABSENT)
            path.unlink()
            self.expected[name] = {ABSENT}
        elif op == "restore" and self.expected[name] != {ABSENT}:
            got = sha(path.read_bytes())
            assert {got} == self.expected[name], f"{name} changed while the daemon ran"
        elif op == "gc" and self.m.proc is not None:
            self.m.proc.send_signal(signal.SIGUSR1)  # runs concurrently with the next saves

    def save(self, name: str) -> None:
        data = self.content()
        new = sha(data)
        tmp = name + ".tmp"
        self.expected[tmp] = {ABSENT, EMPTY, new}
        write_in_pieces(self.m.path(tmp), data, self.rng.choice((64 << 10, 256 << 10, MiB)))
        self.expected[tmp] = {new}
        self.expected[name].add(new)
        self.expected[tmp].add(ABSENT)
        os.rename(self.m.path(tmp), self.m.path(name))
        self.expected[name] = {new}
        self.expected[tmp] = {ABSENT}
        self.saves += 1

    def verify(self, context: str) -> int:
        """After a restart: every name is in one allowed state; leftover .tmp files are removed."""
        verified = 0
        self.discarded = 0
        for name, allowed in self.expected.items():
            path = self.m.path(name)
            got = file_state(path)
            assert got in allowed, f"{context}: {name} is {got}, expected one of {allowed}"
            if got != ABSENT:
                verified += path.stat().st_size
            if name.endswith(".tmp") and got != ABSENT:
                path.unlink()  # the proxy discards an unfinished save
                self.discarded += 1
                got = ABSENT
            self.expected[name] = {got}
        return verified


def verify_and_check(m: Mount, work: Workload, context: str) -> int:
    """After a restart: every snapshot in an allowed state, then the store clean and collected."""
    # Saves closed before the kill are queued again at mount: the store is complete once stored.
    m.ingested()
    verified = work.verify(context)
    resumed = "staged before the last stop are being stored" in m.log().rsplit(MOUNTED, 1)[-1]
    if work.discarded:
        gc_now(m)  # the discarded .tmp files' chunks are garbage only now
    if resumed:
        # The versions the saves a killed daemon left replace are kept for a power cut until those
        # are stored; a walk after that finds every chunk they alone named.
        wait_closed(m)
        DaemonClient(m.store).json("POST", "/gc?walk=true")
    check_store_clean(m.store, context)
    return verified


def check_store_clean(store: Path, context: str) -> fsck.FsckReport:
    """fsck on the idle store: no damage, no leftovers, no garbage; compacted packs are dense enough."""
    report, _ = fsck.check(store, live=False)
    assert report.ok, f"{context}: {report.problems}"
    assert report.garbage_chunks == 0, f"{context}: GC at mount left {report.garbage_chunks} orphaned chunks"
    assert report.unused_packs == 0, f"{context}: GC at mount left {report.unused_packs} unused packs"
    assert report.pack_bytes * THRESHOLD <= report.chunk_bytes + 1, f"{context}: packs not compacted: {report}"
    return report


_COUNTED = ("path", "size", "chunks", "distinct_chunks", "unique_bytes", "shared_bytes", "use_count", "labels")


def check_counts(m: Mount, context: str) -> None:
    """The daemon's kept rows and reference counts equal a full recount from the stubs."""
    served = DaemonClient(m.store).json("GET", "/snapshots")["snapshots"]
    full = [r.to_dict() for r in catalog.snapshots(m.store / "snapshots")]
    assert [[r[k] for k in _COUNTED] for r in served] == [[r[k] for k in _COUNTED] for r in full], context


def test_kill9_during_proxy_workload(tmp_path: Path) -> None:
    iterations = int(os.environ.get("KVCFS_KILL_ITERATIONS", "50"))
    seed = int(os.environ.get("KVCFS_KILL_SEED", str(random.randrange(1 << 32))))
    rng = random.Random(seed)
    base = ["--pack-size", "1MiB", "--gc-compact-threshold", str(THRESHOLD)]
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", base)
    work = Workload(m, rng)
    verified = 0
    started = time.monotonic()
    try:
        for i in range(iterations):
            context = f"seed {seed}, iteration {i}"
            durability = "fsync" if i % 4 == 3 else "close"
            m.start_settled([*base, "--durability", durability])
            verified += verify_and_check(m, work, context)
            check_counts(m, context)
            work.killed.clear()
            work.run_until_kill(rng.uniform(0.0, 1.5))
        m.start_settled()
        verified += verify_and_check(m, work, f"seed {seed}, final")
        check_counts(m, f"seed {seed}, final")
    finally:
        if m.proc is not None:
            m.stop()
        elif is_mounted(m.mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(m.mnt)], check=False)
    print(
        f"\nkill -9: {iterations} iterations (seed {seed}), {work.saves} saves, {verified} bytes verified, "
        f"ops started {work.in_flight}, {time.monotonic() - started:.1f}s"
    )
    assert work.saves > iterations // 4, "the workload hardly ran before the kills"


# -- full disk ------------------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path):
    d = tmp_path / "small"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_enospc_mid_save_keeps_previous_version(
    small_fs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's disk fills (another program) after saves were staged in memory and their closes
    succeeded; storing them fails (logged, counted, tried again) and each staged copy, whole, stays
    the snapshot until a retry stores it; meanwhile new saves are refused at their open. The
    previous version's stored form is never touched, nothing torn is ever served, and the daemon
    keeps serving."""
    hold = tmp_path / "hold-ingestion"
    monkeypatch.setenv("KVCFS_INGEST_HOLD", str(hold))
    m = Mount(small_fs / "store", tmp_path / "mnt", tmp_path / "daemon.log", ["--pack-size", "1MiB"])
    m.start_settled()
    snaps = m.store / "snapshots"
    try:
        v1, other = rand_bytes(4 * MiB, 1), rand_bytes(2 * MiB, 2)
        write_in_pieces(m.path("snap"), v1, MiB)
        write_in_pieces(m.path("other"), other, MiB)
        m.ingested()
        # Leave different amounts free so the disk fills in different places (pack, map, stub).
        for round_, free in enumerate((6 * MiB, 2 * MiB, 64 << 10)):
            stored = stubs.read_index(snaps / "snap").ids  # the previous version's stored form
            filler = small_fs / "filler"
            big = rand_bytes(7 * MiB, 10 + round_)  # room for it at its close; not once the disk fills
            failures = m.stats()["ingest_failures"]
            hold.touch()
            reader = open(m.path("snap"), "rb")  # noqa: SIM115 - open across the proxy's save
            write_in_pieces(m.path("snap.tmp"), big, MiB)  # the proxy's way: the close succeeds
            assert reader.read() == v1, f"round {round_}: a reader of the previous version saw other bytes"
            reader.close()  # passed through, a writer of the file waits for its readers
            write_in_pieces(m.path("snap"), big, MiB)  # in place
            st = os.statvfs(small_fs)
            filler.write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - free))
            hold.unlink()
            deadline = time.monotonic() + 60
            while m.stats()["ingest_failures"] < failures + 2:  # both tried, both failed
                assert time.monotonic() < deadline, m.log()[-3000:]
                time.sleep(0.05)
            for name in ("snap", "snap.tmp"):
                assert stubs.read_staged(snaps / name) is not None, f"round {round_}: {name} lost its staged save"
                assert m.path(name).read_bytes() == big, f"round {round_}: {name} is not the whole save"
            assert stubs.read_index(snaps / "snap").ids == stored, f"round {round_}: previous version damaged"
            assert m.path("other").read_bytes() == other
            with pytest.raises(OSError) as refused:
                open(m.path("new"), "wb").close()
            assert refused.value.errno == errno.ENOSPC, "the store cannot take a save: refused at its open"
            m.path("snap.tmp").unlink()
            filler.unlink()
            m.ingested()  # tried again, now that there is room
            assert stubs.read_staged(snaps / "snap") is None, f"round {round_}: the save was not stored"
            assert stubs.read_index(snaps / "snap").ids != stored
            assert m.path("snap").read_bytes() == big
            gc_now(m)  # the previous version's chunks and the failed attempts' are garbage now
            v2 = rand_bytes(3 * MiB, 20 + round_)
            write_in_pieces(m.path("snap.tmp"), v2, MiB)  # still serving: the next save works
            os.rename(m.path("snap.tmp"), m.path("snap"))
            m.ingested()
            assert stubs.read_staged(snaps / "snap") is None
            assert m.path("snap").read_bytes() == v2
            v1 = v2
        log = m.log()
        assert "No space left on device" in log
        assert "Traceback" not in log, "a full disk is the store's trouble, not a bug: one log line"
        m.stop()
        report, _ = fsck.check(m.store)
        assert report.ok, report.problems
        m.start(["--pack-size", "1MiB", "--hot-tier-size", "0"])  # read back from the chunks
        assert m.path("snap").read_bytes() == v1
    finally:
        if m.proc is not None:
            m.stop()


# -- corruption -----------------------------------------------------------------------------------


def chunk_location(store: Path, cid: bytes) -> tuple[int, int, int]:
    db = sqlite3.connect(store / "chunks.db")
    try:
        return db.execute("SELECT pack, offset, length FROM chunks WHERE id = ?", (cid,)).fetchone()
    finally:
        db.close()


def pack_path(store: Path, pack: int) -> Path:
    return store / "packs" / f"{pack:08d}.pack"


def test_corruption_fails_only_the_damaged_snapshots(kvfs) -> None:
    datas = {name: rand_bytes(2 * MiB + i, 30 + i) for i, name in enumerate(("flipped", "cut", "good", "junk"))}
    for name, data in datas.items():
        write_in_pieces(kvfs.path(name), data, MiB)
        kvfs.remount()  # a new daemon starts a new pack: each snapshot has packs of its own
    snaps = kvfs.store / "snapshots"
    kvfs.stop()
    # A flipped byte inside a chunk of "flipped".
    victim = stubs.read_index(snaps / "flipped").ids[3]
    pack, off, length = chunk_location(kvfs.store, victim)
    with open(pack_path(kvfs.store, pack), "r+b") as f:
        f.seek(off + length // 2)
        byte = f.read(1)
        f.seek(off + length // 2)
        f.write(bytes([byte[0] ^ 0x55]))
    # The pack holding the end of "cut" loses its second half.
    last = stubs.read_index(snaps / "cut").ids[-1]
    cut_pack = chunk_location(kvfs.store, last)[0]
    os.truncate(pack_path(kvfs.store, cut_pack), pack_path(kvfs.store, cut_pack).stat().st_size // 2)
    # A stub that is not an index any more.
    (snaps / "junk").write_bytes(b"garbage" * 100)

    offline = kv_cli("fsck", "--store", str(kvfs.store), "--verify-data")
    assert offline.returncode == 1, offline.stdout + offline.stderr
    assert f"pack {cut_pack}:" in offline.stdout and "past its end" in offline.stdout
    assert victim.hex() in offline.stdout and "fails its checksum" in offline.stdout
    for name in ("flipped", "cut", "junk"):
        assert f"snapshot {name}:" in offline.stdout
    assert "snapshot good:" not in offline.stdout

    kvfs.start(["--hot-tier-size", "0"])  # no hot copies: every open puts the file back from the packs
    for name in ("flipped", "cut", "junk"):
        with pytest.raises(OSError) as e:
            kvfs.path(name).read_bytes()
        assert e.value.errno == errno.EIO, name
    assert kvfs.path("good").read_bytes() == datas["good"]
    log = kvfs.log()
    # The open puts the file back from its chunks and fails there: its log line names the
    # snapshot (and, for the corrupt one, the chunk), from the FUSE side, not only recovery's.
    served = [line for line in log.splitlines() if "kvchunkfs.fuse" in line]
    assert any("flipped" in line and victim.hex() in line for line in served), log[-3000:]
    assert "snapshot cut needs" in log
    assert any(" cut" in line for line in served), log[-3000:]
    assert "cannot open snapshot junk" in log

    mounted = kv_cli("fsck", "--store", str(kvfs.store), "--verify-data")
    assert mounted.returncode == 1, mounted.stdout + mounted.stderr
    for name in ("flipped", "cut", "junk"):
        assert f"snapshot {name}:" in mounted.stdout
    assert "snapshot good:" not in mounted.stdout
    assert "mounted: read-only check" in mounted.stdout


def test_flipped_byte_in_stub_keeps_its_chunks(kvfs) -> None:
    """GC must not collect the chunks of a stub it cannot parse: fsck may still rescue it."""
    data = rand_bytes(2 * MiB, 40)
    write_in_pieces(kvfs.path("s"), data, MiB)
    kvfs.ingested()  # the stub holds the index once the save is stored
    stub = kvfs.store / "snapshots" / "s"
    good = stub.read_bytes()
    broken = bytearray(good)
    broken[-3] ^= 0xFF  # the tail marker
    stub.write_bytes(bytes(broken))
    gc_now(kvfs)
    assert "not a valid index" in kvfs.log()
    stub.write_bytes(good)
    # No hot copy: the read puts the file back from its chunks, so they must all still be there.
    kvfs.remount(["--hot-tier-size", "0"])
    assert kvfs.path("s").read_bytes() == data
