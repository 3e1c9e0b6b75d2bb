"""A name keeps a whole version across a reboot, whatever staged saves were renamed over it.

The design's reboot model (tests/test_staged.py): staged saves live in memory, so a reboot (here:
a kill -9, another boot id, the whole-file directory emptied) loses those not yet stored. Each name
must then read the version its last lost save replaced (the one stored before it), never an empty
file; a new name whose only save was lost is gone; and no chunk of a version kept for that is
collected meanwhile. Both modes: ``make served`` runs them again with passthrough off.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import Mount
from helpers import rand_bytes, write_in_pieces
from test_gc import gc_now

from kvchunkfs.store import stubs

MiB = 1 << 20


@pytest.fixture
def hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """While the file returned exists, the daemons started in the test store no staged save; they
    read their boot id from ``boot_id`` beside it (``boot``)."""
    monkeypatch.setenv("KVCFS_INGEST_HOLD", str(tmp_path / "hold-ingestion"))
    (tmp_path / "boot_id").write_text("boot-1\n")
    monkeypatch.setenv("KVCFS_BOOT_ID_FILE", str(tmp_path / "boot_id"))
    return tmp_path / "hold-ingestion"


@pytest.fixture
def boot(hold: Path) -> Path:
    return hold.parent / "boot_id"


def reboot(m: Mount, boot: Path, hold: Path) -> None:
    """A power cut without the disk's part: the daemon dies, the memory tier is wiped, a new boot."""
    m.kill()
    n = int(boot.read_text().strip().rsplit("-", 1)[1])
    boot.write_text(f"boot-{n + 1}\n")
    shutil.rmtree(m.whole / "staged", ignore_errors=True)
    hold.unlink(missing_ok=True)
    m.start_settled()


def test_a_rename_over_a_name_keeps_its_version_through_a_reboot(hold: Path, kvfs: Mount, boot: Path) -> None:
    """llama-server's save: NAME.tmp written and closed, renamed over NAME; a reboot before it was
    stored leaves NAME reading its stored version, also after GC ran in between (a checkpoint)."""
    kvfs.remount()
    names = [f"slot{i}" for i in range(4)]
    old = {n: rand_bytes(3 * MiB + i, 10 + i) for i, n in enumerate(names)}
    for n in names:
        write_in_pieces(kvfs.path(n), old[n], MiB)
    kvfs.ingested()
    hold.touch()
    for i, n in enumerate(names):
        write_in_pieces(kvfs.path(n + ".tmp"), rand_bytes(2 * MiB + i, 20 + i), MiB)
        os.rename(kvfs.path(n + ".tmp"), kvfs.path(n))
    gc_now(kvfs)  # checkpoints first; the old versions' chunks are needed until the saves are stored
    reboot(kvfs, boot, hold)
    for n in names:
        assert kvfs.path(n).read_bytes() == old[n], f"{n} lost its stored version"
    assert sorted(p.name for p in kvfs.mnt.iterdir()) == names
    kvfs.ingested()
    gc_now(kvfs)
    kvfs.remount(["--hot-tier-size", "0"])
    for n in names:
        assert kvfs.path(n).read_bytes() == old[n], f"{n}: its chunks were collected"
    assert not list((kvfs.store / "prev").iterdir()), "the kept versions are dropped once not needed"


def test_a_lost_first_save_leaves_no_empty_file(hold: Path, kvfs: Mount, boot: Path) -> None:
    """A new name whose only save was lost with the reboot is gone, not an empty snapshot: a save
    written in place and one renamed to a new name."""
    kvfs.remount()
    hold.touch()
    write_in_pieces(kvfs.path("new"), rand_bytes(MiB, 30), MiB)
    write_in_pieces(kvfs.path("other.tmp"), rand_bytes(MiB, 31), MiB)
    os.rename(kvfs.path("other.tmp"), kvfs.path("other"))
    reboot(kvfs, boot, hold)
    assert sorted(p.name for p in kvfs.mnt.iterdir()) == []
    assert "the first save of new was lost" in kvfs.log()


def test_a_save_renamed_after_it_was_stored_keeps_it(hold: Path, kvfs: Mount, boot: Path) -> None:
    """The kept versions are no fallback once the save is stored: a reboot after ingestion keeps the
    new version (a staged save again over it is lost and falls back to it)."""
    kvfs.remount()
    old, new, newer = rand_bytes(MiB, 40), rand_bytes(MiB + 3, 41), rand_bytes(MiB + 5, 42)
    kvfs.path("s").write_bytes(old)
    write_in_pieces(kvfs.path("s.tmp"), new, MiB)
    os.rename(kvfs.path("s.tmp"), kvfs.path("s"))
    kvfs.ingested()
    hold.touch()
    kvfs.path("s").write_bytes(newer)
    reboot(kvfs, boot, hold)
    assert kvfs.path("s").read_bytes() == new


def test_a_client_fsync_keeps_the_save_through_a_reboot(hold: Path, kvfs: Mount, boot: Path) -> None:
    """NAME.tmp written, fsync()ed, closed, renamed over NAME and the directory fsynced: NAME reads
    the new version after a reboot, stored or not."""
    kvfs.remount()
    old, new = rand_bytes(2 * MiB, 50), rand_bytes(3 * MiB + 1, 51)
    kvfs.path("s").write_bytes(old)
    kvfs.ingested()
    hold.touch()
    before = kvfs.stats()["staged_saves"]
    fd = os.open(kvfs.path("s.tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, new)
        os.fsync(fd)
    finally:
        os.close(fd)
    # Its close stores nothing again: a stub installed by ingestion would not be durable.
    assert kvfs.stats()["staged_saves"] == before
    os.rename(kvfs.path("s.tmp"), kvfs.path("s"))
    dfd = os.open(kvfs.mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    gc_now(kvfs)
    reboot(kvfs, boot, hold)
    assert kvfs.path("s").read_bytes() == new
    assert stubs.read_staged(kvfs.store / "snapshots" / "s") is None
