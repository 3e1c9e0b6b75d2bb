"""The file record (format/filerecord.py): a save records where its groups are and the checksums
of its bytes, the stored form is checked to parse to those groups, and files of every shape the
parser accepts come back byte-exact through the cutter, relayout and the save path."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from ggsq_shapes import ISSUE_FILE, ggsq_files, tiny_ggsq_files
from helpers import save as save_content
from helpers import write_content
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvchunkfs.file.files import Files
from kvchunkfs.format import filerecord, relayout
from kvchunkfs.format import llama_state as ls
from kvchunkfs.format.cutter import GROUP_WIDTH, Cutter
from kvchunkfs.format.filerecord import FileRecord, Form, Listed
from kvchunkfs.store import stubs
from kvchunkfs.store.repository import Repository
from kvchunkfs.store.stubs import StubError

SIZES = (2048, 8192, 32768)  # small chunks: small files still make several


def stored_stream(c: Cutter, data: bytes) -> tuple[bytes, list[Listed]]:
    groups: list[Listed] = []
    chunks, _ = c.cut(c.initial(), data, final=True, groups=groups)
    return b"".join(bytes(x) for x in chunks), groups


def parsed(stream: bytes) -> list[ls.Segment]:
    return relayout.groups(lambda o, n: stream[o : o + n], len(stream), GROUP_WIDTH)


# -- the record's encoding -----------------------------------------------------------------------

shapes = st.builds(
    ls.Group,
    st.integers(1, 300),
    st.sampled_from([0, 8, 16]),
    st.integers(1, 1 << 20),
    st.just(0),
    st.integers(1, 1 << 17),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 30), shapes, st.binary(min_size=8, max_size=8)), max_size=40))
def test_records_round_trip(items):
    listed, pos = [], 0
    for gap, g, s in items:
        seg = filerecord.group_segment(pos + gap, g)
        listed.append(Listed(seg, s))
        assert seg.end is not None
        pos = seg.end
    rec = FileRecord(Form.LISTED, os.urandom(16), tuple(listed))
    assert filerecord.decode(rec.encode(), pos) == rec
    if listed:
        with pytest.raises(filerecord.RecordError):
            filerecord.decode(rec.encode(), pos - 1)  # the last group would pass the end
    for form in (Form.PLAIN, Form.PARSED, Form.FILE_ORDER):
        plain = FileRecord(form, b"\1" * 16)
        assert filerecord.decode(plain.encode(), 0) == plain


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80), st.integers(0, 1 << 40))
def test_garbage_is_never_a_record_by_accident_of_a_crash(data, size):
    try:
        rec = filerecord.decode(data, size)
    except filerecord.RecordError:
        return
    assert rec.encode() == data  # what decodes is exactly one record


def test_too_many_groups_are_not_listed():
    g = ls.Group(2, 0, 64, 0, 100)
    listed, pos = [], 0
    for _ in range(400):
        seg = filerecord.group_segment(pos, g)
        listed.append(Listed(seg, bytes(8)))
        assert seg.end is not None
        pos = seg.end
    assert filerecord.make(bytes(16), listed[:10], GROUP_WIDTH).form is Form.LISTED
    rec = filerecord.make(bytes(16), listed, GROUP_WIDTH)
    assert rec.form is Form.PARSED and len(rec.encode()) <= filerecord.MAX_BYTES


# -- the cutter and relayout -------------------------------------------------------------------


def test_the_reported_file_parses_otherwise_once_stored():
    """The file whose stored form parsed to no group: what the save must notice."""
    stream, groups = stored_stream(Cutter(*SIZES, "relayout"), ISSUE_FILE)
    assert [x.seg for x in groups] and not parsed(stream)
    assert relayout.file_bytes(stream, GROUP_WIDTH) != ISSUE_FILE  # put back as the stream parses: wrong
    assert relayout.file_bytes(stream, GROUP_WIDTH, [x.seg for x in groups]) == ISSUE_FILE


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ggsq_files(), st.lists(st.integers(1, 300), max_size=6))
def test_every_shape_round_trips_through_the_cutter_and_relayout(data, splits):
    c = Cutter(*SIZES, "relayout")
    stream, groups = stored_stream(c, data)
    assert len(stream) == len(data)
    segs = [x.seg for x in groups]
    assert relayout.file_bytes(stream, GROUP_WIDTH, segs) == data
    for x in groups:
        assert x.seg.end is not None and filerecord.group_sum(data[x.seg.start : x.seg.end]) == x.sum
    rec = filerecord.make(xxhash.xxh3_128_digest(data), groups, GROUP_WIDTH)
    assert filerecord.mismatch(relayout.file_pieces(lambda o, n: stream[o : o + n], len(stream), segs), rec) is None
    # Any split of the writes cuts and records alike.
    more: list[Listed] = []
    st_, pos, out = c.initial(), 0, []
    for n in [*splits, len(data)]:
        chunks, st_ = c.cut(st_, data[st_.pos : pos + n], final=False, groups=more)
        out += [bytes(x) for x in chunks]
        pos = min(len(data), pos + n)
    chunks, _ = c.cut(st_, data[st_.pos :], final=True, groups=more)
    assert b"".join([*out, *(bytes(x) for x in chunks)]) == stream and more == groups


# -- the save path, in process --------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Repository, Files]]:
    root = tmp_path_factory.mktemp("store")
    repo = Repository(root, None)
    files = Files(repo)
    try:
        yield repo, files
    finally:
        files.close()
        repo.close()


_names = itertools.count()


def save(repo: Repository, files: Files, data: bytes, pieces: list[int], name: str | None = None) -> str:
    """Write ``data`` as a new snapshot in pieces of those sizes; its name."""
    name = name or f"f{next(_names)}"
    repo.create(name, 0o644, 0, 0)
    content = files.replacement(name)
    try:
        pos = 0
        for n in [*pieces, len(data)]:
            write_content(content, pos, data[pos : pos + n])
            pos = min(len(data), pos + n)
        assert save_content(files, content, name)
    finally:
        content.close()
    return name


def read_back(files: Files, name: str, size: int) -> bytes:
    content = files.load(name)
    try:
        return bytes(content.read(0, size + 10, files.read_chunks))
    finally:
        content.close()


def record_of(repo: Repository, name: str, size: int) -> FileRecord:
    raw = stubs.read_record(repo.path(name))
    assert raw is not None
    return filerecord.decode(raw, size)


def stream_of(files: Files, repo: Repository, name: str) -> bytes:
    index = stubs.read_index(repo.path(name))
    return bytes(files.read_chunks(index, 0, index.size))


def test_the_reported_file_is_stored_in_file_order_and_reads_back(store):
    repo, files = store
    before = files.checks.file_order_saves
    name = save(repo, files, ISSUE_FILE, [])
    assert files.checks.file_order_saves == before + 1
    rec = record_of(repo, name, len(ISSUE_FILE))
    assert rec.form is Form.FILE_ORDER and rec.file_sum == xxhash.xxh3_128_digest(ISSUE_FILE)
    assert stream_of(files, repo, name) == ISSUE_FILE
    assert read_back(files, name, len(ISSUE_FILE)) == ISSUE_FILE


def check_save(repo: Repository, files: Files, data: bytes, pieces: list[int]) -> None:
    name = save(repo, files, data, pieces)
    assert read_back(files, name, len(data)) == data
    rec = record_of(repo, name, len(data))
    assert rec.file_sum == xxhash.xxh3_128_digest(data)
    stream = stream_of(files, repo, name)
    if rec.form is Form.LISTED:  # a reader without the record parses the same groups
        assert filerecord.same_groups(parsed(stream), rec.segments)
        for x in rec.groups:
            assert x.seg.end is not None and x.sum == filerecord.group_sum(data[x.seg.start : x.seg.end])
    else:
        assert rec.form in (Form.PLAIN, Form.FILE_ORDER) and stream == data
        assert rec.form is Form.FILE_ORDER or not parsed(stream)


_slow_ok = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@settings(max_examples=120, deadline=None, suppress_health_check=_slow_ok)
@given(ggsq_files(max_cells=40, max_row=300), st.lists(st.integers(1, 5000), max_size=4))
def test_every_shape_round_trips_through_a_save(store, data, pieces):
    check_save(*store, data, pieces)


@settings(max_examples=1000, deadline=None, suppress_health_check=_slow_ok)
@given(tiny_ggsq_files(), st.lists(st.integers(1, 40), max_size=3))
@example(ISSUE_FILE, [7])
def test_small_values_round_trip_through_a_save(store, data, pieces):
    """Files made of 0, 1 and 2, where about one in 150 stores a form that parses otherwise."""
    check_save(*store, data, pieces)


@settings(max_examples=40, deadline=None, suppress_health_check=_slow_ok)
@given(ggsq_files(max_cells=40, max_row=300), st.data())
def test_an_append_continues_the_record(store, data, draw):
    """A file saved, then appended to (llama-server's second pass): the record is the whole file's."""
    repo, files = store
    cut = draw.draw(st.integers(1, max(1, len(data))))
    first, rest = data[:cut], data[cut:]
    name = save(repo, files, first, [])
    content = files.load(name)
    try:
        write_content(content, len(first), rest)
        assert save_content(files, content, name)
    finally:
        content.close()
    assert read_back(files, name, len(data)) == data
    assert record_of(repo, name, len(data)).file_sum == xxhash.xxh3_128_digest(data)


def test_a_bad_record_fails_the_open(store):
    repo, files = store
    data = ISSUE_FILE * 3
    name = save(repo, files, data, [])
    os.setxattr(repo.path(name), stubs.RECORD, b"\x01\x07" + bytes(16))  # an unknown form
    with pytest.raises(StubError):
        files.load(name).close()


@pytest.mark.parametrize("how", ["append", "rewrite"])
def test_a_file_put_back_whole_is_checked(store, how):
    """A write (past the end, or behind it) copies the file into a staging file: a file whose
    checksum does not match fails with EIO (counted), it never becomes the next version."""
    repo, files = store
    data = ISSUE_FILE * 2 if how == "append" else os.urandom(1 << 20)  # one chunk; many chunks
    name = save(repo, files, data, [])
    rec = record_of(repo, name, len(data))
    os.setxattr(repo.path(name), stubs.RECORD, FileRecord(rec.form, bytes(16), rec.groups).encode())
    before = files.checks.mismatches
    content = files.load(name)
    try:
        with pytest.raises(OSError) as e:
            write_content(content, 3, b"x")
        assert e.value.errno == 5
    finally:
        content.close()
    assert files.checks.mismatches == before + 1
    assert not list(Path(repo.staging).iterdir())
    assert read_back(files, name, len(data)) == data  # the snapshot is unchanged


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 30),
    st.integers(1, 40),
    st.sampled_from([0, 8, 16]),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.booleans(),
)
def test_any_file_range_of_a_group_comes_from_its_records(count, cells, width, lead, a, b, trans):
    """What an append's parse reads inside a group: the bytes put back from just the records they
    lie in equal the group put back whole; a transposed group is put back whole."""
    el = 2 if trans else 0
    width += width % 2 if trans else 0
    g = ls.Group(count, lead, width, el, cells)
    seg = filerecord.group_segment(0, g)
    assert seg.end is not None
    data = os.urandom(seg.end)
    stream = bytes(relayout.to_stream(seg, data))
    off, end = sorted((a % (seg.end + 1), b % (seg.end + 1)))
    got = relayout.file_range(g, lambda o, n: stream[o : o + n], off, end - off)
    assert got is None if trans else got == data[off:end]
