"""Core behaviour on a real FUSE mount, driven with ordinary file calls."""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import stat

import pytest
from helpers import rand_bytes, read_direct, unique_chunk_bytes, write_in_pieces
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchunkfs.store import stubs

MiB = 1 << 20
_counter = itertools.count()


def test_streaming_save_read_during_after_and_remount(kvfs):
    data = rand_bytes(64 * MiB + 12345, 1)
    path = kvfs.path("snap.bin")
    with open(path, "wb") as f:
        for i, piece in enumerate(range(0, len(data), 999_983)):
            f.write(data[piece : piece + 999_983])
            if i == 50:
                f.flush()
                written = piece + 999_983
                # Written into its staged file: readable at once, chunked only after the close.
                assert read_direct(path)[:written] == data[:written]
                assert kvfs.stats()["chunks_written"] == 0
                assert not any((kvfs.store / "staging").iterdir()), "sequential save must not stage"
    assert path.stat().st_size == len(data)
    assert path.read_bytes() == data
    assert read_direct(path) == data
    kvfs.ingested()
    assert kvfs.stats()["chunks_written"] > 0
    kvfs.remount()
    assert path.read_bytes() == data
    assert stubs.stub_size(kvfs.store / "snapshots" / "snap.bin") == len(data)
    assert "staging a copy" not in kvfs.log()


@pytest.mark.parametrize("piece", [1, 4096, 65536 + 7, 3 * MiB])
def test_write_sizes(kvfs, piece):
    data = rand_bytes(3 * MiB + 77 if piece > 1 else 300_000, piece)
    write_in_pieces(kvfs.path("f"), data, piece)
    kvfs.remount()
    assert kvfs.path("f").read_bytes() == data


def test_append_continues_chunk_list(kvfs, plain):
    """An append right after the save (llama-server's second pass) reads back only the last chunk:
    the file's checksum continues from where the save left it. After a restart the daemon has no
    such mark: the append reads the file back once, and checks it whole."""
    first, second, third = rand_bytes(20 * MiB + 999, 2), rand_bytes(3 * MiB + 5, 3), rand_bytes(MiB + 7, 4)
    for d in (kvfs.mnt, plain):
        write_in_pieces(d / "s", first, MiB)
    kvfs.catalog_loaded()
    before = kvfs.stats()
    for d in (kvfs.mnt, plain):
        write_in_pieces(d / "s", second, 1 << 17, mode="ab")
    after = kvfs.stats()
    # Only the last chunk (at most chunk_max = 256 KiB) may be read back to continue.
    assert after["pack_bytes_read"] - before["pack_bytes_read"] <= 256 * 1024
    kvfs.remount()  # cold: nothing of the file in any cache, no mark of its checksum
    kvfs.catalog_loaded()
    before = kvfs.stats()
    for d in (kvfs.mnt, plain):
        write_in_pieces(d / "s", third, 1 << 17, mode="ab")
    after = kvfs.stats()
    assert after["pack_bytes_read"] - before["pack_bytes_read"] <= len(first + second) + 256 * 1024
    assert "staging a copy" not in kvfs.log()
    kvfs.remount()
    assert (kvfs.mnt / "s").read_bytes() == (plain / "s").read_bytes() == first + second + third


def test_append_chunking_equals_whole_file_chunking(kvfs):
    a, b = rand_bytes(9 * MiB + 3, 4), rand_bytes(5 * MiB + 11, 5)
    write_in_pieces(kvfs.path("x"), a, MiB)
    write_in_pieces(kvfs.path("x"), b, MiB, mode="ab")
    write_in_pieces(kvfs.path("y"), a + b, MiB)
    kvfs.ingested()  # the stubs are replaced once the saves are stored
    sx = stubs.read_index(kvfs.store / "snapshots" / "x")
    sy = stubs.read_index(kvfs.store / "snapshots" / "y")
    assert sx.ids == sy.ids and sx.ends == sy.ends


def test_rewrite_with_o_trunc_shorter(kvfs):
    long, short = rand_bytes(12 * MiB, 6), rand_bytes(5 * MiB + 1, 7)
    write_in_pieces(kvfs.path("r"), long, MiB)
    write_in_pieces(kvfs.path("r"), short, MiB)  # "wb" = O_TRUNC
    assert kvfs.path("r").stat().st_size == len(short)
    assert kvfs.path("r").read_bytes() == short
    kvfs.remount()
    assert kvfs.path("r").stat().st_size == len(short)
    assert kvfs.path("r").read_bytes() == short


