"""``LiveCatalog.prefix_match`` (what the proxy asks before every request) walks outwards from the
query's place in token order instead of scanning every row; it must answer exactly what the scan
answers, through adds and drops, filters and limits."""

from __future__ import annotations

import array
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvchunkfs.service import prefixtree
from kvchunkfs.service.catalog import StubInfo
from kvchunkfs.service.live import LiveCatalog, PrefixMatch
from kvchunkfs.service.stubread import NO_SLOTS, Read

tokens = st.lists(st.integers(0, 3), max_size=8)  # a small alphabet: long shared prefixes and ties
names = st.sampled_from([f"{d}{n}{s}" for d in ("", "a/", "b/") for n in "xyzw" for s in ("", ".tmp")])


def info(path: str) -> StubInfo:
    return StubInfo(path, 0, 0, {}, 0.0, 0, None, {})


def scan(cat: LiveCatalog, tokens: list[int], prefix: str, exclude_suffix: str, limit: int) -> list[PrefixMatch]:
    """The reference: ``prefix_match`` by looking at every row."""
    want = array.array("i", tokens)
    found = []
    for path, entry in cat.entries.items():
        have = entry.tokens
        if have is None or not path.startswith(prefix) or (exclude_suffix and path.endswith(exclude_suffix)):
            continue
        n = prefixtree.common_prefix_len(want, have)
        if n:
            found.append(PrefixMatch(path, n, len(have), dict(entry.info.labels)))
    found.sort(key=lambda m: (-m.match, m.tokens, m.path))
    return found[:limit]


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.tuples(names, st.none() | tokens), max_size=14),
    drops=st.lists(names, max_size=4),
    queries=st.lists(st.tuples(tokens, st.sampled_from(["", "a/", "b/"]), st.booleans(), st.integers(1, 4)),
                     min_size=1, max_size=5),
)  # fmt: skip
def test_prefix_match_equals_a_scan_of_every_row(tmp_path_factory, rows, drops, queries) -> None:  # type: ignore[no-untyped-def]
    cat = LiveCatalog(Path(tmp_path_factory.mktemp("snapshots")))
    cat.load()
    for path, toks in rows:
        cat._drop(path)  # a save replaces the row
        tokens_read = None if toks is None else array.array("i", toks)
        cat._add(Read(info(path), NO_SLOTS, NO_SLOTS, tokens_read, None if toks is not None else "none"))
    for path in drops:
        cat._drop(path)
    for query, prefix, no_tmp, limit in queries:
        suffix = ".tmp" if no_tmp else ""
        assert cat.prefix_match(query, prefix, suffix, limit) == scan(cat, query, prefix, suffix, limit)
