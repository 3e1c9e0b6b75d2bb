"""Token-prefix tree over llama-server slot snapshots.

A snapshot (``llama_state_seq_save_file``, llama.cpp ``src/llama-context.cpp``) starts with::

    u32 magic 0x67677371 ("ggsq" little-endian: bytes 71 73 67 67)
    u32 version          (4 at the time of writing; not checked)
    u32 n_token_count
    n_token_count x int32 words, then the KV state

Older servers store the token ids themselves in those words ("plain"). Current llama-server stores a
packed blob (``server_tokens::serialize`` in ``tools/server/server-common.cpp``): ``0xFFFFFFFF``
(LLAMA_TOKEN_NULL), blob version 1, token count, the token ids, then media keys and chunks which we
ignore. Media positions appear as -1 tokens in both layouts and are kept as they are.

Snapshots that share a prompt prefix also share KV rows, so the tree shows what dedup can share.
"""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import BinaryIO

MAGIC = 0x67677371
TOKEN_NULL_WORD = 0xFFFFFFFF
PACKED_VERSION = 1
FIRST_TOKENS = 8  # token ids shown per edge in to_json
_HEADER = struct.Struct("<3I")
_PACKED_HEADER = struct.Struct("<2I")
_READ_STEP = 1 << 20  # read in steps so a corrupt count cannot make us allocate gigabytes

Entries = Sequence[tuple[Sequence[int], str]]  # (tokens, name), in token order


class NotASnapshot(ValueError):
    """The file is not a ggsq slot snapshot, or its token header is truncated or malformed."""


def read_tokens(f: BinaryIO | str | os.PathLike[str]) -> list[int]:
    """Return the prompt tokens of a snapshot, reading only the header (from the current position)."""
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as fh:
            return _read_tokens(fh)
    return _read_tokens(f)


def _read_tokens(f: BinaryIO) -> list[int]:
    magic, _version, n_words = _HEADER.unpack(_read_exact(f, _HEADER.size, "header"))
    if magic != MAGIC:
        raise NotASnapshot(f"bad magic 0x{magic:08x}, expected 0x{MAGIC:08x}")
    if n_words == 0:
        return []
    (first,) = struct.unpack("<I", _read_exact(f, 4, "token list"))
    if first != TOKEN_NULL_WORD:
        return [_signed(first), *_read_ints(f, n_words - 1)]
    return _read_packed(f, n_words)


def _read_packed(f: BinaryIO, n_words: int) -> list[int]:
    # The blob occupies n_words words including the null marker already read.
    if n_words < 3:
        raise NotASnapshot(f"packed token blob of {n_words} words is too short")
    version, count = _PACKED_HEADER.unpack(_read_exact(f, _PACKED_HEADER.size, "packed token header"))
    if version != PACKED_VERSION:
        raise NotASnapshot(f"unsupported packed token blob version {version}")
    if count > n_words - 3:
        raise NotASnapshot(f"packed token count {count} exceeds the blob's {n_words} words")
    return _read_ints(f, count)


def _read_ints(f: BinaryIO, count: int) -> list[int]:
    data = _read_exact(f, 4 * count, "token list")
    return list(struct.unpack(f"<{count}i", data))