def test_truncate_variants(kvfs, plain):
    base = rand_bytes(6 * MiB + 100, 8)

    def both(fn):
        for d in (kvfs.mnt, plain):
            fn(d)

    both(lambda d: write_in_pieces(d / "t", base, MiB))
    both(lambda d: os.truncate(d / "t", 0))  # no handle, to zero
    assert (kvfs.mnt / "t").read_bytes() == b""
    both(lambda d: write_in_pieces(d / "t", base, MiB))
    both(lambda d: os.truncate(d / "t", 2 * MiB + 3))  # no handle, shrink
    assert (kvfs.mnt / "t").read_bytes() == (plain / "t").read_bytes() == base[: 2 * MiB + 3]
    both(lambda d: os.truncate(d / "t", 3 * MiB))  # no handle, grow: zeros
    for d in (kvfs.mnt, plain):
        with open(d / "t", "r+b") as f:
            f.write(b"abc")
            os.ftruncate(f.fileno(), 0)  # with a handle, to zero
            f.seek(0)
            f.write(b"hello world")
        with open(d / "t", "r+b") as f:
            os.ftruncate(f.fileno(), 5)  # with a handle, non-zero
    assert (kvfs.mnt / "t").read_bytes() == (plain / "t").read_bytes() == b"hello"
    kvfs.remount()
    assert (kvfs.mnt / "t").read_bytes() == b"hello"


def test_out_of_order_writes_use_staging(kvfs, plain):
    data = rand_bytes(5 * MiB, 9)
    for d in (kvfs.mnt, plain):
        with open(d / "o", "wb") as f:
            f.write(data)
            f.seek(MiB)
            f.write(b"X" * 1000)
            f.seek(8 * MiB)  # a hole
            f.write(b"tail")
    kvfs.remount()
    assert (kvfs.mnt / "o").read_bytes() == (plain / "o").read_bytes()
    assert not any((kvfs.store / "staging").iterdir()), "staging copy removed after close"


def test_rename_over_existing_and_while_open(kvfs):
    old, new = rand_bytes(3 * MiB, 10), rand_bytes(4 * MiB, 11)
    write_in_pieces(kvfs.path("NAME"), old, MiB)
    write_in_pieces(kvfs.path("NAME.tmp"), new, MiB)
    os.rename(kvfs.path("NAME.tmp"), kvfs.path("NAME"))
    assert kvfs.path("NAME").read_bytes() == new
    assert not kvfs.path("NAME.tmp").exists()
    # Rename while the source is still being written: the save lands at the new name.
    with open(kvfs.path("w.tmp"), "wb") as f:
        f.write(old[:MiB])
        os.rename(kvfs.path("w.tmp"), kvfs.path("w"))
        f.write(old[MiB:])
    assert sorted(os.listdir(kvfs.mnt)) == ["NAME", "w"]
    kvfs.remount()
    assert kvfs.path("NAME").read_bytes() == new
    assert kvfs.path("w").read_bytes() == old


def test_unlink_while_open_keeps_handle_working(kvfs):
    data = rand_bytes(4 * MiB, 12)
    write_in_pieces(kvfs.path("u"), data, MiB)
    kvfs.remount()
    with open(kvfs.path("u"), "rb") as f:
        os.unlink(kvfs.path("u"))
        assert not kvfs.path("u").exists()
        assert f.read() == data
    with open(kvfs.path("v"), "wb") as f:
        f.write(data[:MiB])
        os.unlink(kvfs.path("v"))
        f.write(data[MiB:])
        f.flush()
        assert os.fstat(f.fileno()).st_size == len(data)
    assert os.listdir(kvfs.mnt) == []
    assert list((kvfs.store / "snapshots").iterdir()) == []


