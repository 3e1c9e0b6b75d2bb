"""Index objects carry the snapshot's file record, and are fetched a piece at a time: real SeaweedFS,
real mounts (the fixtures of test_remote.py)."""

from __future__ import annotations

import base64
import errno
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import test_remote
from helpers import read_direct, write_in_pieces
from seaweed import BUCKET, Weed
from test_remote import Hosts, MiB, drained, read_visible, state_file, wait_for

from kvchunkfs.format import filerecord
from kvchunkfs.format import index as idx
from kvchunkfs.store import stubs
from kvchunkfs.store.remote import RemoteTier
from kvchunkfs.store.remoteindex import MAX_META_RECORD, record_meta, record_of
from kvchunkfs.store.repository import Repository, StoreSettings
from kvchunkfs.store.s3 import Bucket

weed, hosts = test_remote.weed, test_remote.hosts  # the fixtures: one SeaweedFS for this module too
pytestmark = test_remote.pytestmark


def _record(m_store: Path, name: str) -> bytes | None:
    return stubs.read_record(m_store / "snapshots" / name)


def _meta_parts(meta: str) -> tuple[str, str, bytes]:
    version, binding, coded = meta.split(".")
    return version, binding, base64.urlsafe_b64decode(coded + "=" * (-len(coded) % 4))


def test_a_snapshot_saved_on_a_restores_on_a_new_host_with_its_file_record(hosts: Hosts) -> None:
    a = hosts.new("a")
    data = state_file(51)
    write_in_pieces(a.path("state"), data, MiB)
    drained(a)
    mine = _record(a.store, "state")
    assert mine is not None and filerecord.decode(mine, len(data)).form is filerecord.Form.LISTED
    obj = hosts.bucket.read_index("state")
    assert obj.record is not None and _meta_parts(obj.record)[2] == mine  # put with the index
    b = hosts.new("b")  # a new host: nothing local
    assert read_visible(b, "state") == data
    assert _record(b.store, "state") == mine  # installed with the fetched stub
    assert b.stats()["checksum_mismatches"] == 0
    b.remount()
    assert read_direct(b.path("state")) == data and _record(b.store, "state") == mine


def test_a_tampered_record_in_the_bucket_fails_the_restore_with_eio(hosts: Hosts) -> None:
    """The record's file checksum changed in the bucket: host B's restore checks the bytes it puts
    back against it and answers EIO, never bytes the record does not describe."""
    a = hosts.new("a")
    data = state_file(52)
    write_in_pieces(a.path("state"), data, MiB)
    drained(a)
    obj = hosts.bucket.read_index("state")
    assert obj.record is not None
    version, binding, record = _meta_parts(obj.record)
    bad = bytearray(record)
    bad[2] ^= 0x01  # the first byte of file_sum
    coded = base64.urlsafe_b64encode(bytes(bad)).rstrip(b"=").decode()
    hosts.bucket.put_index("state", obj.data, obj.stream or "", f"{version}.{binding}.{coded}")
    b = hosts.new("b")
    wait_for(lambda: os.path.exists(b.path("state")), "state to appear on B")
    assert _record(b.store, "state") == bytes(bad)
    with pytest.raises(OSError) as e:
        read_direct(b.path("state"))
    assert e.value.errno == errno.EIO
    assert b.stats()["checksum_mismatches"] >= 1


