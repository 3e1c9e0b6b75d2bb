"""Chunker ``relayout``: K/V blocks stored token-major. The stored stream is a permutation of the
file; the groups a save stored (its file record's), or for the files below the groups the stream
parses to, put it back exactly (tests/test_file_record.py: files whose stream parses otherwise)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_format_cutter import LAYOUTS, SIZES, conversation, new_bytes, stream

from e2e import ggsq
from kvchunkfs.format import llama_state as ls
from kvchunkfs.format import relayout
from kvchunkfs.format.cutter import GROUP_WIDTH, Cutter
from kvchunkfs.store import stubs

KiB = 1 << 10


def rl() -> Cutter:
    return Cutter(*SIZES, "relayout")


def back(chunks) -> bytes:
    return relayout.file_bytes(b"".join(bytes(x) for x in chunks), GROUP_WIDTH)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_round_trips_and_is_grouped(name):
    spec = LAYOUTS[name]
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(700, seed=3), spec)
    chunks = rl().cut_all(data)
    assert all(0 < len(x) <= SIZES[2] for x in chunks)
    stored = b"".join(bytes(x) for x in chunks)
    assert len(stored) == len(data)
    assert relayout.file_bytes(stored, GROUP_WIDTH) == data
    segs = ls.segments(data, GROUP_WIDTH)
    assert segs[-1] == ls.Segment(len(data), None)  # nothing left to the fallback
    groups = [s for s in segs if s.group]
    assert relayout.groups(lambda o, n: stored[o : o + n], len(stored), GROUP_WIDTH) == groups
    if spec.row_bytes * spec.n_layer <= GROUP_WIDTH:  # one group for all K, one for all V
        assert sum(1 for g in groups if g.group.count == spec.n_layer) >= 2
    if spec.v_trans:
        assert any(g.group.el for g in groups)
    if groups:
        assert stored != data


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 40),
    st.sampled_from([1, 2, 3, 4, 8]),
    st.integers(0, 20),
    st.integers(0, 16),
    st.booleans(),
    st.integers(0, 2**32),
)
def test_to_stream_and_back(count, cells, el, runs, lead, trans, seed):
    width = el * max(1, runs)
    g = ls.Group(count, lead, width, el if trans else 0, cells)
    size = lead + count * (12 + cells * width)
    seg = ls.Segment(100, 100 + size, 100 + lead + 12 * count, count * width, 0, 0, g)
    src = np.random.default_rng(seed).integers(0, 256, size, np.uint8).tobytes()
    out = relayout.to_stream(seg, src)
    assert sorted(out) == sorted(src) and relayout.to_file(seg, out) == src
    # record p holds cell p's row of every block
    heads = lead + 12 * count
    if not trans:
        for i in range(count):
            block = lead + i * (12 + cells * width) + 12
            p = seed % cells
            assert (
                out[heads + p * count * width + i * width : heads + p * count * width + (i + 1) * width]
                == src[block + p * width : block + (p + 1) * width]
            )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(LAYOUTS)), st.lists(st.integers(1, 300 * KiB), max_size=12), st.integers(1, 900))
def test_any_split_of_the_writes_gives_the_same_chunks(name, splits, n_tokens):
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(n_tokens, seed=n_tokens), LAYOUTS[name])
    c = rl()
    assert stream(c, data, [1, 3, 7, 12, *splits]) == [bytes(x) for x in c.cut_all(data)]


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10**9), st.integers(0, 40))
def test_truncated_and_damaged_files_round_trip(seed, n_flips):
    rng = random.Random(seed)
    spec = LAYOUTS[sorted(LAYOUTS)[seed % len(LAYOUTS)]]
    data = bytearray(ggsq.synthetic_bytes(ggsq.synthetic_tokens(rng.randrange(1, 300), seed=seed), spec))
    for _ in range(n_flips):
        i = min(len(data) - 1, int(rng.expovariate(1 / 3000)))
        data[i] = rng.randrange(256)
    data = bytes(data[: rng.randrange(0, len(data) + 1)] if rng.random() < 0.5 else data)
    c = rl()
    whole = [bytes(x) for x in c.cut_all(data)]
    assert all(0 < len(x) <= SIZES[2] for x in whole)
    assert back(whole) == data
    assert stream(c, data, [rng.randrange(1, 90 * KiB) for _ in range(5)]) == whole


def test_garbage_is_plain_cdc():
    data = random.Random(5).randbytes(900 * KiB)
    assert [bytes(x) for x in rl().cut_all(data)] == [bytes(x) for x in Cutter(*SIZES, "cdc").cut_all(data)]


def turn_ratios(kind: str, spec: ggsq.Spec, per_turn: int = 150) -> list[float]:
    c, seen, out = Cutter(*SIZES, kind), set(), []
    for i, toks in enumerate(conversation(spec, 5, per_turn=per_turn)):
        new = new_bytes(seen, c.cut_all(ggsq.synthetic_bytes(toks, spec)))
        if i:
            out.append(new / (per_turn * (spec.bytes_per_token + 16)))
    return out


@pytest.mark.parametrize("name", ["packed", "v_trans", "mrope_v4", "streams"])
def test_a_turn_stores_little_more_than_its_rows(name):
    """4 layers x 1 KiB rows: one group for K and one for V, so a turn re-stores two partial
    strides (and the small segments' last 4 KiB) instead of one per block."""
    spec = LAYOUTS[name]
    after, before = turn_ratios("relayout", spec), turn_ratios("format", spec)
    assert max(after) < 1.2, after
    assert sum(after) < sum(before), (after, before)


# -- through the mount (the default store is relayout) ---------------------------------------

MiB = 1 << 20


def _write(path, data: bytes, piece: int = MiB) -> None:
    with open(path, "wb") as f:
        for i in range(0, len(data), piece):
            f.write(data[i : i + piece])


def test_mount_reads_groups_back_at_any_offset_and_from_many_threads(kvfs):
    """Random preads, several threads at once (the kernel sends a group's reads in parallel: one
    decode serves them), of a transposed-V file and a plain one."""
    from concurrent.futures import ThreadPoolExecutor

    mnt = Path(kvfs.mnt)
    files = {
        "vt": ggsq.synthetic_bytes(ggsq.synthetic_tokens(1500, 21), ggsq.Spec(n_layer=6, row_bytes=512, v_trans=True)),
        "rows": ggsq.synthetic_bytes(ggsq.synthetic_tokens(1500, 22), ggsq.Spec(n_layer=12, row_bytes=512)),
    }
    for name, data in files.items():
        _write(mnt / name, data)
    for name, data in files.items():
        assert (Path(kvfs.store) / "snapshots" / name).stat().st_size < len(data) // 100  # a stub
        rng = random.Random(name)
        sizes = [1, 4096, 131072, 3 * MiB + 5]
        spans = [(rng.randrange(len(data)), rng.choice(sizes)) for _ in range(60)]

        def check(span, data=data, name=name):
            off, n = span
            fd = os.open(mnt / name, os.O_RDONLY)
            try:
                assert os.pread(fd, n, off) == data[off : off + n]
            finally:
                os.close(fd)

        with ThreadPoolExecutor(6) as pool:
            list(pool.map(check, spans))
        assert (mnt / name).read_bytes() == data


def test_mount_append_rewrite_and_truncate_inside_a_group(kvfs):
    """A second pass in append mode resumes at the last group's start; a write inside a group
    and a truncate into one stage the file: every byte reads back as a plain file would."""
    mnt = Path(kvfs.mnt)
    spec = ggsq.Spec(n_layer=8, row_bytes=512, v_trans=True)
    toks = ggsq.synthetic_tokens(1200, seed=23)
    first = ggsq.synthetic_bytes(toks, spec)
    second = ggsq.checkpoint_blob(toks, spec) + b"CKPT" + random.Random(3).randbytes(300 * KiB)
    _write(mnt / "a", first)
    with open(mnt / "a", "ab") as f:
        for i in range(0, len(second), 16 * KiB):
            f.write(second[i : i + 16 * KiB])
    model = bytearray(first + second)
    assert (mnt / "a").read_bytes() == model
    segs = [s for s in ls.segments(first, GROUP_WIDTH) if s.group]
    assert segs
    inside = (segs[0].start + segs[0].end) // 2
    with open(mnt / "a", "r+b") as f:
        f.seek(inside)
        f.write(b"\x01" * 5000)
    model[inside : inside + 5000] = b"\x01" * 5000
    assert (mnt / "a").read_bytes() == model
    os.truncate(mnt / "a", segs[-1].start + 777)
    del model[segs[-1].start + 777 :]
    assert (mnt / "a").read_bytes() == model
    kvfs.remount()
    assert (Path(kvfs.mnt) / "a").read_bytes() == model


def to_file_from(seg, pieces):
    """A group put back from its stored chunks in order (what a restore feeds ``Unpermute``);
    None if a piece past the headers is not whole records."""
    u = relayout.Unpermute(seg)
    if not u.feed(pieces) or not u.done:
        return None
    return u.data


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 5), st.integers(1, 60), st.sampled_from([0, 1, 2, 3, 4]), st.integers(1, 9), st.integers(0, 2**32)
)
def test_to_file_from_chunk_views_equals_to_file(count, cells, el, per, seed):
    """A restore puts a group back from its chunks' own buffers: the same bytes as from the joined
    stream, whatever whole-record pieces it comes in; pieces that split a record are refused."""
    width = max(1, el) * 6
    g = ls.Group(count, 16, width, el, cells)
    size = 16 + count * (12 + cells * width)
    seg = ls.Segment(0, size, 16 + 12 * count, count * width, 0, 0, g)
    src = np.random.default_rng(seed).integers(0, 256, size, np.uint8).tobytes()
    stored = bytes(relayout.to_stream(seg, src))
    heads, rec = 16 + 12 * count, count * width
    cuts = [heads + min(cells, per) * rec]
    while cuts[-1] < size:
        cuts.append(min(size, cuts[-1] + per * rec))
    pieces = [memoryview(stored)[a:b] for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]
    assert bytes(to_file_from(seg, pieces)) == src
    if cells > 1 and rec > 1:
        assert to_file_from(seg, [memoryview(stored)[: heads + 1], memoryview(stored)[heads + 1 :]]) is None