def test_metadata_operations(kvfs):
    p = kvfs.path("m")
    p.write_bytes(b"x" * 1000)
    os.utime(p, (1_000_000, 2_000_000))
    assert p.stat().st_mtime == 2_000_000
    os.chmod(p, 0o600)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert p.stat().st_size == 1000
    os.mkdir(kvfs.path("d"))
    (kvfs.path("d") / "inner").write_bytes(b"abc")
    assert sorted(os.listdir(kvfs.mnt)) == ["d", "m"]
    with pytest.raises(OSError) as e:
        os.rmdir(kvfs.path("d"))
    assert e.value.errno == errno.ENOTEMPTY
    os.rename(kvfs.path("d"), kvfs.path("d2"))
    assert (kvfs.path("d2") / "inner").read_bytes() == b"abc"
    os.unlink(kvfs.path("d2") / "inner")
    os.rmdir(kvfs.path("d2"))
    sv = os.statvfs(kvfs.mnt)
    assert sv.f_blocks > 0 and sv.f_bsize > 0
    os.setxattr(p, "user.note", b"hi")
    assert os.getxattr(p, "user.note") == b"hi"
    assert "user.note" in os.listxattr(p)
    assert stubs.SIZE not in os.listxattr(p)
    with pytest.raises(OSError) as e:
        os.setxattr(p, stubs.SIZE, b"1")
    assert e.value.errno == errno.EPERM
    os.removexattr(p, "user.note")
    assert "user.note" not in os.listxattr(p)
    # A rewrite keeps user metadata and mode.
    os.setxattr(p, "user.kvcfs.label.model", b"tiny")
    p.write_bytes(b"y" * 10)
    assert os.getxattr(p, "user.kvcfs.label.model") == b"tiny"
    assert stat.S_IMODE(p.stat().st_mode) == 0o600


def test_sequential_restore_reads_each_chunk_once(kvfs):
    data = rand_bytes(40 * MiB, 13)
    data = data[: 20 * MiB] + data[: 10 * MiB] + data[30 * MiB :]  # repeated chunks inside the file
    write_in_pieces(kvfs.path("big"), data, MiB)
    kvfs.ingested()
    n_unique, unique_bytes = unique_chunk_bytes(kvfs.store / "snapshots" / "big")
    kvfs.remount(["--hot-tier-size", "0"])  # read from the chunks, not from a whole copy
    kvfs.catalog_loaded()  # its load reads each snapshot's first chunk
    before = kvfs.stats()
    with open(kvfs.path("big"), "rb") as f:
        got = b"".join(iter(lambda: f.read(MiB), b""))
    after = kvfs.stats()
    assert got == data
    assert after["chunks_read"] - before["chunks_read"] == n_unique
    assert after["pack_bytes_read"] - before["pack_bytes_read"] == unique_bytes
    assert after["pack_reads"] - before["pack_reads"] < n_unique / 4, "contiguous chunks read in large runs"


