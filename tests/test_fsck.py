"""``kv-chunk-fs fsck``: what it reports, what --repair changes, and what it never deletes."""

from __future__ import annotations

import os
import pty
import sqlite3
import subprocess
import sys
from pathlib import Path

from conftest import SRC
from helpers import rand_bytes, write_in_pieces

from kvchunkfs.store import stubs

MiB = 1 << 20


def fsck_cli(store: Path, *flags: str, stderr: int | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    cmd = [sys.executable, "-m", "kvchunkfs.cli", "fsck", "--store", str(store), *flags]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=stderr or subprocess.PIPE, text=True, env=env)


def summary(r: subprocess.CompletedProcess[str]) -> str:
    return r.stdout.strip().splitlines()[-1]


def packs(store: Path) -> list[Path]:
    return sorted((store / "packs").glob("*.pack"))


def test_clean_store(kvfs) -> None:
    write_in_pieces(kvfs.path("a"), rand_bytes(3 * MiB, 1), MiB)
    kvfs.stop()
    r = fsck_cli(kvfs.store, "--verify-data")
    assert r.returncode == 0, r.stdout
    assert summary(r).startswith("fsck: 1 snapshots, ") and " 0 problems, 0 broken snapshots" in summary(r)
    assert f"{3 * MiB} bytes verified" in summary(r)


def test_finds_and_repairs_crash_leftovers_and_garbage(kvfs) -> None:
    keep = rand_bytes(3 * MiB, 2)
    write_in_pieces(kvfs.path("keep"), keep, MiB)
    write_in_pieces(kvfs.path("gone"), rand_bytes(2 * MiB, 3), MiB)
    kvfs.stop()
    (kvfs.store / "snapshots" / "gone").unlink()  # its chunks: garbage
    last = packs(kvfs.store)[-1]
    with open(last, "ab") as f:
        f.write(os.urandom(4321))  # an uncommitted tail
    (kvfs.store / "tmp" / "stub-1").write_bytes(b"x")
    db = sqlite3.connect(kvfs.store / "chunks.db")
    row = "INSERT INTO chunks (id, pack, offset, length) VALUES (?, 999, 0, 10)"
    db.execute(row, (os.urandom(32),))  # a row into a missing pack
    db.commit()
    db.close()

    r = fsck_cli(kvfs.store)
    assert r.returncode == 1
    assert f"pack {int(last.stem)}: 4321 bytes after its last mapped chunk" in r.stdout
    assert "pack 999 is missing" in r.stdout
    assert "leftover files" in r.stdout
    assert "garbage 0 chunks" not in summary(r)

    r = fsck_cli(kvfs.store, "--repair")
    assert r.returncode == 1  # problems were found (and repaired)
    assert "repaired: removed 1 leftover temp/staging files" in r.stdout
    assert "repaired: dropped 1 map rows outside their pack, cut 1 pack tails (4321 bytes)" in r.stdout
    assert "unreferenced chunks" in r.stdout

    r = fsck_cli(kvfs.store, "--verify-data")
    assert r.returncode == 0, r.stdout
    assert "garbage 0 chunks (0 bytes), slack 0 bytes (0 unused packs)" in summary(r)
    kvfs.start()
    assert kvfs.path("keep").read_bytes() == keep


