"""A store or a whole-file directory that runs out of room, through a real mount.

A save whose close returned is kept, or it was refused with an errno: on a store's disk that fills
up, saves are refused (at the open once the store is known full), never acknowledged and dropped
by ingestion; a burst of saves into a small whole-file directory waits at the open for ingestion
to make room instead of failing; a sparse snapshot opened for a rewrite is copied as its data,
not its holes. The reboot stands in as in test_staged.py: the memory tier emptied, a new boot id.
Both modes (``make served`` runs them again with passthrough off).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Mount, remove_whole_files
from helpers import rand_bytes, wait_for_log
from test_gc import gc_now

MiB = 1 << 20


def _mount_fs(point: Path, image: Path | None, size_mib: int) -> None:
    point.mkdir(parents=True, exist_ok=True)
    if image is None:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(point)], check=True)
        return
    subprocess.run(["truncate", "-s", f"{size_mib}M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(point)], check=True)
    os.chmod(point, 0o700)


@pytest.fixture
def small_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Mount]:
    """A store on a 48 MiB ext4 file system of its own (a loop device), with a boot id file."""
    disk = tmp_path / "disk"
    _mount_fs(disk, tmp_path / "disk.img", 48)
    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    monkeypatch.setenv("KVCFS_BOOT_ID_FILE", str(boot))
    m = Mount(disk / "store", tmp_path / "mnt", tmp_path / "daemon.log")
    try:
        m.start_settled()
        yield m
    finally:
        m.stop()
        remove_whole_files(m.whole)
        subprocess.run(["umount", "-l", str(disk)], check=False)


def small_room(tmp_path: Path, size_mib: int) -> Path:
    """A whole-file directory on a tmpfs of ``size_mib`` (the daemon's own tmpfs takes its size)."""
    room = tmp_path / "room"
    _mount_fs(room, None, size_mib)
    return room / "whole"


def reboot(m: Mount, tmp_path: Path) -> None:
    """A reboot after a clean stop: the memory tier emptied, a new boot id."""
    m.stop()
    remove_whole_files(m.whole)
    (tmp_path / "boot_id").write_text("boot-2\n")
    m.start_settled()


def save(path: Path, data: bytes) -> str | None:
    """Write a save as cp does; None if every call succeeded, else which call failed and how."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
        return f"open: {errno.errorcode[e.errno]}"
    try:
        for i in range(0, len(data), MiB):
            os.write(fd, data[i : i + MiB])
    except OSError as e:
        with contextlib.suppress(OSError):  # as cp: the write's error is the one reported
            os.close(fd)
        return f"write: {errno.errorcode[e.errno]}"
    try:
        os.close(fd)
    except OSError as e:
        return f"close: {errno.errorcode[e.errno]}"
    return None


def fill_disk(filler: Path) -> None:
    """Fill the file system of ``filler`` to its last byte (another program's file)."""
    with open(filler, "ab") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\1" * MiB)
            f.flush()


def health(m: Mount) -> dict:
    transport = httpx.HTTPTransport(uds=str(m.store / "api.sock"))
    with httpx.Client(transport=transport, base_url="http://kvcfs", timeout=30) as c:
        return c.get("/health").json()


def test_a_full_store_keeps_every_acknowledged_save(small_store: Mount, tmp_path: Path) -> None:
    m = small_store
    saves = {f"r{i}": rand_bytes(20 * MiB, 40 + i) for i in range(4)}
    outcome = {name: save(m.path(name), data) for name, data in saves.items()}
    kept = [name for name, failed in outcome.items() if failed is None]
    assert len(kept) < len(saves), f"48 MiB cannot hold four 20 MB saves, yet all were acknowledged: {outcome}"
    assert outcome["r3"] == "open: ENOSPC", f"once the store is known full, a save is refused at its open: {outcome}"
    assert "refused" in m.log()
    gc_now(m)
    reboot(m, tmp_path)
    for name in kept:
        assert m.path(name).read_bytes() == saves[name], f"{name} was acknowledged ({outcome})"
    assert "was lost" not in m.log()


def test_a_store_that_cannot_take_a_save_says_so_and_retries(
    small_store: Mount, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ingestion failing (the disk filled behind the daemon's back) is a degraded store: said by
    /health and the metrics, new saves refused at the open, the save retried until it is stored."""
    m = small_store
    flag = tmp_path / "hold"
    m.stop()
    monkeypatch.setenv("KVCFS_INGEST_HOLD", str(flag))
    m.start_settled()
    flag.touch()
    data = rand_bytes(12 * MiB, 7)
    assert save(m.path("a"), data) is None
    filler = m.store.parent / "filler"
    fill_disk(filler)
    flag.unlink()
    wait_for_log(m, "storing the save of a failed", 1)
    h = health(m)
    assert h["status"] == "degraded" and h["unstored_saves"] == 1 and h["unstored_bytes"] == len(data), h
    st = m.stats()
    assert st["ingest_degraded"] == 1 and st["unstored_bytes"] == len(data)
    assert save(m.path("b"), b"x" * MiB) == "open: ENOSPC"
    gc_now(m)  # GC on the full disk takes nothing the staged save needs
    assert m.path("a").read_bytes() == data, "the staged copy stays the snapshot"
    filler.unlink()
    m.ingested(timeout=120)
    assert health(m)["status"] == "ok"
    assert save(m.path("b"), b"y" * MiB) is None
    reboot(m, tmp_path)
    assert m.path("a").read_bytes() == data


def test_a_stop_names_what_stays_only_in_memory(
    small_store: Mount, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = small_store
    flag = tmp_path / "hold"
    m.stop()
    monkeypatch.setenv("KVCFS_INGEST_HOLD", str(flag))
    m.start_settled(["--stop-timeout", "2"])
    flag.touch()
    assert save(m.path("kept-in-memory"), rand_bytes(20 * MiB, 8)) is None
    fill_disk(m.store.parent / "filler")  # before ingestion stores it
    flag.unlink()
    wait_for_log(m, "storing the save of kept-in-memory failed", 1, timeout=60)
    assert m.signal_stop() == 0
    lines = m.log().splitlines()
    assert any("ERROR" in x and "1 saves (20.0 MiB) are not stored" in x and "a reboot" in x for x in lines)
    assert any("WARNING" in x and "only in memory" in x and "kept-in-memory" in x for x in lines)


def _a_save_waits(log: str) -> bool:
    return "waits: the whole-file directory lacks" in log or "behind: the close of" in log


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_burst_into_a_small_room_waits_instead_of_failing(
    kvfs: Mount, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parallel: int
) -> None:
    """8 saves of 40 MiB into 256 MiB, ingestion held until a save waits (for room, or for ingestion):
    nothing fails."""
    hold = tmp_path / "hold"
    monkeypatch.setenv("KVCFS_INGEST_HOLD", str(hold))
    kvfs.stop()
    remove_whole_files(kvfs.whole)
    kvfs.whole = small_room(tmp_path, 256)
    kvfs.start_settled()
    hold.touch()
    try:
        saves = {f"b{i}": rand_bytes(40 * MiB, 60 + i) for i in range(8)}
        names = list(saves)
        errors: dict[str, str | None] = {}

        def run(part: list[str]) -> None:
            for name in part:
                errors[name] = save(kvfs.path(name), saves[name])

        threads = [threading.Thread(target=run, args=(names[i::parallel],)) for i in range(parallel)]
        for t in threads:
            t.start()
        # Until a save waits: at its open for room, or (a slow machine: ingestion held for seconds) at
        # its close for ingestion to catch up.
        while not _a_save_waits(kvfs.log()) and any(t.is_alive() for t in threads):
            time.sleep(0.05)
        hold.unlink()  # ingestion makes room now
        for t in threads:
            t.join()
        assert all(e is None for e in errors.values()), errors
        kvfs.ingested(timeout=180)
        for name, data in saves.items():
            assert kvfs.path(name).read_bytes() == data, name
        st = kvfs.stats()
        assert st["room_waits"] + st["ingest_waits"] > 0, "a save waited instead of failing"
    finally:
        hold.unlink(missing_ok=True)
        kvfs.stop()
        remove_whole_files(kvfs.whole)
        subprocess.run(["umount", "-l", str(kvfs.whole.parent)], check=False)


def test_a_sparse_rewrite_copies_data_not_holes(kvfs: Mount, tmp_path: Path) -> None:
    kvfs.stop()
    remove_whole_files(kvfs.whole)
    kvfs.whole = small_room(tmp_path, 512)
    kvfs.start_settled()
    size, at = 2 << 30, 1 << 30
    try:
        with open(kvfs.path("sparse"), "wb") as f:
            f.truncate(size)
            f.seek(at)
            f.write(b"8 bytes!")
        kvfs.ingested(timeout=300)
        fd = os.open(kvfs.path("sparse"), os.O_RDWR)
        try:
            os.pwrite(fd, b"B", at + 1)
        finally:
            os.close(fd)
        sv = os.statvfs(kvfs.whole)
        used = (sv.f_blocks - sv.f_bfree) * sv.f_frsize
        assert used < 64 * MiB, f"the rewrite's copy holds zeros: {used >> 20} MiB of the room used"
        kvfs.ingested(timeout=300)
        with open(kvfs.path("sparse"), "rb") as f:
            assert os.fstat(f.fileno()).st_size == size
            f.seek(at - 4)
            assert f.read(16) == b"\0" * 4 + b"8Bbytes!" + b"\0" * 4
            f.seek(0)
            zeros = b"\0" * (8 * MiB)
            for pos in range(0, size, 8 * MiB):
                piece = f.read(8 * MiB)
                if pos != at - at % (8 * MiB):
                    assert piece == zeros, pos
    finally:
        kvfs.stop()
        remove_whole_files(kvfs.whole)
        subprocess.run(["umount", "-l", str(kvfs.whole.parent)], check=False)


def test_a_save_whose_write_failed_for_room_is_not_committed(kvfs: Mount, tmp_path: Path) -> None:
    kvfs.stop()
    remove_whole_files(kvfs.whole)
    kvfs.whole = small_room(tmp_path, 64)
    kvfs.start_settled()
    try:
        old = rand_bytes(MiB, 80)
        assert save(kvfs.path("s"), old) is None
        kvfs.ingested()
        staged = kvfs.stats()["staged_saves"]
        outcome = save(kvfs.path("s"), rand_bytes(100 * MiB, 81))
        assert outcome is not None and outcome.endswith("ENOSPC"), outcome
        st = kvfs.stats()
        assert st["staged_saves"] == staged and st["ingest_queue"] == 0, "the torn save was not handed to ingestion"
        assert kvfs.path("s").read_bytes() == old, "the previous version stays"
        kvfs.remount()
        assert kvfs.path("s").read_bytes() == old
    finally:
        kvfs.stop()
        remove_whole_files(kvfs.whole)
        subprocess.run(["umount", "-l", str(kvfs.whole.parent)], check=False)


def test_a_save_held_open_by_a_child_counts_against_the_room(small_store: Mount, tmp_path: Path) -> None:
    """A save whose close returned while a child still holds its file description (its storing
    waits for the child's exit) takes its room from that close on: a save after it that the disk
    cannot hold too is refused, never acknowledged and then failed by ingestion."""
    m = small_store
    first, second = rand_bytes(20 * MiB, 90), rand_bytes(20 * MiB, 91)
    fd = os.open(m.path("r0"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for i in range(0, len(first), MiB):
        os.write(fd, first[i : i + MiB])
    child = subprocess.Popen(["sleep", "600"], pass_fds=[fd])  # inherits the writer's file description
    try:
        os.close(fd)  # the writer's close: r0 is acknowledged
        outcome = save(m.path("r1"), second)
    finally:
        child.kill()
        child.wait()
    # The child's exit releases r0's file description: every acknowledged save is stored, or ingestion
    # fails (the store degraded) on one of them.
    while m.stats()["ingest_queue"] and not m.stats()["ingest_degraded"]:
        time.sleep(0.05)
    st = m.stats()
    assert not st["ingest_degraded"], (
        f"r1 ({outcome}) and r0 were acknowledged, one could not be stored: {m.log()[-2000:]}"
    )
    assert outcome is not None and outcome.endswith("ENOSPC"), outcome
    assert "was lost" not in m.log()
    reboot(m, tmp_path)
    assert m.path("r0").read_bytes() == first, "r0 was acknowledged"