def test_an_old_index_object_and_a_record_of_another_index_restore_without_a_record(hosts: Hosts) -> None:
    """An index object written before records travelled (no ``kvcfs-file``) reads as before; one
    whose record names another index (copied beside another version) is fetched without it, and
    says so in the log; a record that travels with its own index is installed."""
    a = hosts.new("a")
    data, other = state_file(53), state_file(54)
    write_in_pieces(a.path("state"), data, MiB)
    write_in_pieces(a.path("other"), other, MiB)
    drained(a)
    obj, obj_other = hosts.bucket.read_index("state"), hosts.bucket.read_index("other")
    assert obj.record is not None and obj_other.record is not None
    hosts.bucket.put_index("old", obj.data, obj.stream or "")  # the old way: the index alone
    hosts.bucket.put_index("mixed", obj.data, obj.stream or "", obj_other.record)
    b = hosts.new("b")
    assert read_visible(b, "old") == data and _record(b.store, "old") is None
    assert read_visible(b, "mixed") == data and _record(b.store, "mixed") is None
    assert "mixed in" in b.log() and "its file record is not used (the record names another index)" in b.log()
    assert read_visible(b, "other") == other and _record(b.store, "other") == _record(a.store, "other")
    assert b.stats()["checksum_mismatches"] == 0


def test_a_record_too_large_for_metadata_travels_as_its_file_checksum() -> None:
    """S3 allows 2 KiB of metadata: a LISTED record past it goes up as PARSED (its file checksum);
    a record of an unknown version or another index is not used."""
    from kvchunkfs.format.llama_state import Group

    groups, start = [], 0
    while True:
        seg = filerecord.group_segment(start, Group(1, 8, 4096, 2, 3000))
        groups.append(filerecord.Listed(seg, bytes(8)))
        assert seg.end is not None
        start = seg.end + 1000
        rec = filerecord.FileRecord(filerecord.Form.LISTED, bytes(range(16)), tuple(groups))
        if len(rec.encode()) > MAX_META_RECORD:
            break
    size, index_data = start, b"an index"
    sha = __import__("hashlib").sha256(index_data).digest()
    meta = record_meta(index_data, rec.encode(), size)
    assert len(meta) + len("kvcfs-file") + len("kvcfs-format") + len("relayout/1024") <= 2048
    got, why = record_of(meta, sha, size)
    assert why is None and got is not None
    assert filerecord.decode(got, size) == filerecord.FileRecord(filerecord.Form.PARSED, bytes(range(16)))
    small = filerecord.FileRecord(filerecord.Form.PLAIN, bytes(16)).encode()
    assert record_of(record_meta(index_data, small, size), sha, size) == (small, None)
    assert record_of("2" + record_meta(index_data, small, size)[1:], sha, size)[0] is None
    assert record_of(record_meta(b"another", small, size), sha, size)[0] is None
    assert record_of(None, sha, size) == (None, None)


def test_fetching_an_index_of_a_million_chunks_costs_under_64_mib(tmp_path: Path, weed: Weed) -> None:
    """The read-through's fetch of an index object (what ``ls`` of a bucket-only snapshot does)
    never holds the 40 MB index whole: Python's allocations stay under 64 MiB (tracemalloc)."""
    n = 1_000_000
    table = np.zeros(n, dtype=[("end", "<u8"), ("id", "V32")])
    table["end"] = np.arange(1, n + 1, dtype=np.uint64) * 65536
    table["id"] = np.frombuffer(np.random.default_rng(7).bytes(32 * n), "V32")
    data = idx.encode(idx.Index._shared((16 << 10, 64 << 10, 256 << 10), table.tobytes(), 0, n))
    del table
    url = f"s3://{BUCKET}/million"
    bucket = Bucket(url, weed.endpoint, client=weed.client())
    bucket.put_index("big", data, "plain")
    want = len(data)
    del data
    repo = Repository(tmp_path / "store", StoreSettings(chunker="cdc"))
    tier = RemoteTier(repo, Bucket(url, weed.endpoint, client=weed.client()), max_file_size=1 << 46)
    try:
        tracemalloc.start()
        try:
            assert tier._materialize("big")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        tier.close()
        repo.close()
    stub = tmp_path / "store" / "snapshots" / "big"
    assert stub.stat().st_size == want and stubs.stub_size(stub) == n * 65536
    print(f"fetching an index of {n} chunks ({want / MiB:.0f} MiB): tracemalloc peak {peak / MiB:.1f} MiB")
    assert peak < 64 * MiB, f"fetching the index took {peak / MiB:.0f} MiB"
