"""Staged saves and the hot tier of whole copies, through a real mount.

A save is written into a plain staged file (passed through where the kernel can), its close names
that file on the stub, and ingestion stores it as chunks behind the close; a restore reads a whole
copy. These tests hold ingestion back where they need a crash to fall before it
(``KVCFS_INGEST_HOLD``), and stand in for a reboot with another boot id (``KVCFS_BOOT_ID_FILE``).
They run in both modes: ``make served`` runs them again with passthrough off.
"""

from __future__ import annotations

import errno
import os
import pwd
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Mount, remove_whole_files
from helpers import rand_bytes, wait_for_log, write_in_pieces
from test_faults import chunk_location, pack_path
from test_gc import gc_now

from e2e import ggsq
from kvchunkfs.store import stubs

MiB = 1 << 20


@pytest.fixture
def hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """While this file exists, the daemons started in the test store no staged save."""
    flag = tmp_path / "hold-ingestion"
    monkeypatch.setenv("KVCFS_INGEST_HOLD", str(flag))
    yield flag
    flag.unlink(missing_ok=True)


def stub(m: Mount, name: str) -> Path:
    return m.store / "snapshots" / name


def staged_files(m: Mount) -> list[str]:
    return sorted(os.listdir(m.whole / "staged"))


def test_a_save_is_stored_behind_its_close(kvfs: Mount) -> None:
    data = rand_bytes(24 * MiB + 5, 1)
    write_in_pieces(kvfs.path("s"), data, MiB)
    assert kvfs.path("s").read_bytes() == data
    kvfs.ingested()
    st = kvfs.stats()
    if st["fuse_passthrough"]:
        assert st["write_requests"] == 0, "the kernel wrote the save into its staged file"
    assert st["staged_saves"] == 1 and st["saves"] == 1
    assert stubs.read_staged(stub(kvfs, "s")) is None
    assert stubs.read_index(stub(kvfs, "s")).size == len(data)
    assert st["bytes_written"] == len(data), "its chunks were stored once"
    assert st["hot_files"] == 1 and st["hot_bytes"] == len(data)
    assert staged_files(kvfs) == []
    assert "saved s: 24.0 MiB" in kvfs.log()


def test_a_kill_after_the_close_loses_nothing(hold: Path, kvfs: Mount) -> None:
    old, new = rand_bytes(6 * MiB, 2), rand_bytes(9 * MiB + 7, 3)
    kvfs.path("s").write_bytes(old)
    kvfs.ingested()
    hold.touch()
    write_in_pieces(kvfs.path("s.tmp"), new, MiB)
    os.rename(kvfs.path("s.tmp"), kvfs.path("s"))  # the proxy's save
    staged = stubs.read_staged(stub(kvfs, "s"))
    assert staged is not None and staged.size == len(new), "the close named its staged file on the stub"
    kvfs.kill()
    kvfs.start_settled()
    assert kvfs.path("s").read_bytes() == new  # its staged file, before ingestion
    assert not kvfs.path("s.tmp").exists()
    hold.unlink()
    kvfs.ingested()
    assert stubs.read_staged(stub(kvfs, "s")) is None, "the next mount stored it"
    assert stubs.read_index(stub(kvfs, "s")).size == len(new)
    assert "1 saves staged before the last stop are being stored" in kvfs.log()
    kvfs.remount(["--hot-tier-size", "0"])
    assert kvfs.path("s").read_bytes() == new  # from its chunks