def test_random_reads(kvfs):
    data = rand_bytes(16 * MiB, 14)
    write_in_pieces(kvfs.path("r"), data, MiB)
    kvfs.remount()
    rnd = __import__("random").Random(5)
    fd = os.open(kvfs.path("r"), os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 64 * 1024)
    try:
        for _ in range(50):
            off = rnd.randrange(0, len(data) // 4096) * 4096
            n = os.preadv(fd, [buf], off)
            assert buf[:n] == data[off : off + n]
    finally:
        os.close(fd)
        buf.close()


def test_page_cache_kept_across_opens(kvfs):
    data = rand_bytes(8 * MiB, 15)
    write_in_pieces(kvfs.path("c"), data, MiB)
    kvfs.remount()
    kvfs.catalog_loaded()
    assert kvfs.path("c").read_bytes() == data
    before = kvfs.stats()
    assert kvfs.path("c").read_bytes() == data
    assert kvfs.stats()["pack_bytes_read"] == before["pack_bytes_read"]
    assert kvfs.stats()["chunks_read"] == before["chunks_read"], "second open served by the kernel page cache"


def test_dedup_next_turn_and_shared_prefix(kvfs):
    prefix = rand_bytes(16 * MiB, 16)
    turn1 = prefix + rand_bytes(MiB, 17)
    turn2 = turn1 + rand_bytes(MiB // 2, 18)
    write_in_pieces(kvfs.path("conv1"), turn1, MiB)
    kvfs.ingested()
    b0 = kvfs.stats()["bytes_written"]
    write_in_pieces(kvfs.path("conv1.tmp"), turn2, MiB)
    os.rename(kvfs.path("conv1.tmp"), kvfs.path("conv1"))
    kvfs.ingested()
    new = kvfs.stats()["bytes_written"] - b0
    assert new < 1.5 * MiB, f"turn 2 stored {new} new bytes for 0.5 MiB of new data"
    b1 = kvfs.stats()["bytes_written"]
    write_in_pieces(kvfs.path("conv2"), prefix + rand_bytes(2 * MiB, 19), MiB)
    kvfs.ingested()
    new2 = kvfs.stats()["bytes_written"] - b1
    assert new2 < 2.5 * MiB, "the shared prefix is stored once"
    kvfs.remount()
    assert kvfs.path("conv1").read_bytes() == turn2


def test_corrupt_stub_fails_with_eio_and_others_survive(kvfs):
    good = rand_bytes(2 * MiB, 20)
    write_in_pieces(kvfs.path("good"), good, MiB)
    write_in_pieces(kvfs.path("bad"), good, MiB)
    kvfs.ingested()
    (kvfs.store / "snapshots" / "bad").write_bytes(b"this is not an index")
    with pytest.raises(OSError) as e:
        kvfs.path("bad").read_bytes()
    assert e.value.errno == errno.EIO
    assert "bad" in kvfs.log() and "cannot open snapshot" in kvfs.log()
    assert kvfs.path("good").read_bytes() == good
    # Overwriting a broken snapshot is allowed and repairs it.
    kvfs.path("bad").write_bytes(b"fresh")
    assert kvfs.path("bad").read_bytes() == b"fresh"


def test_missing_chunk_fails_with_eio(kvfs):
    import sqlite3

    data = rand_bytes(3 * MiB, 21)
    other = rand_bytes(2 * MiB, 22)
    write_in_pieces(kvfs.path("a"), data, MiB)
    write_in_pieces(kvfs.path("b"), other, MiB)
    kvfs.ingested()
    victim = stubs.read_index(kvfs.store / "snapshots" / "a").ids[5]
    kvfs.stop()
    db = sqlite3.connect(kvfs.store / "chunks.db")
    pack, off = db.execute("SELECT pack, offset FROM chunks WHERE id = ?", (victim,)).fetchone()
    db.execute("DELETE FROM chunks WHERE id = ?", (victim,))
    db.commit()
    db.close()
    with open(kvfs.store / "packs" / f"{pack:08d}.pack", "r+b") as f:  # else recovery re-maps it from the pack
        byte = f.read(off + 1)[-1]
        f.seek(off)
        f.write(bytes([byte ^ 1]))
    kvfs.start(["--hot-tier-size", "0"])  # a whole copy would still hold the right bytes
    with pytest.raises(OSError) as e:
        kvfs.path("a").read_bytes()
    assert e.value.errno == errno.EIO
    assert victim.hex() in kvfs.log()
    assert kvfs.path("b").read_bytes() == other


_fs_ops = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 3 * MiB), st.integers(1, 300_000)),
        st.tuples(st.just("append"), st.integers(1, 700_000)),
        st.tuples(st.just("truncate"), st.integers(0, 3 * MiB)),
        st.tuples(st.just("reopen")),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=_fs_ops)
def test_random_operations_match_plain_file(kvfs, plain, script):
    """Seeks, holes, overwrites and truncates through the mount equal the same calls on ext4."""
    name = f"h{next(_counter)}"
    files = [open(d / name, "w+b") for d in (kvfs.mnt, plain)]  # noqa: SIM115
    try:
        for n, op in enumerate(script):
            for i, d in enumerate((kvfs.mnt, plain)):
                f = files[i]
                if op[0] == "write":
                    f.seek(op[1])
                    f.write(rand_bytes(op[2], n))
                elif op[0] == "append":
                    f.seek(0, os.SEEK_END)
                    f.write(rand_bytes(op[1], n))
                elif op[0] == "truncate":
                    f.flush()
                    os.ftruncate(f.fileno(), op[1])
                else:
                    f.close()
                    files[i] = open(d / name, "r+b")  # noqa: SIM115
    finally:
        for f in files:
            f.close()
    assert (kvfs.mnt / name).read_bytes() == (plain / name).read_bytes()
    assert read_direct(kvfs.mnt / name) == (plain / name).read_bytes()
