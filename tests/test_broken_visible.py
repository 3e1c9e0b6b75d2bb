"""A snapshot ``fsck --repair`` marked broken is shown as broken, with why, wherever snapshots are
listed (``ls``, ``stats``, the API, ``/metrics``); fsck says what each problem means and what to do;
``fsck --verify-data SUBSET`` re-hashes only part of the chunk bytes."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

from conftest import SRC, Mount
from helpers import rand_bytes, write_in_pieces

from kvchunkfs.service.apiclient import DaemonClient
from kvchunkfs.store import stubs

MiB = 1 << 20


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KV_CHUNK_FS_")}
    env["PYTHONPATH"] = str(SRC)
    return subprocess.run([sys.executable, "-m", "kvchunkfs.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def flip_a_chunk(store: Path, name: str) -> None:
    """One byte of one of ``name``'s chunks changed in its pack (a disk fault)."""
    victim = stubs.read_index(store / "snapshots" / name).ids[2]
    db = sqlite3.connect(store / "chunks.db")
    pack, off = db.execute("SELECT pack, offset FROM chunks WHERE id = ?", (victim,)).fetchone()
    db.close()
    with open(store / "packs" / f"{pack:08d}.pack", "r+b") as f:
        f.seek(off + 7)
        b = f.read(1)
        f.seek(off + 7)
        f.write(bytes([b[0] ^ 1]))


def test_a_snapshot_marked_broken_is_listed_as_broken(kvfs: Mount) -> None:
    write_in_pieces(kvfs.path("bad"), rand_bytes(2 * MiB, 1), MiB)
    write_in_pieces(kvfs.path("good"), rand_bytes(2 * MiB, 2), MiB)
    kvfs.stop()
    flip_a_chunk(kvfs.store, "bad")
    store = ["--store", str(kvfs.store)]

    plain = cli("fsck", *store)
    assert plain.returncode == 0, "without --verify-data no chunk byte is read"
    r = cli("fsck", *store, "--verify-data", "--repair")
    assert r.returncode == 1, r.stdout
    assert "marked snapshot bad broken" in r.stdout
    advice = [line for line in r.stdout.splitlines() if line.startswith("what to do: ")]
    assert any("fail their checksum" in line for line in advice), r.stdout
    assert any("broken snapshots" in line and "bucket" in line and "delete" in line and "inspection" in line
               for line in advice), r.stdout  # fmt: skip

    again = cli("fsck", *store)
    assert "snapshot bad: " in again.stdout and "(marked broken)" in again.stdout
    assert "already marked broken" in again.stdout

    # Offline: ls and stats read the stubs.
    table = cli("ls", *store)
    assert table.returncode == 0, table.stderr
    (row,) = [line for line in table.stdout.splitlines() if line.startswith("bad ")]
    assert "(broken: " in row
    assert not any("broken" in line for line in table.stdout.splitlines() if line.startswith("good "))
    assert "cannot be read in full" in table.stderr and "fsck" in table.stderr
    rows = {r["path"]: r for r in json.loads(cli("ls", *store, "--json").stdout)}
    assert "chunks" in rows["bad"]["broken"] and "broken" not in rows["good"]
    assert json.loads(cli("stats", *store, "--json").stdout)["broken"] == 1
    assert re.search(r"snapshots:\s+2 \(1 broken", cli("stats", *store).stdout)

    # Mounted: the API, stats through it, and the metrics.
    kvfs.start()
    kvfs.catalog_loaded()
    client = DaemonClient(kvfs.store)
    listed = {r["path"]: r for r in client.json("GET", "/snapshots")["snapshots"]}
    assert listed["bad"]["broken"] == rows["bad"]["broken"] and "broken" not in listed["good"]
    assert client.json("GET", "/snapshots/bad")["broken"] == rows["bad"]["broken"]
    assert client.json("GET", "/stats")["broken"] == 1
    metrics = client.text("GET", "/metrics")
    assert re.search(r"^kvcfs_snapshots_broken 1\.0$", metrics, re.M), metrics
    assert "(broken: " in cli("ls", *store).stdout


def test_verify_data_reads_a_subset(tmp_path: Path) -> None:
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log")
    m.start()
    try:
        for i in range(4):
            write_in_pieces(m.path(f"s{i}"), rand_bytes(2 * MiB, 10 + i), MiB)
    finally:
        m.stop()
    store = ["--store", str(m.store)]
    whole = cli("fsck", *store, "--verify-data")
    total = int(re.search(r"(\d+) bytes verified", whole.stdout).group(1))
    assert total >= 8 * MiB
    budget = cli("fsck", *store, "--verify-data", "1MiB")
    assert budget.returncode == 0, budget.stdout + budget.stderr
    verified = int(re.search(r"(\d+) bytes verified", budget.stdout).group(1))
    assert 0 < verified <= MiB, budget.stdout
    share = cli("fsck", *store, "--verify-data", "25%")
    verified = int(re.search(r"(\d+) bytes verified", share.stdout).group(1))
    assert 0 < verified <= total // 4 + 1, share.stdout
    bad = cli("fsck", *store, "--verify-data", "lots")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--verify-data" in bad.stderr