def _random_group(count, cells, width, trans, seed):
    """A group of ``count`` blocks of ``cells`` rows of ``width`` bytes (transposed: 2-byte
    elements) after a 16-byte lead, random bytes: (its segment, the file bytes, the stored form)."""
    g = ls.Group(count, 16, width, 2 if trans else 0, cells)
    size = 16 + count * (12 + cells * width)
    seg = ls.Segment(0, size, 16 + 12 * count, count * width, 0, 0, g)
    src = np.random.default_rng(seed).integers(0, 256, size, np.uint8).tobytes()
    return seg, src, bytes(relayout.to_stream(seg, src))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(2, 40), st.booleans(), st.integers(1, 7), st.integers(0, 2**32))
def test_a_group_being_put_back_is_ready_exactly_where_its_bytes_are(count, cells, trans, per, seed):
    """A restore reads a group while its chunks still arrive: whatever ``ready`` admits already
    holds the file's bytes; rows of a transposed block only once the whole group is in."""
    width = 8
    seg, src, stored = _random_group(count, cells, width, trans, seed)
    size, heads, rec = len(src), 16 + 12 * count, count * width
    u = relayout.Unpermute(seg)
    rng = random.Random(seed)
    pos = 0
    while pos < size:
        n = heads + per * rec if pos == 0 else per * rec
        assert u.feed([memoryview(stored)[pos : pos + n]])
        pos = min(size, pos + n)
        for _ in range(20):
            off = rng.randrange(size)
            n2 = rng.randrange(1, size - off + 1)
            if u.ready(off, n2):
                assert bytes(u.data[off : off + n2]) == src[off : off + n2]
        if trans and not u.done:
            assert not u.ready(16 + 12, 1)  # the first block's rows
        if not trans:
            assert u.ready(16 + 12, min(u.cells, cells) * width)
    assert u.done and bytes(u.data) == src


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(2, 40), st.booleans(), st.integers(0, 2**32))
def test_the_cells_a_read_waits_for_are_the_ones_it_needs(count, cells, trans, seed):
    """``cells_for`` (what a waiting reader tells the decode) is exact for plain rows: with that
    many cells in place the range is ready, with one fewer it is not; transposed rows need all.
    A reader woken too late would stall a restore, one told too few would be woken for nothing."""
    width = 8
    seg, src, stored = _random_group(count, cells, width, trans, seed)
    size, heads, rec = len(src), 16 + 12 * count, count * width
    rng = random.Random(seed)
    for _ in range(10):
        off = rng.randrange(size)
        n = rng.randrange(1, size - off + 1)
        need = relayout.Unpermute(seg).cells_for(off, n)
        assert 0 <= need <= cells
        u = relayout.Unpermute(seg)
        assert u.feed([memoryview(stored)[: heads + need * rec]])
        assert u.ready(off, n)
        if need and not trans:
            short = relayout.Unpermute(seg)
            assert short.feed([memoryview(stored)[: heads + (need - 1) * rec]])
            assert not short.ready(off, n)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 40), st.booleans(), st.integers(0, 2**32))
