"""Crash recovery at mount, the store lock, and what a kill -9 may and may not leave behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import SRC, Mount
from helpers import rand_bytes, wait_for_log, write_in_pieces

from kvchunkfs.maint import fsck

MiB = 1 << 20


def packs(store: Path) -> list[Path]:
    return sorted((store / "packs").glob("*.pack"))


def test_recovery_cuts_tails_and_removes_leftovers(kvfs) -> None:
    data = rand_bytes(3 * MiB, 1)
    write_in_pieces(kvfs.path("a"), data, MiB)
    kvfs.stop()
    last = packs(kvfs.store)[-1]
    size = last.stat().st_size
    with open(last, "ab") as f:  # a batch written but never committed
        f.write(os.urandom(12345))
    stray = kvfs.store / "packs" / f"{int(last.stem) + 1:08d}.pack"
    stray.write_bytes(os.urandom(5000))  # a pack whose first batch never reached the map
    (kvfs.store / "tmp" / "stub-deadbeef").write_bytes(b"half a stub")
    (kvfs.store / "staging" / "x.staging").write_bytes(b"a staged copy")

    kvfs.start_settled()
    log = kvfs.log()
    assert f"pack {int(last.stem)}: cut 12345 bytes" in log
    assert f"removed pack {int(stray.stem)}" in log
    assert "2 temp files removed" in log
    assert last.stat().st_size == size and not stray.exists()
    assert not any((kvfs.store / "tmp").iterdir()) and not any((kvfs.store / "staging").iterdir())
    assert kvfs.path("a").read_bytes() == data
    report, _ = fsck.check(kvfs.store)
    assert report.ok, report.problems


def test_second_daemon_on_the_same_store_is_refused(kvfs, tmp_path: Path) -> None:
    kvfs.path("a").write_bytes(b"x" * 1000)
    env = dict(os.environ, PYTHONPATH=str(SRC))
    (tmp_path / "mnt2").mkdir()
    cmd = [sys.executable, "-m", "kvchunkfs.cli", "mount", "--store", str(kvfs.store), str(tmp_path / "mnt2")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2
    assert "in use by another kv-chunk-fs process" in r.stderr and str(kvfs.proc.pid) in r.stderr
    assert kvfs.path("a").read_bytes() == b"x" * 1000  # the first daemon still serves


def test_reader_close_does_not_publish_a_half_written_save(kvfs) -> None:
    """Only the writer's close saves: a reader closing mid-save must not make the partial file the snapshot."""
    old, new = rand_bytes(2 * MiB, 2), rand_bytes(6 * MiB, 3)
    write_in_pieces(kvfs.path("s"), old, MiB)
    writer = open(kvfs.path("s"), "wb")  # noqa: SIM115 - killed before it is closed
    writer.write(new[: 3 * MiB])
    writer.flush()
    with open(kvfs.path("s"), "rb") as reader:  # its close sends FLUSH with the writer's pages
        reader.read(100)
    kvfs.kill()
    try:
        writer.close()
    except OSError:
        pass  # the daemon is gone
    kvfs.start_settled()
    assert kvfs.path("s").read_bytes() == old


def test_kill_during_gc_keeps_every_snapshot(tmp_path: Path) -> None:
    """kill -9 while GC deletes and compacts packs: nothing live is lost, the next mount cleans up."""
    extra = ["--pack-size", "16MiB", "--gc-compact-threshold", "0.9"]  # every pack of a round is compacted
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", extra)
    m.start_settled()
    rng = random.Random(7)
    kept: dict[str, bytes] = {}
    hits = 0
    try:
        for round_ in range(4):
            for i in range(8):  # 4 MiB each: every pack holds four, and half of them die
                data = rng.randbytes(4 * MiB)
                write_in_pieces(m.path(f"r{round_}-{i}"), data, MiB)
                if i % 2 == 0:
                    kept[f"r{round_}-{i}"] = data
            for i in range(1, 8, 2):
                m.path(f"r{round_}-{i}").unlink()
            finished, requested = m.log().count("gc finished"), m.log().count("gc requested")
            assert m.proc is not None
            m.proc.send_signal(signal.SIGUSR1)
            wait_for_log(m, "gc requested", requested + 1)
            time.sleep(rng.uniform(0.0, 0.05))
            m.kill()
            hits += m.log().count("gc finished") == finished  # the GC did not get to its end
            m.start_settled()
            for name, data in kept.items():
                assert m.path(name).read_bytes() == data, f"round {round_}: {name}"
            report, _ = fsck.check(m.store)
            assert report.ok, f"round {round_}: {report.problems}"
            assert report.garbage_chunks == 0
    finally:
        if m.proc is not None:
            m.stop()
    print(f"\nkills during GC: {hits} of 4 landed before it finished")
