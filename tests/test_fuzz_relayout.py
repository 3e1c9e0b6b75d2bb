"""A bounded fuzz target for the state-file parser and the relayout round trip.

Inputs: state files of every shape the parser accepts (tests/ggsq_shapes.py), the same with bytes
flipped, inserted or removed, and plain random bytes. For each: the parser never fails and its
segments tile the file; the cutter's chunks hold the stored stream, which put back with the groups
the cutter stored is the file, byte for byte; the stream's own parse never fails, and where it
finds exactly the stored groups, putting it back as it parses is the file too (what a reader
without the file record relies on: the save checks it and stores the file in file order if not).

``KVCFS_FUZZ_EXAMPLES`` sets the number of inputs (default: about half a minute here).
"""

from __future__ import annotations

import os

from ggsq_shapes import ggsq_files
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchunkfs.format import filerecord, relayout
from kvchunkfs.format import llama_state as ls
from kvchunkfs.format.cutter import GROUP_WIDTH, Cutter
from kvchunkfs.format.filerecord import Listed

EXAMPLES = int(os.environ.get("KVCFS_FUZZ_EXAMPLES", "2500"))
SIZES = (1024, 4096, 16384)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(ggsq_files()))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "word"]))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "word" and at + 4 <= len(data):
            data[at : at + 4] = draw(st.sampled_from([0, 1, 2, 0xFFFFFFFF, 1 << 20])).to_bytes(4, "little")
    return bytes(data)


inputs = st.one_of(ggsq_files(), mutated(), st.binary(max_size=400))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(inputs)
def test_fuzz_the_parser_and_the_relayout_round_trip(data):
    for group_w in (0, GROUP_WIDTH):
        segs = ls.segments(data, group_w)
        pos = 0
        for s in segs:
            assert s.start == pos and (s.end is None or s.end >= s.start)
            pos = s.end if s.end is not None else len(data)
        assert segs[-1].end is None
    c = Cutter(*SIZES, "relayout")
    groups: list[Listed] = []
    chunks, _ = c.cut(c.initial(), data, final=True, groups=groups)
    assert all(0 < len(x) <= SIZES[2] for x in chunks)
    stream = b"".join(bytes(x) for x in chunks)
    assert len(stream) == len(data)
    stored = [x.seg for x in groups]
    whole = [s for s in ls.segments(data, GROUP_WIDTH) if s.group is not None and (s.end or 0) <= len(data)]
    assert stored == whole  # a group the end cuts off is stored as it is
    assert relayout.file_bytes(stream, GROUP_WIDTH, stored) == data
    parsed = relayout.groups(lambda o, n: stream[o : o + n], len(stream), GROUP_WIDTH)
    if filerecord.same_groups(parsed, stored):
        assert relayout.file_bytes(stream, GROUP_WIDTH) == data