def test_repair_marks_broken_snapshots_and_never_deletes_them(kvfs) -> None:
    datas = {name: rand_bytes(2 * MiB, 10 + i) for i, name in enumerate(("flipped", "holed", "junk", "fine"))}
    for name, data in datas.items():
        write_in_pieces(kvfs.path(name), data, MiB)
    kvfs.stop()
    snaps = kvfs.store / "snapshots"
    victim = stubs.read_index(snaps / "flipped").ids[2]
    lost = stubs.read_index(snaps / "holed").ids[4]
    db = sqlite3.connect(kvfs.store / "chunks.db")
    pack, off, length = db.execute("SELECT pack, offset, length FROM chunks WHERE id = ?", (victim,)).fetchone()
    lost_at = db.execute("SELECT pack, offset FROM chunks WHERE id = ?", (lost,)).fetchone()
    db.execute("DELETE FROM chunks WHERE id = ?", (lost,))
    db.commit()
    db.close()
    # The packs' records would re-map a row the map lost: the lost chunk's bytes go too.
    for p, o in ((pack, off), lost_at):
        with open(kvfs.store / "packs" / f"{p:08d}.pack", "r+b") as f:
            f.seek(o + 7)
            b = f.read(1)
            f.seek(o + 7)
            f.write(bytes([b[0] ^ 1]))
    (snaps / "junk").write_bytes(b"\0" * 200)

    r = fsck_cli(kvfs.store, "--verify-data", "--repair")
    assert r.returncode == 1
    assert f"{victim.hex()} fails its checksum" in r.stdout
    assert "snapshot holed: " in r.stdout and lost.hex() in r.stdout
    assert "snapshot junk: not a valid index" in r.stdout
    assert "snapshot fine" not in r.stdout
    for name in ("flipped", "holed", "junk"):
        assert (snaps / name).exists(), f"{name} was deleted"
        assert os.getxattr(snaps / name, stubs.BROKEN), name
    assert stubs.BROKEN not in os.listxattr(snaps / "fine")
    assert "dropped 1 corrupt chunks from the map" in r.stdout

    kvfs.start()
    assert kvfs.path("fine").read_bytes() == datas["fine"]
    assert os.getxattr(kvfs.path("holed"), stubs.BROKEN)  # visible through the mount
    # Saving the same bytes again brings the lost chunks back: the broken snapshots read again.
    write_in_pieces(kvfs.path("copy1"), datas["flipped"], MiB)
    write_in_pieces(kvfs.path("copy2"), datas["holed"], MiB)
    # Without a hot tier the reads put the files back from the chunks (the copies' hot copies
    # have the same content and would answer them otherwise).
    kvfs.remount(["--hot-tier-size", "0"])
    assert kvfs.path("flipped").read_bytes() == datas["flipped"]
    assert kvfs.path("holed").read_bytes() == datas["holed"]
    # A new version of a broken snapshot is not broken (once stored: the stub is replaced).
    write_in_pieces(kvfs.path("junk"), b"new content", 4096)
    kvfs.ingested()
    assert stubs.BROKEN not in os.listxattr(kvfs.path("junk"))
    kvfs.stop()
    r = fsck_cli(kvfs.store, "--repair")  # everything reads again: the marks go
    assert "broken mark removed" in r.stdout and r.returncode == 0
    assert stubs.BROKEN not in os.listxattr(snaps / "flipped")


def test_mounted_store_is_checked_read_only(kvfs) -> None:
    write_in_pieces(kvfs.path("a"), rand_bytes(2 * MiB, 20), MiB)
    r = fsck_cli(kvfs.store, "--verify-data")
    assert r.returncode == 0, r.stdout
    assert "(mounted: read-only check; the daemon's reference counts compared for 1 snapshots)" in summary(r)
    r = fsck_cli(kvfs.store, "--repair")
    assert r.returncode == 2 and "unmount it to repair" in r.stderr


def test_a_stale_daemon_catalog_is_a_problem(kvfs) -> None:
    """GC without a walk trusts the daemon's reference counts: fsck compares them with the stubs. A
    stub rewritten in place behind the daemon's back (its directory's mtime unchanged) is missed
    by the catalog, and fsck says so."""
    write_in_pieces(kvfs.path("a"), rand_bytes(2 * MiB, 22), MiB)
    write_in_pieces(kvfs.path("b"), rand_bytes(3 * MiB, 23), MiB)
    snaps = kvfs.store / "snapshots"
    assert fsck_cli(kvfs.store).returncode == 0
    mtime = os.stat(snaps).st_mtime_ns
    with open(snaps / "a", "r+b") as f:  # b's index in a's file: a valid stub naming b's chunks
        f.write((snaps / "b").read_bytes())
    assert os.stat(snaps).st_mtime_ns == mtime
    r = fsck_cli(kvfs.store)
    assert r.returncode == 1
    assert "the daemon's catalog row of a" in r.stdout and "remount to rebuild it" in r.stdout


def test_progress_bar_only_on_a_terminal(kvfs) -> None:
    write_in_pieces(kvfs.path("a"), rand_bytes(2 * MiB, 21), MiB)
    kvfs.stop()
    plain = fsck_cli(kvfs.store, "--verify-data")
    assert "\r" not in plain.stderr and "verify" not in plain.stderr
    primary, secondary = pty.openpty()
    try:
        r = fsck_cli(kvfs.store, "--verify-data", stderr=secondary)
        os.close(secondary)
        out = b""
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # EIO once the terminal's other side is closed
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(primary)
    assert r.returncode == 0
    assert b"verify" in out and b"100.0%" in out and b"\r" in out
