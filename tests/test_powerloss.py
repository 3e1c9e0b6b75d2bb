"""Power loss: the store on a file system that forgets what was not made durable (tests/powerfs.py).

Each round: a workload of saves (``NAME.tmp`` then rename, as the proxy does), appends, ``O_TRUNC``
rewrites, renames, unlinks and GC runs on the mount; at a random moment the daemon is killed and
the power is "cut" (powerfs undoes the changes nobody made durable: a random prefix of each file's
writes and of the metadata survives). Then the store is mounted again (recovery) and checked:

* every name reads back a whole version it had (never wrong bytes), and fsck passes;
* ``durability=fsync``: everything whose call returned survives, renames and unlinks included;
* ``durability=close``: a name that had a durable whole version before the round keeps a whole
  version (the old or a new one) unless the round removed it.

KVCFS_POWERLOSS_ROUNDS sets the rounds per mode (default 5), KVCFS_POWERLOSS_SEED the seed.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import Mount, is_mounted
from helpers import save as save_content
from helpers import sha

from kvchunkfs.maint import fsck

ROUNDS = int(os.environ.get("KVCFS_POWERLOSS_ROUNDS", "5"))
SEED = int(os.environ.get("KVCFS_POWERLOSS_SEED", str(random.randrange(1 << 30))))
POWERFS = Path(__file__).resolve().parent / "powerfs.py"
KiB, MiB = 1 << 10, 1 << 20
NAMES = ("a", "b", "d/c")
EMPTY = sha(b"")


class PowerFS:
    """The power-loss layer serving ``backing`` on ``mnt``; ``cut`` unmounts it, losing what was not durable."""

    def __init__(self, backing: Path, mnt: Path, log: Path) -> None:
        self.backing, self.mnt, self.log_path = backing, mnt, log
        mnt.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, seed: int) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in cut()
        self.proc = subprocess.Popen(
            [sys.executable, str(POWERFS), str(self.backing), str(self.mnt), str(seed)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while not is_mounted(self.mnt):
            assert self.proc.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, "powerfs did not mount"
            time.sleep(0.02)

    def sync(self) -> None:
        """Everything so far becomes durable (the page cache was written back)."""
        os.setxattr(self.mnt, "user.powerfs.sync", b"1")

    def cut(self) -> str:
        assert self.proc is not None
        if subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True).returncode:
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], check=True)
        assert self.proc.wait(timeout=60) == 0, self.log_path.read_text()[-3000:]
        self._log.close()
        self.proc = None
        return self.log_path.read_text().strip().rsplit("\n", 1)[-1]


@dataclass
class Record:
    """What every name held: ``state`` after the calls that returned, ``ever`` every version each had."""

    state: dict[str, str] = field(default_factory=dict)  # name -> sha
    ever: dict[str, set[str]] = field(default_factory=dict)
    allowed: dict[str, set[str | None]] | None = None  # the call in flight: the states it may leave
    removed: set[str] = field(default_factory=set)  # names a call of this round removed (unlink, rename away)

    def begin(self, changes: dict[str, str | None]) -> None:
        self.removed |= {n for n, v in changes.items() if v is None}
        self.allowed = {n: {self.state.get(n), v} for n, v in changes.items()}
        for n, v in changes.items():
            if v is not None:
                self.ever.setdefault(n, set()).add(v)

    def end(self, changes: dict[str, str | None]) -> None:
        for n, v in changes.items():
            if v is None:
                self.state.pop(n, None)
            else:
                self.state[n] = v
        self.allowed = None


class Workload:
    def __init__(self, mnt: Path, rng: random.Random, rec: Record, daemon: Mount) -> None:
        self.mnt, self.rng, self.rec, self.daemon = mnt, rng, rec, daemon
        self.base = rng.randbytes(2 * MiB)
        self.calls = 0

    def data(self) -> bytes:
        """A version sharing most chunks with the others (so GC has shared and freed chunks)."""
        rng = self.rng
        size = rng.randrange(64 * KiB, 1536 * KiB)
        start = rng.randrange(0, len(self.base) - size)
        out = bytearray(self.base[start : start + size])
        at = rng.randrange(0, size)
        out[at : at + 64 * KiB] = rng.randbytes(min(64 * KiB, size - at))
        return bytes(out)

    def _write(self, name: str, data: bytes, mode: str) -> None:
        with open(self.mnt / name, mode) as f:
            for i in range(0, len(data), 256 * KiB):
                f.write(data[i : i + 256 * KiB])

    def step(self) -> None:
        rng, rec = self.rng, self.rec
        name = rng.choice(NAMES)
        have = rec.state.get(name)
        kind = rng.choice(["save", "save", "rewrite", "append", "rename", "unlink", "gc"])
        if kind == "save" or have is None:  # as the proxy saves: NAME.tmp, then rename over NAME
            data, tmp = self.data(), name + ".tmp"
            self._call({tmp: sha(data)}, lambda: self._write(tmp, data, "wb"), creates=tmp)
            self._call(
                {tmp: None, name: sha(data)}, lambda: os.rename(self.mnt / tmp, self.mnt / name), moved=(tmp, name)
            )
        elif kind == "rewrite":
            data = self.data()
            self._call({name: sha(data)}, lambda: self._write(name, data, "wb"))
        elif kind == "append":
            extra = self.data()[: rng.randrange(1, 256 * KiB)]
            new = sha((self.mnt / name).read_bytes() + extra)
            self._call({name: new}, lambda: self._write(name, extra, "ab"))
        elif kind == "rename":
            other = rng.choice([n for n in NAMES if n != name])
            self._call(
                {name: None, other: have}, lambda: os.rename(self.mnt / name, self.mnt / other), moved=(name, other)
            )
        elif kind == "unlink":
            self._call({name: None}, lambda: os.unlink(self.mnt / name))
        else:
            assert self.daemon.proc is not None
            self.daemon.proc.send_signal(signal.SIGUSR1)  # a GC beside the next calls

    def _call(
        self,
        changes: dict[str, str | None],
        call: Callable[[], None],
        creates: str | None = None,
        moved: tuple[str, str] | None = None,
    ) -> None:
        rec = self.rec
        rec.begin(changes)
        assert rec.allowed is not None
        if creates is not None:  # create makes an empty snapshot before the first write
            rec.allowed[creates].add(EMPTY)
            rec.ever.setdefault(creates, set()).add(EMPTY)
        if moved is not None:  # the target may come back as any version the source had
            src, dst = moved
            rec.ever.setdefault(dst, set()).update(rec.ever.get(src, set()))
        call()
        self.calls += 1
        rec.end(changes)

    def run_until_killed(self, proc: subprocess.Popen[bytes], delay: float) -> None:
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            proc.kill()

        killer = threading.Timer(delay, kill)
        killer.start()
        try:
            while True:
                self.step()
        except OSError:
            if not killed.is_set():
                raise  # a call failed before the cut
        finally:
            killer.join()


def read_all(mnt: Path) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(mnt):
        for f in files:
            path = Path(root) / f
            out[str(path.relative_to(mnt))] = sha(path.read_bytes())
    return out


def check(found: dict[str, str], rec: Record, mode: str, baseline: dict[str, str], context: str) -> None:
    for name, digest in found.items():
        assert digest in rec.ever.get(name, set()), f"{context}: {name} reads back bytes it never had"
        # Every save of these names has bytes: an empty file is a lost save served as a version.
        assert name not in NAMES or digest != EMPTY, f"{context}: {name} reads back empty"
    if mode == "fsync":
        for name in set(found) | set(rec.state) | set(rec.allowed or {}):
            allowed = (rec.allowed or {}).get(name, {rec.state.get(name)})
            assert found.get(name) in allowed, f"{context}: {name} is {found.get(name)}, expected one of {allowed}"
    else:
        for name in baseline:
            if name not in rec.removed:
                assert name in found, f"{context}: {name} had a durable version and lost every version"


@pytest.fixture
def layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[PowerFS, Mount]]:
    # A cut is a reboot: the daemons see a new boot id after each (staged saves and whole copies,
    # in memory, are gone or not to be trusted).
    (tmp_path / "boot_id").write_text("boot-0\n")
    monkeypatch.setenv("KVCFS_BOOT_ID_FILE", str(tmp_path / "boot_id"))
    power = PowerFS(tmp_path / "backing", tmp_path / "power", tmp_path / "powerfs.log")
    store = power.mnt / "store"
    m = Mount(store, tmp_path / "mnt", tmp_path / "daemon.log", jitter=False)
    try:
        yield power, m
    finally:
        if m.proc is not None:
            m.kill()
        if is_mounted(m.mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(m.mnt)], check=False)
        if power.proc is not None:
            power.cut()


@pytest.mark.parametrize("mode", ["fsync", "close"])
def test_power_cut_keeps_whole_versions(layers: tuple[PowerFS, Mount], mode: str) -> None:
    power, m = layers
    rng = random.Random(SEED + (mode == "close"))
    extra = ["--durability", mode, "--pack-size", "4MiB", "--gc-compact-threshold", "0.9"]
    m.extra = extra
    rec = Record()
    power.start(rng.randrange(1 << 30))
    m.store.mkdir(parents=True, exist_ok=True)
    m.start_settled()
    (m.mnt / "d").mkdir()
    m.stop()
    rounds = calls = 0
    cuts = []
    for rnd in range(ROUNDS):
        context = f"{mode} round {rnd} (seed {SEED})"
        # The state the round starts from is durable: written back, as after a few quiet seconds.
        power.sync()
        baseline = dict(rec.state)
        rec.removed = set()
        m.start_settled()
        work = Workload(m.mnt, rng, rec, m)
        assert m.proc is not None
        work.run_until_killed(m.proc, rng.uniform(0.2, 2.5))
        m.kill()
        calls += work.calls
        cuts.append(power.cut())
        Path(os.environ["KVCFS_BOOT_ID_FILE"]).write_text(f"boot-{rnd + 1}\n")
        power.start(rng.randrange(1 << 30))
        m.start_settled()
        found = read_all(m.mnt)
        check(found, rec, mode, baseline, context)
        m.stop()
        report, _ = fsck.check(m.store, live=False)
        assert report.ok, f"{context}: fsck: {report.problems}"
        rec.state = found  # what survived is the record from now on (close mode may lose recent calls)
        rec.allowed = None
        rounds += 1
    print(f"\npower loss ({mode}): {rounds} rounds, {calls} calls, seed {SEED}; last cut: {cuts[-1]}")
    assert calls > rounds, "the workload hardly ran before the cuts"


def test_recovery_puts_a_kept_version_back_and_sets_the_unreadable_aside(tmp_path: Path) -> None:
    """Without FUSE: a durable "a" is replaced by a save whose stub a cut emptied (its kept version
    comes back); a new "b" whose stub was emptied has no older version (set aside); fsck passes."""
    from kvchunkfs.file.files import Files
    from kvchunkfs.maint.recovery import recover
    from kvchunkfs.store.repository import Repository, StoreSettings

    root = tmp_path / "store"
    repo = Repository(root, StoreSettings(durability="close"))
    recover(repo)  # as every mount does: the map has the time of a check
    files = Files(repo)
    v0, v1 = random.Random(1).randbytes(MiB), random.Random(2).randbytes(MiB)
    for rel, data in (("a", v0), ("a", v1), ("b", v1)):
        content = files.content(repo.empty_index())
        content.to_staging()
        content.write(0, data)
        assert save_content(files, content, rel)
        content.close()
        if data is v0:
            repo.checkpoint()  # v0 is durable: nothing kept for it
    assert sorted(p.name for p in repo.layout.prev.iterdir()) == ["YQ=="]  # base64 of "a"
    repo.path("a").write_bytes(b"")  # the cut: the new stubs' bytes never reached the disk
    repo.path("b").write_bytes(b"")
    files.close()
    # No clean unmount: the next mount's recovery (repo left open, as a crashed daemon leaves it).
    again = Repository(root, StoreSettings(durability="close"))
    report = recover(again)
    assert report.restored == ["a"] and list(report.set_aside) == ["b"]
    assert not report.unreadable and not report.missing
    assert not (root / "snapshots" / "b").exists() and list(again.layout.lost_found.iterdir())
    files = Files(again)
    index = again.read_index("a")
    assert files.read_file(index, 0, index.size) == v0
    assert not list(again.layout.prev.iterdir())
    files.close()
    again.close()
    report_fsck, _ = fsck.check(root, live=False)
    assert report_fsck.ok, report_fsck.problems


def test_gc_keeps_the_chunks_of_a_kept_version(tmp_path: Path) -> None:
    """A save that replaces a name after GC's checkpoint is not durable yet: until the next
    checkpoint the version it replaced may come back after a cut, so its chunks are not garbage."""
    from kvchunkfs.file.files import Files
    from kvchunkfs.maint import gc, gcreport, gcsweep
    from kvchunkfs.store import stubs
    from kvchunkfs.store.repository import Repository, StoreSettings

    repo = Repository(tmp_path / "store", StoreSettings(durability="close"))
    files = Files(repo)
    old_ids = set()
    for data in (random.Random(1).randbytes(MiB), random.Random(2).randbytes(MiB)):
        content = files.content(repo.empty_index())
        content.to_staging()
        content.write(0, data)
        assert save_content(files, content, "a")
        content.close()
        if not old_ids:
            old_ids = set(repo.read_index("a").ids)
            repo.checkpoint()
    assert old_ids.isdisjoint(repo.read_index("a").ids)
    report = gcreport.GCReport()
    gcsweep.mark_and_sweep(repo, report)  # a walk that began after the checkpoint of its run
    assert report.chunks_freed == 0
    assert set(repo.store.locate_many(old_ids)) == old_ids
    kept = next(repo.layout.prev.iterdir())
    assert set(stubs.read_index(kept).ids) == old_ids
    assert gc.run_gc(repo, 0.5).chunks_freed == len(old_ids)  # its checkpoint made "a" durable
    files.close()
    repo.close()


WINDOW = 5.0 + 5.0  # ingestion at most ~5 s behind before closes wait, and the 5 s between checkpoints
SAVE_SECONDS = float(os.environ.get("KVCFS_POWERLOSS_SAVE_SECONDS", "20"))


def test_a_power_cut_loses_only_the_last_seconds_of_saves(layers: tuple[PowerFS, Mount]) -> None:
    """``durability=close`` with saves arriving faster than ingestion stores them (the store under
    powerfs is slow): a cut wipes the memory tier (a new boot id). Every name reads back its save or
    nothing (never other bytes); the ages of the saves lost are reported (the documentation
    promises about the last 10 s)."""
    power, m = layers
    rng = random.Random(SEED)
    m.extra = ["--durability", "close"]
    power.start(rng.randrange(1 << 30))
    m.store.mkdir(parents=True, exist_ok=True)
    m.start_settled()
    acked: list[tuple[str, str, float]] = []  # name, sha, when its close returned
    start = time.monotonic()
    i = 0
    while time.monotonic() - start < SAVE_SECONDS:
        data = rng.randbytes(4 * MiB)
        with open(m.mnt / f"s{i}", "wb") as f:
            for k in range(0, len(data), MiB):
                f.write(data[k : k + MiB])
        acked.append((f"s{i}", sha(data), time.monotonic()))
        i += 1
    behind = m.stats()["ingest_behind_ms"]
    m.kill()
    cut = time.monotonic()
    power.cut()
    Path(os.environ["KVCFS_BOOT_ID_FILE"]).write_text("boot-1\n")
    power.start(rng.randrange(1 << 30))
    m.start_settled()
    found = read_all(m.mnt)
    m.stop()
    report, _ = fsck.check(m.store, live=False)
    assert report.ok, f"fsck: {report.problems}"
    by_name = {name: digest for name, digest, _ in acked}
    for name, digest in found.items():
        assert by_name.get(name) in (digest, None) or digest == EMPTY, f"{name} reads back bytes it never had"
    lost = [(name, cut - when) for name, digest, when in acked if found.get(name) != digest]
    ages = sorted(age for _, age in lost)
    print(f"\npower cut after {len(acked)} saves of 4 MiB in {SAVE_SECONDS:.0f} s (ingestion {behind} ms behind): "
          f"{len(lost)} acknowledged saves lost, ages {[round(a, 1) for a in ages]} s (seed {SEED})")  # fmt: skip


def _cut_and_reboot(power: PowerFS, m: Mount, seed: int) -> None:
    """The daemon dies with the power; a new boot: staged saves, in memory, are gone."""
    m.kill()
    power.cut()
    boot = Path(os.environ["KVCFS_BOOT_ID_FILE"])
    boot.write_text(boot.read_text().strip() + "-next\n")
    power.start(seed)
    m.start_settled()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("held", [False, True])
def test_staged_saves_renamed_over_names_through_a_power_cut(
    layers: tuple[PowerFS, Mount], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: bool
) -> None:
    """durability=close, llama-server's save: NAME.tmp written and closed, renamed over NAME.
    Saves the client fsync()ed (the file, then the directory) read back after the cut; the others
    leave NAME reading the old version or the new one, never an empty file. ``held``: not one of
    them stored before the cut (a GC, with its checkpoint, in between)."""
    power, m = layers
    hold = tmp_path / "hold-ingestion"
    monkeypatch.setenv("KVCFS_INGEST_HOLD", str(hold))
    m.extra = ["--durability", "close"]
    rng = random.Random(SEED)
    power.start(rng.randrange(1 << 30))
    m.store.mkdir(parents=True, exist_ok=True)
    m.start_settled()
    names = [f"s{i}" for i in range(8)]
    old = {n: rng.randbytes(MiB + i) for i, n in enumerate(names)}
    new = {n: rng.randbytes(MiB + 7 + i) for i, n in enumerate(names)}
    for n in names:
        (m.mnt / n).write_bytes(old[n])
    m.ingested()
    gc_at = m.log().count("gc finished")
    assert m.proc is not None
    m.proc.send_signal(signal.SIGUSR1)  # its checkpoint makes the old versions durable
    while m.log().count("gc finished") <= gc_at:
        time.sleep(0.02)
    power.sync()
    if held:
        hold.touch()
    synced = set(names[::2])
    for n in names:
        tmp = m.mnt / f"{n}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, new[n])
            if n in synced:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, m.mnt / n)
        if n in synced:
            _fsync_path(m.mnt)
    if held:
        gc_at = m.log().count("gc finished")
        m.proc.send_signal(signal.SIGUSR1)
        while m.log().count("gc finished") <= gc_at:
            time.sleep(0.02)
    else:
        m.ingested()
    hold.unlink(missing_ok=True)
    _cut_and_reboot(power, m, rng.randrange(1 << 30))
    found = read_all(m.mnt)
    assert sorted(found) == names
    for n in names:
        if n in synced:
            assert found[n] == sha(new[n]), f"{n}: a save the client fsync()ed was lost"
        else:
            assert found[n] in (sha(old[n]), sha(new[n])), f"{n} reads {found[n]}"
    m.stop()
    report, _ = fsck.check(m.store, live=False)
    assert report.ok, report.problems
