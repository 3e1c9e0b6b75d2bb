"""The catalog's token order: (tokens, path) of every row with a token prefix, sorted by tokens.

Kept as rows change (one bisect and one list insert or delete a row), with each row's common prefix
with its neighbour beside it, so a prefix match looks at the neighbours of the query's place instead
of at every row, and the prefix tree is built in one pass with no sort and no comparison of
neighbours again (``prefixtree.build_sorted``). The catalog holds its lock around every use.
"""

from __future__ import annotations

import array
import bisect
from collections.abc import Callable, Iterator

from kvchunkfs.service import prefixtree


class TokenOrder:
    def __init__(self) -> None:
        # (tokens, path) of every row with a token prefix, in token order: a prefix match looks at
        # the neighbours of the query's place in it instead of at every row (see best_first).
        self.order: list[tuple[array.array, str]] = []
        # lcp[i]: tokens row i shares with row i-1 (0 for the first): kept with order, so the
        # prefix tree is built without comparing neighbours again (prefixtree.build_sorted).
        self.lcp: list[int] = []

    def insert(self, tokens: array.array, rel: str) -> None:
        order, lcp = self.order, self.lcp
        at = bisect.bisect_left(order, (tokens, rel))
        order.insert(at, (tokens, rel))
        lcp.insert(at, self._common(at - 1, at))
        if at + 1 < len(order):
            lcp[at + 1] = self._common(at, at + 1)

    def remove(self, tokens: array.array, rel: str) -> None:
        order, lcp = self.order, self.lcp
        at = bisect.bisect_left(order, (tokens, rel))
        del order[at]  # the same (tokens, path) pair insert added
        del lcp[at]
        if at < len(order):
            lcp[at] = self._common(at - 1, at)

    def _common(self, i: int, j: int) -> int:
        order = self.order
        return prefixtree.common_prefix_len(order[i][0], order[j][0]) if i >= 0 else 0

    def best_first(self, want: array.array) -> Iterator[tuple[str, int, int]]:
        """(path, tokens it shares with ``want``, its own token count) of every row sharing at least
        one token with ``want``, longest match first.

        In token order, the common prefix with the query only shrinks moving away from the query's
        place, on either side: walking outwards from there, always on the side with the longer
        match, visits rows best first. The caller stops the walk once it has what it needs."""
        order = self.order

        def common(j: int) -> int:
            return prefixtree.common_prefix_len(want, order[j][0]) if 0 <= j < len(order) else 0

        up = bisect.bisect_left(order, (want, ""))
        down = up - 1
        n_down, n_up = common(down), common(up)
        while (n := max(n_down, n_up)) > 0:
            if n_down >= n_up:
                j, down = down, down - 1
                n_down = common(down)
            else:
                j, up = up, up + 1
                n_up = common(up)
            have, path = order[j]
            yield path, n, len(have)

    def under(self, prefix: str, names: Callable[[str], str]) -> tuple[list[tuple[array.array, str]], list[int]]:
        """(tokens, ``names(path)``) of the rows under ``prefix`` in token order, and the common prefix
        of each with the one before it: what ``prefixtree.build_sorted`` takes (no sort, no copies of
        the token arrays)."""
        order = self.order
        if prefix:
            kept = [i for i, (_, p) in enumerate(order) if p.startswith(prefix)]
            entries = [(order[i][0], names(order[i][1])) for i in kept]
            lcp = _subset_lcp(self.lcp, kept)
        else:
            entries = [(tokens, names(p)) for tokens, p in order]
            lcp = list(self.lcp)
        return entries, lcp


def _subset_lcp(lcp: list[int], kept: list[int]) -> list[int]:
    """Common prefixes of consecutive kept rows: in sorted order the common prefix of two rows is
    the least of the neighbours' ones between them."""
    out = []
    for n, i in enumerate(kept):
        out.append(min(lcp[kept[n - 1] + 1 : i + 1]) if n else 0)
    return out