def _read_exact(f: BinaryIO, size: int, what: str) -> bytes:
    parts: list[bytes] = []
    left = size
    while left > 0:
        part = f.read(min(left, _READ_STEP))
        if not part:
            raise NotASnapshot(f"truncated {what}: wanted {size} bytes, got {size - left}")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _signed(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


@dataclass(eq=False)
class Node:
    """A radix-tree node: the tokens on the edge into it and the snapshots below it.

    Each snapshot is named once, at the node where its tokens end (``ends``); the names below a
    node are listed only when asked (``snapshots``): every node listing all of them would make a
    tree of N snapshots N x depth names (23 MB of JSON at 50,000)."""

    edge: Sequence[int]  # a list, or an array slice when built from the catalog's token arrays
    depth: int  # prefix length in tokens at the end of this node's edge
    count: int  # snapshots whose tokens pass through or end here
    ends: list[str] = field(default_factory=list)  # snapshots whose tokens end exactly here, sorted
    children: list[Node] = field(default_factory=list)  # ordered by first edge token
    _below: tuple[Entries, int, int] | None = field(default=None, repr=False)  # (entries, lo, hi)

    @property
    def _lo(self) -> int:
        return self._below[1] if self._below is not None else 0

    @property
    def length(self) -> int:
        """Tokens on this node's edge."""
        return len(self.edge)

    @property
    def snapshots(self) -> list[str]:
        """Every snapshot whose tokens pass through or end here, sorted (computed per call)."""
        if self._below is None:
            return []
        entries, lo, hi = self._below
        return sorted(map(itemgetter(1), entries[lo:hi]))


def build_tree(items: Mapping[str, Sequence[int]]) -> Node:
    """Build a compressed radix tree; the root has an empty edge and holds every snapshot."""
    # Sorting puts lists sharing a prefix next to each other; list comparison runs in C.
    return build_sorted(sorted((list(tokens), name) for name, tokens in items.items()))


def build_sorted(entries: Sequence[tuple[Sequence[int], str]], lcp: list[int] | None = None) -> Node:
    """``build_tree`` of (tokens, name) pairs already in token order (the live catalog keeps its rows
    so, as ``array('i')``: no sort and no list copies; slices and comparisons of arrays run in C).
    ``lcp[i]``: tokens entry i shares with entry i-1, if the caller keeps them (0 for the first).

    One pass in token order (as a suffix tree is built from its LCP array): ``path`` holds the
    nodes from the root to the last entry's; an entry sharing ``lcp[i]`` tokens with the one
    before closes the nodes deeper than that, splits the edge it falls inside, and hangs its own
    leaf there. Each entry adds at most two nodes, so the cost is linear in the entries.
    """
    if lcp is None:
        lcp = [0] + [common_prefix_len(entries[i - 1][0], entries[i][0]) for i in range(1, len(entries))]
    root = Node(edge=[], depth=0, count=0, _below=(entries, 0, 0))
    path = [root]
    for i, (tokens, name) in enumerate(entries):
        shared = lcp[i] if i else 0
        last = None
        while path[-1].depth > shared:
            last = path.pop()
            _close(last, i)
        top = path[-1]
        if top.depth < shared:  # the entry leaves ``last``'s edge part way: a node where they part
            assert last is not None
            cut = shared - top.depth
            fork = Node(edge=last.edge[:cut], depth=shared, count=0, _below=(entries, last._lo, 0))
            last.edge = last.edge[cut:]
            fork.children.append(last)
            top.children[-1] = fork
            path.append(fork)
            top = fork
        if len(tokens) == shared:
            top.ends.append(name)
        else:
            leaf = Node(edge=tokens[shared:], depth=len(tokens), count=0, _below=(entries, i, 0))
            leaf.ends.append(name)
            top.children.append(leaf)
            path.append(leaf)
    for node in reversed(path):
        _close(node, len(entries))
    return root


def _close(node: Node, hi: int) -> None:
    """The entries below ``node`` end before entry ``hi``."""
    entries, lo, _ = node._below  # type: ignore[misc]
    node._below = (entries, lo, hi)
    node.count = hi - lo
    if len(node.ends) > 1:
        node.ends.sort()


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix, by bisection over slice comparisons (done in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def to_json(node: Node, shared_by: bool = False) -> dict:
    """A JSON-serialisable dict of the tree rooted at ``node``; ``shared_by``: list at every node
    the names of all the snapshots below it too (N x depth names), not only their count."""
    out = _node_json(node, shared_by)
    stack = [(node, out)]
    while stack:
        current, current_json = stack.pop()
        for child in current.children:
            child_json = _node_json(child, shared_by)
            current_json["children"].append(child_json)
            stack.append((child, child_json))
    return out


def _node_json(node: Node, shared_by: bool) -> dict:
    out = {
        "prefix_tokens": node.depth,
        "edge_tokens": node.length,
        "shared_count": node.count,
        "ends_here": node.ends,
        "first_tokens": _as_list(node.edge[:FIRST_TOKENS]),
        "children": [],
    }
    if shared_by:
        out["shared_by"] = node.snapshots
    return out


def release(tree: Node | dict) -> None:
    """Take a tree (``Node`` or ``to_json``'s dicts) apart a node at a time. Dropping the last
    reference to the root frees every node in one C-level cascade that holds the GIL throughout
    (~40 ms for 95,000 nodes), and the FUSE thread waits that long; freed here, other threads get
    the GIL between nodes."""
    stack: list[Node | dict] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, Node):
            stack.extend(node.children)
            node.children = []
        else:
            stack.extend(node.get("children", ()))
            node["children"] = []


def _as_list(tokens: Sequence[int]) -> list[int]:
    return tokens.tolist() if type(tokens) is array else list(tokens)  # an array slice: converted in C


def render_text(node: Node, skipped: Mapping[str, str] | None = None, max_names: int = 8) -> str:
    """An indented tree, e.g. ``├─ 1200 tokens shared by a, b, c`` / ``│  └─ +340 tokens: a``, then
    one line per snapshot ``skipped`` (path -> why it is not in the tree)."""
    count = node.count
    after = f" after {node.depth} tokens" if node.depth else ""
    lines = [f"{count} snapshot{'s' if count != 1 else ''}{after}{_ends_note(node, max_names)}"]
    # (node, indent, is_last, top_level); children pushed in reverse so they pop in order.
    stack = [(child, "", i == len(node.children) - 1, True) for i, child in enumerate(node.children)][::-1]
    while stack:
        current, indent, last, top = stack.pop()
        lines.append(f"{indent}{'└─ ' if last else '├─ '}{_label(current, top, max_names)}")
        child_indent = indent + ("   " if last else "│  ")
        n = len(current.children)
        stack.extend((c, child_indent, i == n - 1, False) for i, c in reversed(list(enumerate(current.children))))
    lines += [f"skipped {path}: {reason}" for path, reason in sorted((skipped or {}).items())]
    return "\n".join(lines) + "\n"


def _label(node: Node, top: bool, max_names: int) -> str:
    size = f"{node.length} tokens" if top else f"+{node.length} tokens"
    if node.count == 1:
        who = f": {node.snapshots[0]}"
    else:
        who = f" shared by {_names(node.snapshots, max_names)}"
    return size + who + _ends_note(node, max_names)


def _ends_note(node: Node, max_names: int) -> str:
    # Only worth saying where the node goes on: at a leaf, every snapshot ends.
    if node.ends and node.children:
        return f" (ends here: {_names(node.ends, max_names)})"
    return ""


def _names(names: Sequence[str], limit: int) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f", … (+{len(names) - limit} more)"
