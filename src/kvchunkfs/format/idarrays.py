"""Chunk ids as numpy arrays: sets and reference counts over millions of ids, no Python object per id.

A ``bytes`` id in a Python set or dict costs ~100-160 bytes (the object, the hash slot, a value);
an index of a million chunks made the daemon's store-wide structures cost hundreds of MB. Here ids
are rows of numpy arrays:

* ``ID`` (``V32``): a full 32-byte id, compared and sorted byte-wise (memcmp order);
* a *prefix*: the id's first 8 bytes as an unsigned 64-bit number. SHA-256 ids are uniform, so a
  prefix names one chunk but for a chance collision: a set of prefixes answers "might this id be
  in the set" with no false "no". Used only where a false "yes" is safe (GC keeps a chunk).

``PrefixSet`` is a set of ids kept as prefixes (8 bytes an id); ``RefCounts`` the catalog's
reference count per distinct id, keyed by the id's first 16 bytes (``KEY_LEN``: 24 bytes an id
plus 4 in its lookup order). Two chunks whose SHA-256 ids agree in 16 bytes (a collision of 128
bits: 2^64 work to make one, by design of the hash) would count as one chunk: their snapshots'
unique and shared bytes would be off, and GC, which asks whether a key is named, would keep them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

ID_LEN = 32
ID = np.dtype(f"V{ID_LEN}")
NONE = -1  # ``RefCounts.find``: no slot holds the id
RESERVE_MAX = 1 << 26  # ``RefCounts.reserve``: slots at most (2.5 GiB of address space)
FENCE = 64  # ``RefCounts``: every FENCE-th id of an order is kept for a first search


def grown(array: np.ndarray, used: int, need: int) -> np.ndarray:
    """``array`` (its first ``used`` rows) in a new one with room for ``need`` rows, a quarter more
    at least (an array filled page by page from a count that was low: saves went on meanwhile)."""
    out = np.empty((max(need, len(array) + len(array) // 4), *array.shape[1:]), array.dtype)
    out[:used] = array[:used]
    return out


def from_list(ids: Iterable[bytes]) -> np.ndarray:
    """``ID`` rows of some ids (each must be 32 bytes)."""
    ids = ids if isinstance(ids, Sequence) else list(ids)
    if any(len(cid) != ID_LEN for cid in ids):
        raise ValueError(f"a chunk id is {ID_LEN} bytes")
    return np.frombuffer(b"".join(ids), ID) if ids else np.empty(0, ID)


def to_list(ids: np.ndarray) -> list[bytes]:
    """The ``bytes`` of each row (for an API that takes ids one by one: use on bounded batches)."""
    data = np.ascontiguousarray(ids).tobytes()
    return [data[i : i + ID_LEN] for i in range(0, len(data), ID_LEN)]


def prefixes(ids: np.ndarray) -> np.ndarray:
    """The first 8 bytes of each id as big-endian uint64 (so prefix order is id order)."""
    if not len(ids):
        return np.empty(0, np.uint64)
    rows = np.ascontiguousarray(ids).view(np.uint8).reshape(len(ids), ID_LEN)
    return np.ascontiguousarray(rows[:, :8]).view(">u8").ravel().astype(np.uint64)


def contains(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Which of ``keys`` are in the sorted unique array ``sorted_keys`` (bool per key)."""
    if not len(sorted_keys) or not len(keys):
        return np.zeros(len(keys), bool)
    at = np.searchsorted(sorted_keys, keys)
    hit = at < len(sorted_keys)
    hit[hit] = sorted_keys[at[hit]] == keys[hit]
    return hit