def test_a_few_rows_come_back_from_their_records_alone(count, cells, trans, seed):
    """``rows_of`` names the records that hold a range of one block's rows and ``cut_rows`` takes
    the range out of just those records: the file's bytes exactly. Ranges across a header, or
    in transposed rows (a run spans every cell), are left to the whole group's decode."""
    width = 8
    seg, src, stored = _random_group(count, cells, width, trans, seed)
    g = seg.group
    rng = random.Random(seed)
    for _ in range(20):
        off = rng.randrange(len(src))
        n = rng.randrange(1, len(src) - off + 1)
        where = relayout.rows_of(g, off, n)
        block = [i for i in range(count) if 16 + 12 * (i + 1) + i * cells * width <= off]
        inside = bool(block) and off + n <= 16 + 12 * len(block) + len(block) * cells * width
        assert (where is not None) == (inside and not trans), (off, n)
        if where is None:
            continue
        at, length = where.stored(g)
        assert length == (where.last - where.first) * count * width
        assert relayout.cut_rows(g, where, stored[at : at + length], n) == src[off : off + n]


def test_restore_buffers_are_reused_only_when_free(kvfs):
    """Groups are put back into pooled buffers (faulted in at mount, reused once nothing refers to
    them). With a pool far smaller than the groups restored, from several threads at once and
    again after a remount, buffers do get reused and every read still returns its file's bytes:
    a buffer a decoded group or a reply still uses is never written into."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    spec = ggsq.Spec(n_layer=6, row_bytes=512)
    files = {f"s{n}": ggsq.synthetic_bytes(ggsq.synthetic_tokens(n, n), spec) for n in (350, 500, 700, 900)}
    # 8 MiB of buffers for groups of 1-2.6 MiB; no hot copy: every open puts the file back from
    # its groups (kept across the remounts below).
    kvfs.remount(["--cache-size", "16MiB", "--hot-tier-size", "0"])
    mnt = Path(kvfs.mnt)
    for name, data in files.items():
        _write(mnt / name, data)
    rng = random.Random(7)

    def restore(name: str) -> None:
        with open(mnt / name, "rb") as f:
            got = bytearray()
            while chunk := f.read(rng.choice([4096, 131072, MiB])):
                got += chunk
        assert bytes(got) == files[name], name

    for _ in range(2):
        kvfs.remount()
        mnt = Path(kvfs.mnt)
        for _ in range(3):
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3")
            with ThreadPoolExecutor(3) as pool:
                list(pool.map(restore, rng.sample(sorted(files), len(files))))
        # Concurrent restores may each find every buffer busy; one after another, the next one's
        # groups go where the kept groups of the ones before were, once the daemon has had the
        # release of the one before (the kernel sends it after close() has returned).
        for name in sorted(files):
            deadline = time.monotonic() + 30
            while kvfs.stats()["open_files"] and time.monotonic() < deadline:
                time.sleep(0.01)
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3")
            restore(name)
        assert kvfs.stats()["restore_buffers_reused"] > 0


def test_a_restore_starting_at_the_file_end_checks_its_group_and_starts_the_first_group(kvfs):
    """llama-server's first read of a restore is the file's last few KiB (stdio sizing its buffer
    at the seek to the end). The open puts the whole file back first, both groups decoded and
    checked against the file's checksum, so that read (and every one after it) is answered from
    the whole copy, never from a few of a group's records, and reaches no chunk. Then reads in that
    order return the file, each chunk read once."""
    spec = ggsq.Spec(n_layer=6, row_bytes=512)
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(1500, 5), spec)
    _write(Path(kvfs.mnt) / "s", data)
    kvfs.remount(["--hot-tier-size", "0"])  # empty caches, no group kept, no hot copy
    mnt = Path(kvfs.mnt)
    index = stubs.read_index(Path(kvfs.store) / "snapshots" / "s")
    groups = [g for g in ls.segments(data, GROUP_WIDTH) if g.group and g.end is not None]
    assert len(groups) == 2 and groups[-1].end == len(data)  # K, then V to the end of the file
    chunks = [index.find(g.end - 1) - index.find(g.start) + 1 for g in groups]
    assert min(chunks) > 20

    def asked() -> int:  # chunks the daemon read from its packs
        return kvfs.stats()["chunks_read"]

    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")
    before, read_before = asked(), kvfs.stats()["chunks_read"]
    fd = os.open(mnt / "s", os.O_RDONLY)
    try:
        at_open = asked()
        assert at_open - before >= chunks[0] + chunks[1], (at_open - before, chunks)  # both groups, whole
        tail = len(data) - 8192
        assert os.pread(fd, 8192, tail) == data[tail:]
        assert os.pread(fd, 32768, 0) == data[:32768]
        got = bytearray()
        while piece := os.read(fd, MiB):
            got += piece
        assert bytes(got) == data
        assert asked() == at_open  # the reads were answered from the copy put back
    finally:
        os.close(fd)
    assert kvfs.stats()["chunks_read"] - read_before <= len(index) + 4  # each chunk once


def test_a_reopen_shares_the_groups_the_first_open_is_putting_back(kvfs):
    """llama-server's restore reads the file's end from one descriptor, closes it and reads the
    whole file from a second: the second open uses the group the first one started putting back
    (whether it is still being put back or done), so every chunk is read from disk once, and the
    bytes are the file's. Two restores at once from two opens share their groups the same way."""
    import threading

    spec = ggsq.Spec(n_layer=6, row_bytes=512)
    data = ggsq.synthetic_bytes(ggsq.synthetic_tokens(1500, 9), spec)
    _write(Path(kvfs.mnt) / "s", data)
    index = stubs.read_index(Path(kvfs.store) / "snapshots" / "s")

    def read_all() -> bytes:
        with open(Path(kvfs.mnt) / "s", "rb", buffering=0) as f:
            out = bytearray()
            while piece := f.read(MiB):
                out += piece
            return bytes(out)

    for together in (False, True):
        kvfs.remount()  # empty caches, no group kept
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        before = kvfs.stats()["chunks_read"]
        if together:
            got: list[bytes] = []

            def restore(out: list[bytes] = got) -> None:
                out.append(read_all())

            threads = [threading.Thread(target=restore) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert got == [data, data]
        else:
            fd = os.open(Path(kvfs.mnt) / "s", os.O_RDONLY)
            try:
                assert os.pread(fd, 8192, len(data) - 8192) == data[-8192:]
            finally:
                os.close(fd)
            assert read_all() == data
        read = kvfs.stats()["chunks_read"] - before
        assert read <= len(index) + 4, (together, read, len(index))  # each chunk once (a header or two again)
