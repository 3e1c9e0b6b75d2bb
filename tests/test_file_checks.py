"""Through a real mount: files whose stored form would parse otherwise read back unchanged, files of
every shape the parser accepts round trip, and a stored form whose chunks all verify but put back a
different file is refused with EIO, a log line and a count, and reported by fsck --verify-data."""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SRC
from ggsq_shapes import ISSUE_FILE, ggsq_files
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from e2e import ggsq
from kvchunkfs.format import index as idx
from kvchunkfs.store import stubs

MiB = 1 << 20


def fsck(store: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    cmd = [sys.executable, "-m", "kvchunkfs.cli", "fsck", "--store", str(store), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def write(path: Path, data: bytes, piece: int = MiB) -> None:
    with open(path, "wb") as f:
        for i in range(0, len(data), piece):
            f.write(data[i : i + piece])


def read(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        out = bytearray()
        while piece := f.read(MiB):
            out += piece
        return bytes(out)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def test_the_reported_file_reads_back_unchanged(kvfs):
    """The 132-byte ggsq v4 file whose stored form parsed to no group: it reads back as written,
    before and after a remount, and fsck --verify-data checks it whole."""
    name = kvfs.path("s")
    write(name, ISSUE_FILE)
    drop_caches()
    assert read(name) == ISSUE_FILE
    kvfs.remount()
    drop_caches()
    assert read(name) == ISSUE_FILE
    assert kvfs.stats()["checksum_mismatches"] == 0
    kvfs.stop()
    r = fsck(kvfs.store, "--verify-data")
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 problems" in r.stdout and "1 files checked whole" in r.stdout, r.stdout


_names = itertools.count()


@settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(st.lists(ggsq_files(max_cells=300, max_row=600), min_size=8, max_size=8))
@example([ISSUE_FILE, ISSUE_FILE[:-1], ISSUE_FILE + b"tail"])
def test_every_shape_round_trips_through_a_mount(kvfs, datas):
    """A few files of every shape the parser accepts, written through the mount in odd pieces,
    read back at once and after a remount."""
    names = []
    for data in datas:
        names.append(kvfs.path(f"f{next(_names)}"))
        write(names[-1], data, piece=4093)
    for name, data in zip(names, datas, strict=True):
        assert read(name) == data
    kvfs.remount()
    for name, data in zip(names, datas, strict=True):
        assert read(name) == data
    assert kvfs.stats()["checksum_mismatches"] == 0


def _reorder(stub: Path, lo: int, hi: int) -> None:
    """Rotate the chunks of the stub's index that lie in bytes ``[lo, hi)`` by one: every chunk
    is still one the store has, with its id and length, but the stream is another one."""
    index = stubs.read_index(stub)
    first, last = index.find(lo), index.find(hi - 1)
    assert last - first >= 2 and index.start(first) >= lo and index.ends[last] <= hi
    lengths = [index.length(i) for i in range(first, last + 1)]
    ids = index.ids[first : last + 1]
    lengths, ids = lengths[1:] + lengths[:1], ids[1:] + ids[:1]
    pos = index.start(first)
    for k, (n, cid) in enumerate(zip(lengths, ids, strict=True)):
        pos += n
        index.ends[first + k], index.ids[first + k] = pos, cid
    with open(stub, "r+b") as f:  # in place: the stub keeps its xattrs (size, record)
        f.write(idx.encode(index))


def test_a_stored_form_whose_chunks_all_verify_but_put_back_another_file_is_refused(kvfs):
    """The chunks of a stored group in another order: each chunk verifies (its id, its length,
    its quick sum), the group puts back as bytes of the right length, and they are not the file.
    The read fails with EIO (never those bytes), the daemon logs it and counts it, and fsck
    --verify-data reports the snapshot."""
    from kvchunkfs.format import filerecord

    spec = ggsq.Spec(n_layer=6, row_bytes=512)
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(1500, 5), spec)
    write(kvfs.path("s"), data)
    write(kvfs.path("ok"), data[:-1])
    kvfs.stop()
    stub = Path(kvfs.store) / "snapshots" / "s"
    raw = stubs.read_record(stub)
    assert raw is not None
    rec = filerecord.decode(raw, len(data))
    assert rec.form is filerecord.Form.LISTED and rec.groups
    g = rec.groups[0].seg
    assert g.end is not None
    _reorder(stub, g.start, g.end)
    kvfs.start(["--hot-tier-size", "0"])  # no hot copy of s: its open puts it back from the chunks
    drop_caches()
    with pytest.raises(OSError) as e:
        read(kvfs.path("s"))
    assert e.value.errno == errno.EIO
    assert read(kvfs.path("ok")) == data[:-1]  # a snapshot sharing most chunks reads fine
    assert kvfs.stats()["checksum_mismatches"] >= 1
    # A put-back of the whole file checks the file checksum over what it wrote (its pieces arrive
    # in any order); a read served from the chunks checks each group as it decodes it.
    log = kvfs.log()
    assert (f"s: the stored group at bytes {g.start}-{g.end}: checksum mismatch" in log
            or "s: the whole file put back for a restore: checksum mismatch" in log), log[-2000:]  # fmt: skip
    kvfs.stop()
    r = fsck(kvfs.store, "--verify-data")
    assert r.returncode == 1, r.stdout
    assert f"snapshot s: the stored group at bytes {g.start}-{g.end} does not have its checksum" in r.stdout, r.stdout
    assert "1 broken snapshots" in r.stdout and "snapshot ok" not in r.stdout


def test_chunks_reordered_outside_groups_are_reported_by_fsck(kvfs):
    """Outside groups the chunks are served as the index orders them (each chunk checked); a wrong
    order there is what the file checksum catches: fsck --verify-data reports it."""
    data = os.urandom(3 * MiB)  # no state file: no group, plain chunks
    write(kvfs.path("p"), data)
    kvfs.stop()
    stub = Path(kvfs.store) / "snapshots" / "p"
    _reorder(stub, 0, len(data))
    r = fsck(kvfs.store, "--verify-data")
    assert r.returncode == 1, r.stdout
    assert "snapshot p: the file's bytes do not have its checksum" in r.stdout, r.stdout