def test_a_reboot_keeps_the_previous_version(hold: Path, kvfs: Mount, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Staged files are not trusted after a reboot (not fsynced: torn bytes): the name reads the
    version its stub holds, whole."""
    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    monkeypatch.setenv("KVCFS_BOOT_ID_FILE", str(boot))
    kvfs.remount()
    old, new = rand_bytes(5 * MiB, 4), rand_bytes(7 * MiB, 5)
    kvfs.path("s").write_bytes(old)
    kvfs.ingested()
    hold.touch()
    kvfs.path("s").write_bytes(new)
    kvfs.kill()
    boot.write_text("boot-2\n")
    hold.unlink()
    kvfs.start_settled()
    assert kvfs.path("s").read_bytes() == old
    assert "the save of s was lost (another boot)" in kvfs.log()
    assert stubs.read_staged(stub(kvfs, "s")) is None
    assert staged_files(kvfs) == []
    assert kvfs.stats()["hot_put_backs"] == 1, "no whole copy from another boot is served: put back anew"


def test_restores_read_the_hot_copy_after_a_restart(kvfs: Mount) -> None:
    data = rand_bytes(16 * MiB, 6)
    write_in_pieces(kvfs.path("s"), data, MiB)
    kvfs.ingested()
    kvfs.remount()
    kvfs.catalog_loaded()
    subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
    before = kvfs.stats()
    assert kvfs.path("s").read_bytes() == data
    after = kvfs.stats()
    assert after["hot_hits"] - before["hot_hits"] == 1
    assert after["chunks_read"] == before["chunks_read"], "no chunk read: a plain read of its copy"
    wait_for_log(kvfs, "from a hot copy", 1)


def test_without_a_copy_a_restore_puts_one_back(kvfs: Mount) -> None:
    data = rand_bytes(12 * MiB, 7)
    write_in_pieces(kvfs.path("s"), data, MiB)
    kvfs.ingested()
    kvfs.stop()
    for f in (kvfs.whole / "hot").iterdir():  # as after a reboot
        f.unlink()
    kvfs.start_settled()
    assert kvfs.path("s").read_bytes() == data
    st = kvfs.stats()
    assert st["hot_put_backs"] == 1 and st["hot_misses"] == 1 and st["hot_files"] == 1
    before = st["chunks_read"]
    assert kvfs.path("s").read_bytes() == data
    assert kvfs.stats()["chunks_read"] == before


def test_a_put_back_keeps_no_chunk_in_memory_and_a_bad_chunk_leaves_no_copy(kvfs: Mount) -> None:
    """A state file (chunker relayout: groups of several MiB stored token-major) put back from its
    chunks: byte-exact, written straight to its whole copy (the chunk cache keeps none of it, so
    memory does not grow with the file). With a chunk damaged on disk the open fails with EIO, a log
    line names the chunk, and neither a part file nor a hot copy is left."""
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(2000, seed=9), ggsq.Spec(n_layer=12, row_bytes=512))
    write_in_pieces(kvfs.path("s"), data, MiB)
    kvfs.ingested()
    kvfs.stop()
    hot = kvfs.whole / "hot"
    for f in hot.iterdir():  # as after a reboot
        f.unlink()
    kvfs.start_settled(["--hot-tier-size", "0"])
    kvfs.catalog_loaded()  # it reads the first chunks of every snapshot
    before = kvfs.stats()
    assert kvfs.path("s").read_bytes() == data
    after = kvfs.stats()
    assert after["hot_put_backs"] - before["hot_put_backs"] == 1
    assert after["chunks_read"] > before["chunks_read"]
    assert not list(hot.iterdir()), "hot_tier_size 0: no copy outlives the restore"

    kvfs.stop()
    index = stubs.read_index(stub(kvfs, "s"))
    victim = index.ids[len(index) // 2]  # inside a group
    pack, off, length = chunk_location(kvfs.store, victim)
    with open(pack_path(kvfs.store, pack), "r+b") as f:
        f.seek(off + length // 3)
        byte = f.read(1)
        f.seek(off + length // 3)
        f.write(bytes([byte[0] ^ 0x5A]))
    kvfs.start_settled()  # the hot tier on: a copy put back would be kept
    with pytest.raises(OSError) as e:
        kvfs.path("s").read_bytes()
    assert e.value.errno == errno.EIO
    assert not list(hot.iterdir()), "no part file and no hot copy of a put-back that failed"
    assert victim.hex() in kvfs.log() and "fails its checksum" in kvfs.log()


def test_the_hot_tier_keeps_its_budget(kvfs: Mount) -> None:
    kvfs.remount(["--hot-tier-size", "10MiB"])
    files = {f"f{i}": rand_bytes(4 * MiB, 10 + i) for i in range(4)}
    for name, data in files.items():
        kvfs.path(name).write_bytes(data)
        kvfs.ingested()
    st = kvfs.stats()
    assert st["hot_bytes"] <= 10 * MiB and st["hot_files"] == 2 and st["hot_evictions"] == 2
    for name, data in files.items():
        assert kvfs.path(name).read_bytes() == data


def test_a_close_waits_when_ingestion_falls_behind(hold: Path, kvfs: Mount) -> None:
    kvfs.remount(["--ingest-backlog", "1MiB"])
    hold.touch()
    kvfs.path("a").write_bytes(rand_bytes(2 * MiB, 20))  # queued: now beyond the bound
    data = rand_bytes(2 * MiB, 21)
    done = threading.Event()

    def save() -> None:
        kvfs.path("b").write_bytes(data)
        done.set()

    t = threading.Thread(target=save)
    t.start()
    try:
        assert not done.wait(1.0), "the close waits for ingestion to catch up"
    finally:
        hold.unlink()
        t.join(timeout=60)
    assert done.is_set()
    kvfs.ingested()
    assert kvfs.stats()["ingest_waits"] >= 1
    assert kvfs.path("b").read_bytes() == data


def test_gc_and_a_rewrite_during_ingestion(hold: Path, kvfs: Mount) -> None:
    """A save superseded before it is stored is dropped; GC meanwhile takes nothing a staged file,
    a queued save or an open file needs."""
    v1, v2 = rand_bytes(4 * MiB, 30), rand_bytes(4 * MiB, 31)
    hold.touch()
    kvfs.path("s").write_bytes(v1)
    kvfs.path("s").write_bytes(v2)
    gc_now(kvfs)
    assert kvfs.path("s").read_bytes() == v2
    hold.unlink()
    kvfs.ingested()
    assert kvfs.path("s").read_bytes() == v2
    assert staged_files(kvfs) == []
    kvfs.remount(["--hot-tier-size", "0"])
    assert kvfs.path("s").read_bytes() == v2


def test_metadata_set_before_ingestion_is_kept(hold: Path, kvfs: Mount) -> None:
    hold.touch()
    kvfs.path("s").write_bytes(b"x" * 100_000)
    os.chmod(kvfs.path("s"), 0o600)
    os.setxattr(kvfs.path("s"), "user.kvcfs.label.model", b"tiny")
    os.utime(kvfs.path("s"), (1_700_000_000, 1_700_000_000))
    hold.unlink()
    kvfs.ingested()
    st = kvfs.path("s").stat()
    assert (st.st_mode & 0o777, int(st.st_mtime)) == (0o600, 1_700_000_000)
    assert os.getxattr(kvfs.path("s"), "user.kvcfs.label.model") == b"tiny"
    assert stubs.read_staged(stub(kvfs, "s")) is None


def test_whole_files_are_private(hold: Path, kvfs: Mount) -> None:
    hold.touch()
    kvfs.path("s").write_bytes(rand_bytes(MiB, 40))
    for d in (kvfs.whole, kvfs.whole / "staged", kvfs.whole / "hot"):
        assert d.stat().st_mode & 0o777 == 0o700
    (name,) = staged_files(kvfs)
    assert (kvfs.whole / "staged" / name).stat().st_mode & 0o777 == 0o600
    nobody = pwd.getpwnam("nobody")
    r = subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                        "cat", str(kvfs.whole / "staged" / name)], capture_output=True)  # fmt: skip
    assert r.returncode != 0 and b"Permission denied" in r.stderr
    hold.unlink()


def test_a_whole_files_dir_another_user_could_swap_is_refused(kvfs: Mount, tmp_path: Path) -> None:
    kvfs.stop()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    (shared / "someone's").write_bytes(b"x")  # an empty one of ours would be set to mode 0700
    with pytest.raises(RuntimeError, match="mode 0700"):
        kvfs.start(["--whole-files-dir", str(shared)])
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(RuntimeError, match="mode 0700"):
        kvfs.start(["--whole-files-dir", str(theirs)])


def test_a_reader_keeps_its_version_while_a_new_one_is_written(kvfs: Mount) -> None:
    """Served, a reader sees the truncate and the new bytes, as on a plain file. Passed through, the
    kernel takes one backing file per inode: the writer waits a moment for the reader (a writer's
    own release follows its close), then gets EBUSY; the reader reads its version to the end."""
    old, new = rand_bytes(3 * MiB, 50), rand_bytes(2 * MiB, 51)
    kvfs.path("s").write_bytes(old)
    kvfs.ingested()
    with open(kvfs.path("s"), "rb") as reader:
        head = reader.read(MiB)
        if kvfs.stats()["fuse_passthrough"]:
            with pytest.raises(OSError) as e:
                kvfs.path("s").write_bytes(new)
            assert e.value.errno == errno.EBUSY
            assert reader.read() == old[MiB:]
            new = old
        else:
            kvfs.path("s").write_bytes(new)
            assert reader.read() == new[MiB:]
    assert head == old[:MiB]
    assert kvfs.path("s").read_bytes() == new
    kvfs.ingested()
    kvfs.path("s").write_bytes(new)  # the reader is gone: no wait
    assert kvfs.path("s").read_bytes() == new


def test_saves_in_quick_succession_keep_the_last(kvfs: Mount, plain: Path) -> None:
    """Each reopen copies the save before it while that one is being stored: its install must not
    undo the newer save's name on the stub (their order on the node's lock). Seen wrong 5 times in
    60 before, as a lost rewrite."""
    script = [(126, 12728), (42861, 4308)]
    for it in range(40):
        name = f"q{it}"
        for d in (kvfs.mnt, plain):
            with open(d / name, "w+b"):
                pass
            for n, (off, size) in enumerate(script):
                with open(d / name, "r+b") as f:
                    f.seek(off)
                    f.write(rand_bytes(size, n))
                    f.write(rand_bytes(size, n + 10))
        assert kvfs.path(name).read_bytes() == (plain / name).read_bytes(), name
    kvfs.ingested()
    kvfs.remount(["--hot-tier-size", "0"])
    for it in range(40):
        assert kvfs.path(f"q{it}").read_bytes() == (plain / f"q{it}").read_bytes()


def test_an_append_right_after_a_save_continues_it(kvfs: Mount) -> None:
    """An open while the save before is being stored: ingestion replaces the stub and takes the
    staged file into the hot tier meanwhile. The open must find the save where it went (the new
    stub, its hot copy), never take it for a lost one."""
    for i in range(60):
        name = f"m{i}"
        first = rand_bytes(600_000 + i, i)
        kvfs.path(name).write_bytes(first)
        with open(kvfs.path(name), "ab") as f:
            f.write(b"end\n")
        assert kvfs.path(name).read_bytes() == first + b"end\n", name
    assert "is lost" not in kvfs.log()


def _own_mount(path: Path) -> str | None:
    """The super block options of ``path``'s own mount, or None if it is not a mount point."""
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == real:
                sep = fields.index("-")
                return f"{fields[sep + 1]} {fields[sep + 3]}"
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_whole_files_live_on_a_tmpfs_of_their_own_with_huge_pages(hold: Path, kvfs: Mount) -> None:
    own = _own_mount(kvfs.whole)
    assert own is not None and own.startswith("tmpfs "), own
    assert "huge=within_size" in own and "mode=700" in own, own
    data = rand_bytes(5 * MiB + 3, 40)
    hold.touch()
    kvfs.path("s").write_bytes(data)
    kvfs.kill()  # the mount outlives the daemon: the staged save is still there
    assert _own_mount(kvfs.whole) == own
    kvfs.start_settled()
    assert _own_mount(kvfs.whole) == own, "mounted once, not again over itself"
    assert kvfs.path("s").read_bytes() == data
    hold.unlink()
    kvfs.ingested()
    assert kvfs.path("s").read_bytes() == data


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_staged_save_is_never_hidden_under_a_new_mount(hold: Path, kvfs: Mount) -> None:
    """Saves staged with huge pages off, then a start with them on: the directory still holds a
    save not yet stored, so it is used as it is (a mount over it would hide the save)."""
    kvfs.stop()
    remove_whole_files(kvfs.whole)
    kvfs.start(["--no-whole-files-huge-pages"])
    assert _own_mount(kvfs.whole) is None
    data = rand_bytes(3 * MiB + 1, 41)
    hold.touch()
    kvfs.path("s").write_bytes(data)
    kvfs.kill()
    kvfs.start_settled([])
    assert _own_mount(kvfs.whole) is None, "not mounted over a staged save"
    assert "holds staged saves not yet stored" in kvfs.log()
    assert kvfs.path("s").read_bytes() == data
    hold.unlink()
    kvfs.ingested()
    kvfs.stop()
    kvfs.start([])  # nothing staged any more: now it is mounted
    assert _own_mount(kvfs.whole) is not None
    assert kvfs.path("s").read_bytes() == data