class PrefixSet:
    """A growing set of id prefixes, kept as one sorted unique uint64 array (8 bytes an id).

    Added ids wait in a list until they are as many as half the set, then they are sorted and
    merged in: memory stays within ~2.5x the set at a merge, and the cost of merging is amortised
    over the ids added."""

    def __init__(self) -> None:
        self._sorted = np.empty(0, np.uint64)
        self._pending: list[np.ndarray] = []
        self._pending_n = 0

    def add(self, ids: np.ndarray) -> None:
        """Add ``ID`` rows."""
        self.add_prefixes(prefixes(ids))

    def add_prefixes(self, keys: np.ndarray) -> None:
        if not len(keys):
            return
        self._pending.append(keys)
        self._pending_n += len(keys)
        if self._pending_n > max(1 << 16, len(self._sorted) // 2):
            self._merge()

    def update(self, other: PrefixSet) -> None:
        self.add_prefixes(other.sorted())

    def _merge(self) -> None:
        """The pending prefixes merged into the sorted ones (not a sort of all of them: one copy)."""
        if not self._pending:
            return
        new = np.unique(np.concatenate(self._pending))
        self._pending, self._pending_n = [], 0
        if len(self._sorted):
            new = new[~contains(self._sorted, new)]
            self._sorted = np.insert(self._sorted, np.searchsorted(self._sorted, new), new)
        else:
            self._sorted = new

    def sorted(self) -> np.ndarray:
        """The prefixes, sorted and unique."""
        self._merge()
        return self._sorted

    def __len__(self) -> int:
        return len(self.sorted())

    def might_hold(self, ids: np.ndarray) -> np.ndarray:
        """Per ``ID`` row: False only if the set holds no id with its prefix."""
        return contains(self.sorted(), prefixes(ids))


KEY_LEN = 16  # ``RefCounts``: the bytes of an id it keys by
_WORDS = KEY_LEN // 8


def as_rows(ids: np.ndarray) -> np.ndarray:
    """The keys (first ``KEY_LEN`` bytes) of ``ID`` rows as (n, 2) native uint64 whose row order
    (column by column) is the ids' byte order."""
    words = np.ascontiguousarray(ids).view(">u8").reshape(len(ids), ID_LEN // 8)
    return words[:, :_WORDS].astype(np.uint64)


def key_bytes(rows: np.ndarray) -> list[bytes]:
    """``as_rows`` keys as ``KEY_LEN``-byte strings."""
    data = np.ascontiguousarray(rows.astype(">u8")).tobytes()
    return [data[i : i + KEY_LEN] for i in range(0, len(data), KEY_LEN)]


def _less(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: whether key ``a[i]`` sorts before ``b[i]`` ((n, 2) uint64 rows)."""
    lt = np.zeros(len(a), bool)
    eq = np.ones(len(a), bool)
    for c in range(_WORDS):
        lt |= eq & (a[:, c] < b[:, c])
        eq &= a[:, c] == b[:, c]
    return lt


class RefCounts:
    """A reference count per distinct id, with the xor of the owners holding it.

    Each id has a *slot* that stays its own while any owner holds it: owners keep slot numbers
    (4 bytes an id), not ids. Per slot: the id's key (``as_rows``: its first 16 bytes), the count
    and the xor of the owners' numbers (owner numbers are 32-bit), so an id whose count falls to one
    names its last owner: 24 bytes a distinct id, plus 4 in the lookup order.

    Lookups binary-search an order of the slots (vectorised over the ids looked up): ``_main``
    and ``_recent`` (slots made since the last merge, merged into ``_main`` by ``tidy`` once they
    are an eighth of it, so a change costs what it adds, amortised, not a copy of the store's
    order). A slot whose count falls to 0 stays findable (its id may come back) until a merge
    frees it for reuse.
    """

    def __init__(self) -> None:
        self.keys = np.empty((0, _WORDS), np.uint64)
        self.count = np.empty(0, np.uint32)
        self.xor = np.empty(0, np.uint32)
        self.n = 0  # slots ever made (the arrays' first ``n`` rows)
        self._main = np.empty(0, np.uint32)  # slots in id order
        self._recent = np.empty(0, np.uint32)  # newer slots in id order
        self._free = np.empty(0, np.uint32)  # slots a merge freed
        self._fences: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(order) -> (order, its fence)

    def __len__(self) -> int:
        """Ids with a count of at least one."""
        return int(np.count_nonzero(self.count[: self.n]))

    def key_bytes(self, slots: np.ndarray) -> list[bytes]:
        """The key of each slot (the first ``KEY_LEN`` bytes of its ids)."""
        return key_bytes(self.keys[slots])

    def _search(self, order: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """For each row: the first position in ``order`` whose id does not sort before it.

        The first 8 bytes of every ``FENCE``-th id of the order (a fence, ~0.1 byte an id) narrow
        each search to ``FENCE`` positions with numpy's own search; a few vectorised halvings do
        the rest (the ids' later bytes decide only between ids of equal first 8 bytes)."""
        fence = self._fence(order)
        key0 = rows[:, 0]
        lo = np.maximum(np.searchsorted(fence, key0, "left") - 1, 0) * FENCE
        hi = np.minimum(np.searchsorted(fence, key0, "right") * FENCE, len(order))
        active = np.flatnonzero(lo < hi)
        while len(active):
            low, high = lo[active], hi[active]
            mid = (low + high) >> 1
            slot = order[mid]
            first, want = self.keys[slot, 0], key0[active]
            less = first < want
            tie = np.flatnonzero(first == want)  # same first 8 bytes: the rest decides
            if len(tie):
                less[tie] = _less(self.keys[slot[tie]], rows[active[tie]])
            lo[active] = np.where(less, mid + 1, low)
            hi[active] = np.where(less, high, mid)
            active = active[lo[active] < hi[active]]
        return lo

    def _fence(self, order: np.ndarray) -> np.ndarray:
        cached = self._fences.get(id(order))
        if cached is None or cached[0] is not order:
            cached = (order, self.keys[order[::FENCE], 0])
            self._fences = {id(order): cached, **{k: v for k, v in self._fences.items() if v[0] is self._main}}
        return cached[1]

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each ``ID`` row in ``keys`` (int64), ``NONE`` where no slot has it."""
        return self._find_rows(as_rows(keys))

    def find_keys(self, rows: np.ndarray) -> np.ndarray:
        """``find`` for keys given as ``keys`` rows."""
        return self._find_rows(rows)

    def _find_rows(self, rows: np.ndarray) -> np.ndarray:
        out = np.full(len(rows), NONE, np.int64)
        for order in (self._main, self._recent):
            if not len(order) or not len(rows):
                continue
            at = self._search(order, rows)
            inside = at < len(order)
            slot = order[np.where(inside, at, 0)].astype(np.int64)
            hit = inside & (self.keys[slot] == rows).all(axis=1)
            out[hit] = slot[hit]
        return out

    def slots(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each ``ID`` row in ``keys`` (int64), made (with count 0) for new ids."""
        rows = as_rows(keys)
        slot = self._find_rows(rows)
        new = np.flatnonzero(slot == NONE)
        if len(new):
            distinct, back = np.unique(rows[new], axis=0, return_inverse=True)  # an id twice: one slot
            slot[new] = self._make(distinct)[back.ravel()]
        return slot

    def _make(self, rows: np.ndarray) -> np.ndarray:
        """New slots (count 0) for distinct ids no slot has, given sorted (``np.unique``'d)."""
        k = len(rows)
        reuse = self._free[:k]
        self._free = self._free[k:]
        fresh = np.arange(self.n, self.n + k - len(reuse), dtype=np.uint32)
        self._grow(self.n + len(fresh))
        self.n += len(fresh)
        made = np.concatenate([reuse, fresh])
        self.keys[made] = rows
        self.count[made] = 0
        self.xor[made] = 0
        self._recent = self._insert(self._recent, made)
        return made.astype(np.int64)

    def _insert(self, order: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """``order`` with ``slots`` (in id order, none of their ids in it) merged in."""
        if not len(order):
            return slots
        return np.insert(order, self._search(order, self.keys[slots]), slots)

    def tidy(self) -> None:
        """After the owner applied a change's counts: merge the orders once the recent one is an
        eighth of the main one (freeing slots whose count is 0 for reuse)."""
        if len(self._recent) > max(1 << 12, len(self._main) // 8):
            self._merge()

    def compact(self) -> None:
        """Merge now (after a load: the order in one piece, dead slots freed); only between
        changes (a slot made for a change has count 0 until the owner counts it)."""
        self._merge()

    def reserve(self, slots: int) -> None:
        """Room for ``slots`` slots (at most ``RESERVE_MAX``) before any is made: a load that knows
        how many ids may come grows no array (a copy holds both). The room is address space: memory
        is taken only as slots are filled."""
        self._grow(min(slots, RESERVE_MAX))

    def _grow(self, need: int) -> None:
        """Room for ``need`` slots, a quarter more at a time."""
        if need <= len(self.count):
            return
        size = max(need, len(self.count) + len(self.count) // 4, 1 << 12)
        for name in ("keys", "count", "xor"):
            old = getattr(self, name)
            new = np.empty((size, *old.shape[1:]), old.dtype)
            new[: self.n] = old[: self.n]
            setattr(self, name, new)

    def _merge(self) -> None:
        """One order of every live slot (a merge of the two sorted ones: 4 bytes a slot copied);
        slots whose count is 0 are freed for reuse."""
        main, recent = self._main, self._recent
        dead_main, dead_recent = self.count[main] == 0, self.count[recent] == 0
        if dead_main.any() or dead_recent.any():  # else no copies (a first load's million slots)
            self._free = np.concatenate([self._free, main[dead_main], recent[dead_recent]])
            main, recent = main[~dead_main], recent[~dead_recent]
        del dead_main, dead_recent
        self._recent = np.empty(0, np.uint32)
        self._main = self._insert(main, recent)
