"""Snapshot metadata xattrs on a real mount: use count, last use, created, labels, and their survival."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
from helpers import rand_bytes, wait_closed, write_in_pieces

from kvchunkfs.store import stubs

MiB = 1 << 20
LABEL = stubs.LABEL_PREFIX + "model"


def xattr(path: Path, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name)
    except OSError as e:
        assert e.errno == errno.ENODATA, e
        return None


def meta(path: Path) -> dict[str, bytes | None]:
    names = (stubs.CREATED, stubs.USE_COUNT, stubs.LAST_USE)
    out: dict[str, bytes | None] = {name: xattr(path, name) for name in names}
    out.update({n: os.getxattr(path, n) for n in os.listxattr(path) if n.startswith(stubs.LABEL_PREFIX)})
    return out


def use_count(path: Path) -> int:
    value = xattr(path, stubs.USE_COUNT)
    return int(value) if value is not None else 0


def test_created_use_count_and_last_use(kvfs) -> None:
    p = kvfs.path("s")
    t0 = time.time()
    write_in_pieces(p, rand_bytes(3 * MiB, 1), MiB)
    created = float(os.getxattr(p, stubs.CREATED))
    assert t0 - 1 <= created <= time.time()
    assert xattr(p, stubs.USE_COUNT) is None and xattr(p, stubs.LAST_USE) is None, "a save is not a use"
    assert {stubs.CREATED} <= set(os.listxattr(p))
    p.stat()
    os.listdir(kvfs.mnt)
    assert use_count(p) == 0, "stat and readdir are not uses"
    t1 = time.time()
    p.read_bytes()
    assert use_count(p) == 1
    first_use = float(os.getxattr(p, stubs.LAST_USE))
    assert t1 - 1 <= first_use <= time.time()
    wait_closed(kvfs)  # an open while the content lingers would be part of the same restore
    time.sleep(0.05)
    with open(p, "rb"):
        pass  # an open for reading counts even without reading
    assert use_count(p) == 2
    assert float(os.getxattr(p, stubs.LAST_USE)) > first_use
    assert float(os.getxattr(p, stubs.CREATED)) == created, "use does not touch created"
    with open(p, "r+b") as f:
        f.read(10)
    with open(p, "ab") as f:
        f.write(b"more")
    assert use_count(p) == 2, "opens for writing are saves, not restores"


def test_reading_a_file_while_it_is_being_written_is_not_a_restore(kvfs) -> None:
    p = kvfs.path("w")
    with open(p, "wb") as w:
        w.write(rand_bytes(MiB, 2))
        w.flush()
        with open(p, "rb") as r:
            r.read(100)
        assert use_count(p) == 0, "the file is incomplete while a writer has it open"
    p.read_bytes()
    assert use_count(p) == 1, "once the writer is gone, a read-only open is a restore"


def test_managed_attributes_are_read_only_and_size_is_internal(kvfs) -> None:
    p = kvfs.path("m")
    write_in_pieces(p, rand_bytes(MiB + 5, 3), MiB)
    p.read_bytes()
    before = meta(p)
    for name in (stubs.CREATED, stubs.USE_COUNT, stubs.LAST_USE, stubs.SIZE, stubs.XATTR_PREFIX + "other",
                 stubs.LABEL_PREFIX):  # fmt: skip
        with pytest.raises(OSError) as e:
            os.setxattr(p, name, b"1")
        assert e.value.errno == errno.EPERM, name
    for name in (stubs.CREATED, stubs.USE_COUNT, stubs.SIZE):
        with pytest.raises(OSError) as e:
            os.removexattr(p, name)
        assert e.value.errno == errno.EPERM, name
    assert meta(p) == before
    # The real size: never listed, never readable, and st_size is still right.
    assert stubs.SIZE not in os.listxattr(p)
    with pytest.raises(OSError) as e:
        os.getxattr(p, stubs.SIZE)
    assert e.value.errno == errno.ENODATA
    assert p.stat().st_size == MiB + 5
    kvfs.ingested()  # the stub's own size is the stored save's, written by ingestion behind the close
    assert stubs.stub_size(kvfs.store / "snapshots" / "m") == MiB + 5


def test_labels_set_get_list_remove(kvfs) -> None:
    p = kvfs.path("l")
    p.write_bytes(b"x" * 1000)
    os.setxattr(p, LABEL, b"qwen2.5-7b")
    os.setxattr(p, stubs.LABEL_PREFIX + "conversation.id", "ünï".encode())
    assert os.getxattr(p, LABEL) == b"qwen2.5-7b"
    assert {LABEL, stubs.LABEL_PREFIX + "conversation.id"} <= set(os.listxattr(p))
    os.setxattr(p, LABEL, b"llama")  # relabel
    assert os.getxattr(p, LABEL) == b"llama"
    os.removexattr(p, LABEL)
    assert LABEL not in os.listxattr(p)
    # Stored on the stub, so they survive a remount.
    kvfs.remount()
    assert os.getxattr(p, stubs.LABEL_PREFIX + "conversation.id") == "ünï".encode()


def test_o_trunc_rewrite_keeps_created_uses_and_labels(kvfs) -> None:
    p = kvfs.path("r")
    write_in_pieces(p, rand_bytes(4 * MiB, 4), MiB)
    os.setxattr(p, LABEL, b"qwen")
    p.read_bytes()
    wait_closed(kvfs)  # the next read is another restore, not the same one's second open
    p.read_bytes()
    before = meta(p)
    assert int(before[stubs.USE_COUNT] or 0) == 2 and before[LABEL] == b"qwen"
    time.sleep(0.05)
    new = rand_bytes(2 * MiB + 1, 5)
    write_in_pieces(p, new, MiB)  # "wb": O_TRUNC overwrite
    assert meta(p) == before
    kvfs.remount()
    assert meta(p) == before
    assert p.read_bytes() == new
    assert use_count(p) == 3


def test_tmp_renamed_over_name_keeps_the_names_metadata(kvfs) -> None:
    name, tmp = kvfs.path("NAME"), kvfs.path("NAME.tmp")
    write_in_pieces(name, rand_bytes(3 * MiB, 6), MiB)
    os.setxattr(name, LABEL, b"qwen")
    os.setxattr(name, stubs.LABEL_PREFIX + "owner", b"ann")
    name.read_bytes()
    before = meta(name)
    time.sleep(0.05)
    new = rand_bytes(3 * MiB + 100, 7)
    write_in_pieces(tmp, new, MiB)
    os.setxattr(tmp, stubs.LABEL_PREFIX + "owner", b"bob")  # a label set on the new file wins
    os.setxattr(tmp, stubs.LABEL_PREFIX + "turn", b"2")
    assert float(os.getxattr(tmp, stubs.CREATED)) > float(before[stubs.CREATED] or 0)
    os.rename(tmp, name)
    after = meta(name)
    assert after[stubs.CREATED] == before[stubs.CREATED]
    assert after[stubs.USE_COUNT] == before[stubs.USE_COUNT] == b"1"
    assert after[stubs.LAST_USE] == before[stubs.LAST_USE]
    assert after[LABEL] == b"qwen"
    assert after[stubs.LABEL_PREFIX + "owner"] == b"bob"
    assert after[stubs.LABEL_PREFIX + "turn"] == b"2"
    kvfs.remount()
    assert meta(name) == after
    assert name.read_bytes() == new


def test_rename_while_the_tmp_file_is_still_being_written(kvfs) -> None:
    name, tmp = kvfs.path("N"), kvfs.path("N.tmp")
    write_in_pieces(name, rand_bytes(2 * MiB, 8), MiB)
    os.setxattr(name, LABEL, b"qwen")
    name.read_bytes()
    before = meta(name)
    new = rand_bytes(3 * MiB, 9)
    with open(tmp, "wb") as f:
        f.write(new[:MiB])
        os.rename(tmp, name)
        f.write(new[MiB:])  # the save lands at NAME when the file is closed
    assert meta(name) == before
    kvfs.remount()
    assert meta(name) == before
    assert name.read_bytes() == new
