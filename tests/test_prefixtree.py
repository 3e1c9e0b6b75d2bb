"""Tests for the ggsq token reader and the token-prefix tree."""

from __future__ import annotations

import io
import itertools
import json
import struct
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchunkfs.service.prefixtree import Node, NotASnapshot, build_tree, read_tokens, render_text, to_json

KV_STATE = b"\x07" * 4096  # stands in for the KV state that follows the tokens


def plain_snapshot(tokens: list[int], version: int = 4) -> bytes:
    words = struct.pack(f"<{len(tokens)}i", *tokens)
    return struct.pack("<3I", 0x67677371, version, len(tokens)) + words + KV_STATE


def packed_snapshot(tokens: list[int], media_keys: int = 0) -> bytes:
    # server_tokens::serialize: NULL marker, blob version, token vector, media key vector.
    blob = struct.pack("<iII", -1, 1, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens)
    blob += struct.pack("<I", media_keys) + b"\0" * 4 * media_keys
    return struct.pack("<3I", 0x67677371, 4, len(blob) // 4) + blob + KV_STATE


class CountingReader(io.BytesIO):
    """Counts the bytes handed out, to prove only the header is read."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.bytes_read = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.bytes_read += len(data)
        return data


def test_packed_layout_as_seen_in_a_real_file() -> None:
    tokens = list(range(1, 0xDAF + 1))
    data = packed_snapshot(tokens)
    assert data[:24].hex() == "7173676704000000b30d0000ffffffff01000000af0d0000"
    assert read_tokens(io.BytesIO(data)) == tokens


def test_plain_layout() -> None:
    tokens = [1, 15043, 3186, 0, 2**31 - 1, -5]
    assert read_tokens(io.BytesIO(plain_snapshot(tokens))) == tokens


def test_reads_only_the_header() -> None:
    tokens = list(range(1000))
    for data in (plain_snapshot(tokens), packed_snapshot(tokens, media_keys=3)):
        reader = CountingReader(data + b"\xff" * 10**6)
        assert read_tokens(reader) == tokens
        assert reader.bytes_read <= 12 + 4 * 1003


def test_reads_a_path(tmp_path: Path) -> None:
    path = tmp_path / "slot.bin"
    path.write_bytes(packed_snapshot([5, 6, 7]))
    assert read_tokens(path) == [5, 6, 7]
    assert read_tokens(str(path)) == [5, 6, 7]


def test_empty_token_lists() -> None:
    assert read_tokens(io.BytesIO(plain_snapshot([]))) == []
    assert read_tokens(io.BytesIO(packed_snapshot([]))) == []


def test_media_placeholders_are_kept() -> None:
    assert read_tokens(io.BytesIO(packed_snapshot([1, -1, -1, 2]))) == [1, -1, -1, 2]


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"", "truncated header"),
        (b"\x71\x73\x67\x67\x04\0\0\0", "truncated header"),
        (b"GGUF" + b"\0" * 20, "bad magic"),
        (struct.pack("<3I", 0x67677371, 4, 10) + b"\1\0\0\0" * 9, "truncated token list"),
        (struct.pack("<3I", 0x67677371, 4, 2) + struct.pack("<iI", -1, 1), "too short"),
        (struct.pack("<3I", 0x67677371, 4, 5) + struct.pack("<iII", -1, 2, 1) + b"\0" * 8, "version 2"),
        (struct.pack("<3I", 0x67677371, 4, 5) + struct.pack("<iII", -1, 1, 3) + b"\0" * 8, "exceeds"),
        (struct.pack("<3I", 0x67677371, 4, 5) + struct.pack("<iII", -1, 1, 2) + b"\0" * 4, "truncated token list"),
        (struct.pack("<3I", 0x67677371, 4, 0xFFFFFFFF) + b"\1\0\0\0" * 10, "truncated token list"),
    ],
)
def test_not_a_snapshot(data: bytes, fragment: str) -> None:
    with pytest.raises(NotASnapshot, match=fragment):
        read_tokens(io.BytesIO(data))


def test_not_a_snapshot_is_value_error() -> None:
    assert issubclass(NotASnapshot, ValueError)


_int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)


@given(tokens=st.lists(_int32, max_size=300), media=st.integers(0, 3))
def test_plain_and_packed_agree(tokens: list[int], media: int) -> None:
    packed = read_tokens(io.BytesIO(packed_snapshot(tokens, media)))
    assert packed == tokens
    if not tokens or tokens[0] != -1:  # a leading -1 is what marks the packed layout
        assert read_tokens(io.BytesIO(plain_snapshot(tokens))) == packed


# --- tree -----------------------------------------------------------------------------------------


def path_of(root: Node, name: str) -> list[Node]:
    """The nodes from root to where ``name`` ends, checking exactly one child carries it each step."""
    path = [root]
    while name not in path[-1].ends:
        carriers = [c for c in path[-1].children if name in c.snapshots]
        assert len(carriers) == 1, f"{name} carried by {len(carriers)} children"
        path.append(carriers[0])
    return path


def walk(root: Node) -> list[tuple[Node, Node | None]]:
    out: list[tuple[Node, Node | None]] = [(root, None)]
    for node, _ in out:
        out.extend((child, node) for child in node.children)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_invariants(items: dict[str, list[int]], root: Node) -> None:
    assert root.depth == 0 and root.length == 0
    assert root.snapshots == sorted(items)
    for node, parent in walk(root):
        below = set(node.ends).union(*(c.snapshots for c in node.children))
        assert node.snapshots == sorted(below) and len(node.snapshots) == len(below) == node.count
        assert node.ends == sorted(node.ends)
        firsts = [c.edge[0] for c in node.children]
        assert firsts == sorted(set(firsts)), "children must start with distinct tokens, in order"
        if parent is not None:
            assert node.length >= 1
            assert node.depth == parent.depth + node.length
            # Compressed: a node with one child and nothing ending there would have been merged.
            assert len(node.children) != 1 or node.ends
    for name, tokens in items.items():
        path = path_of(root, name)
        assert [t for node in path for t in node.edge] == tokens
        assert path[-1].depth == len(tokens)


def deepest_common_depth(root: Node, a: str, b: str) -> int:
    pa, pb = path_of(root, a), path_of(root, b)
    return max(x.depth for x, y in zip(pa, pb, strict=False) if x is y)


# Small alphabets and shared stems make prefixes collide, which is where the tree is interesting.
_stems = st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=4)


@st.composite
def snapshot_sets(draw: st.DrawFn) -> dict[str, list[int]]:
    stems = draw(_stems)
    n = draw(st.integers(0, 12))
    items = {}
    for i in range(n):
        stem = draw(st.sampled_from(stems))
        tail = draw(st.lists(st.integers(0, 3), max_size=6))
        cut = draw(st.integers(0, len(stem)))
        items[f"s{i:02d}"] = stem[:cut] + tail
    return items


@given(items=snapshot_sets())
@settings(max_examples=300)
def test_tree_invariants(items: dict[str, list[int]]) -> None:
    root = build_tree(items)
    check_invariants(items, root)
    names = sorted(items)
    for a, b in itertools.pairwise(names):
        assert deepest_common_depth(root, a, b) == common_prefix(items[a], items[b])


@given(items=snapshot_sets())
def test_json_mirrors_tree(items: dict[str, list[int]]) -> None:
    root = build_tree(items)
    data = json.loads(json.dumps(to_json(root, shared_by=True)))
    assert json.loads(json.dumps(to_json(root))) == _without_names(data)
    pairs = [(root, data)]
    for node, node_json in pairs:
        assert node_json["prefix_tokens"] == node.depth
        assert node_json["edge_tokens"] == node.length
        assert node_json["shared_by"] == node.snapshots and node_json["shared_count"] == len(node.snapshots)
        below = set(node_json["ends_here"]).union(*(_subtree_ends(c) for c in node_json["children"]))
        assert sorted(below) == node_json["shared_by"]  # the names below a node: its subtree's ends
        assert node_json["ends_here"] == node.ends
        assert node_json["first_tokens"] == node.edge[:8]
        assert len(node_json["children"]) == len(node.children)
        pairs.extend(zip(node.children, node_json["children"], strict=True))


def test_small_tree_shape_and_rendering() -> None:
    common = list(range(1200))
    items = {
        "a": common + list(range(5000, 5340)),
        "b": common + [9] * 10,
        "c": common + [9] * 10 + [1, 2],
        "d": [42, 43],
    }
    root = build_tree(items)
    assert [c.snapshots for c in root.children] == [["a", "b", "c"], ["d"]]
    shared = root.children[0]
    assert (shared.depth, shared.length) == (1200, 1200)
    assert [(c.length, c.snapshots, c.ends) for c in shared.children] == [(10, ["b", "c"], ["b"]), (340, ["a"], ["a"])]
    assert render_text(root) == (
        "4 snapshots\n"
        "├─ 1200 tokens shared by a, b, c\n"
        "│  ├─ +10 tokens shared by b, c (ends here: b)\n"
        "│  │  └─ +2 tokens: c\n"
        "│  └─ +340 tokens: a\n"
        "└─ 2 tokens: d\n"
    )


def test_children_sorted_by_first_token() -> None:
    root = build_tree({"x": [9, 1], "y": [3, 1], "z": [5]})
    assert [c.edge[0] for c in root.children] == [3, 5, 9]


def test_edge_cases() -> None:
    root = build_tree({})
    assert (root.snapshots, root.children, root.ends) == ([], [], [])
    assert render_text(root) == "0 snapshots\n"
    root = build_tree({"empty": [], "one": (1, 2, 3), "same": [1, 2, 3]})
    assert root.ends == ["empty"]
    assert [(c.edge, c.ends) for c in root.children] == [([1, 2, 3], ["one", "same"])]
    assert render_text(root) == "3 snapshots (ends here: empty)\n└─ 3 tokens shared by one, same\n"


def test_render_truncates_long_name_lists() -> None:
    items = {f"n{i:02d}": [1, 2, i] for i in range(20)}
    first = render_text(build_tree(items)).splitlines()[1]
    assert first == "└─ 2 tokens shared by n00, n01, n02, n03, n04, n05, n06, n07, … (+12 more)"


def test_deep_chain_does_not_recurse() -> None:
    # Each snapshot extends the previous one: the tree is 1500 levels deep.
    items = {f"t{i:04d}": list(range(i + 1)) for i in range(1500)}
    root = build_tree(items)
    node, depth = root, 0
    while node.children:
        node, depth = node.children[0], depth + 1
    assert depth == 1500
    assert len(render_text(root).splitlines()) == 1501
    json.dumps(to_json(root)["children"][0]["first_tokens"])


def test_fifty_long_snapshots_are_fast() -> None:
    base = list(range(100_000, 112_000))
    items = {}
    for i in range(50):
        items[f"conv{i:02d}"] = base[: 8000 + 80 * i] + [i] * (16_000 - 8000 - 80 * i)
    start = time.perf_counter()
    root = build_tree(items)
    text = render_text(root)
    to_json(root)
    elapsed = time.perf_counter() - start
    check_invariants(items, root)
    assert text.count("\n") > 50
    assert elapsed < 2.0, f"build took {elapsed:.2f}s"


def _without_names(node_json: dict) -> dict:
    out = {k: v for k, v in node_json.items() if k != "shared_by"}
    out["children"] = [_without_names(c) for c in node_json["children"]]
    return out


def _subtree_ends(node_json: dict) -> set[str]:
    return set(node_json["ends_here"]).union(*(_subtree_ends(c) for c in node_json["children"]))
