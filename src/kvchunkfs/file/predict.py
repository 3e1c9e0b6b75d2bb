"""Chunk prediction: skip the cut for bytes the store has already seen in that order.

A next turn repeats a known snapshot almost everywhere. ``Successors`` remembers, for a chunk id,
the chunk that followed it last time, provided that chunk's end was a content-defined cut (see
docs/design.md, "Predicted chunks", for why only those may be accepted). The streaming chunker
hashes the next ``length`` queued bytes and, when they hash to the predicted id and the byte after
them is the one that followed the chunk before, takes them as that chunk without running FastCDC
over them. The check is the SHA-256 the id needs anyway, so a
prediction adds no collision risk beyond the content addressing itself; a miss costs one chunk's
hash (rarely: a 16-byte probe of the chunk's end rejects most misses first).

Memory is bounded: at most ``limit`` successors (~180 bytes each), the oldest half dropped when
full. Shared by every file of a daemon; a lock guards writes only (dict reads are atomic), and it
is never held across I/O.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate, islice

import numpy as np

from kvchunkfs.file.hashing import Hurry, chunk_ids
from kvchunkfs.format.chunker import chunk_id
from kvchunkfs.format.cutter import CutState, Cutter
from kvchunkfs.format.filerecord import Listed

START = b""  # the key of a file's first chunk
PROBE = 16  # trailing bytes of a chunk kept to reject a wrong guess without hashing
LIMIT = 1 << 17  # successors kept: 8 GiB of snapshots at 64 KiB chunks, ~24 MiB of memory
WINDOW = 1 << 20  # after a miss, bytes cut before trying to predict again
JOIN_POOLED = 1 << 20  # joins this large go into a pooled buffer when the batch has a pool

Buffer = bytes | memoryview
Chunks = list[tuple[bytes, Buffer]]


@dataclass(frozen=True, slots=True)
class Guess:
    """The chunk expected next: its id, its length, its last PROBE bytes, and the byte that followed
    it when it was cut (FastCDC's hit at a cut is computed over that byte too: docs/design.md)."""

    cid: bytes
    length: int
    probe: bytes
    after: int


class Successors:
    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._next: dict[bytes, Guess] = {}
        self._lock = threading.Lock()
        self.predicted_bytes = 0

    def __len__(self) -> int:
        return len(self._next)

    def pairs(self) -> list[tuple[bytes, Guess]]:
        """Everything known, oldest first (``learn`` takes them back: tests)."""
        return list(self._next.items())

    def get(self, prev: bytes) -> Guess | None:
        return self._next.get(prev)

    def learn(self, pairs: Iterable[tuple[bytes, Guess]], predicted: int = 0) -> None:
        """Record ``prev -> guess`` pairs; each guess must be a content-defined cut (see module doc).
        ``predicted``: bytes just taken from guesses (counted for tests and measurements)."""
        with self._lock:
            self.predicted_bytes += predicted
            nxt = self._next
            for prev, guess in pairs:
                nxt.pop(prev, None)  # re-inserted at the end: recently seen paths are kept longest
                nxt[prev] = guess
            if len(nxt) > self.limit:
                # Dropping the older half at once keeps eviction O(1) per insert without an
                # OrderedDict (twice the memory per entry).
                self._next = dict(islice(nxt.items(), len(nxt) - self.limit // 2, None))


class Pieces:
    """The queued write buffers of a batch, read as one byte string; only what is asked is joined
    (a predicted chunk inside one buffer is a view of it: no copy)."""

    def __init__(
        self, pieces: Sequence[bytes | bytearray | memoryview], alloc: Callable[[int], np.ndarray] | None = None
    ) -> None:
        self.alloc = alloc  # where large joins go (a pool of reused buffers), else new bytes
        self.views = [memoryview(p) for p in pieces if len(p)]
        self.starts = [0, *accumulate(len(v) for v in self.views)]
        self.size = self.starts[-1]

    def span(self, off: int, n: int) -> Buffer:
        """Bytes ``[off, off + n)``: a view when they lie in one buffer, else a joined copy."""
        if n <= 0:
            return b""
        i = bisect_right(self.starts, off) - 1
        rel = off - self.starts[i]
        view = self.views[i]
        if rel + n <= len(view):
            return view[rel : rel + n]
        parts = [view[rel:]]
        left = n - len(parts[0])
        while left > 0:
            i += 1
            parts.append(self.views[i][:left])
            left -= len(parts[-1])
        if self.alloc is None or n < JOIN_POOLED:
            return b"".join(parts)
        out = self.alloc(n)
        at = 0
        for part in parts:
            out[at : at + len(part)] = np.frombuffer(part, np.uint8)
            at += len(part)
        return out.data


def cut_batch(
    cutter: Cutter,
    state: CutState,
    batch: Pieces,
    prev: bytes,
    successors: Successors | None,
    window: int = WINDOW,
    parallel: bool | Hurry = False,
    groups: list[Listed] | None = None,
    skip_groups: int = 0,
) -> tuple[Chunks, bytes, CutState]:
    """Cut a batch exactly as ``cutter.cut(state, batch, final=False)`` would, accepting predicted
    chunks where the cut is plain FastCDC; returns (chunks with ids, tentative tail, its state).

    ``prev`` is the id of the chunk before the batch (START at the file's start). Chunks the cutter
    itself ends at a content-defined cut are learned as successors. ``parallel``: hash on every
    core (a batch a ``close()`` waits for), or from when it says so (file/hashing.py). ``groups``:
    where the cutter notes the groups it stores permuted (``Cutter.cut``). ``skip_groups``: stop at
    the start of a group that ends past the batch but not past this offset (the end of the file the
    caller cuts it from: ``Cutter.group_windows``), its bytes in the batch left out of the tail.
    """
    out: Chunks = []
    learned: list[tuple[bytes, Guess]] = []
    pos = predicted = 0
    whole = successors is None
    stop = state.pos + batch.size
    while True:
        if not whole and state.plain_cdc:
            assert successors is not None
            start = pos
            pos, prev, state, wait = _follow(successors, batch, pos, prev, state, out, learned)
            predicted += pos - start
            if wait or pos == batch.size:  # the guessed chunk lies past the batch: wait for its bytes
                tail = batch.span(pos, batch.size - pos)
                break
        rest = batch.size - pos
        # A window at a time (any split of the bytes cuts alike), so a prediction resumes soon
        # after a miss, or once a format's parse turns into an opaque rest.
        size = rest if whole else min(rest, max(window, 4 * cutter.max))
        data = memoryview(batch.span(pos, size))
        pieces, after = cutter.cut(state, data, final=False, groups=groups)
        done = _take_cut(pieces, data, state.pos, after, prev, out, learned, parallel)
        prev = out[-1][0] if pieces else prev
        pos, state = pos + done, after
        if stop < state.waits_for <= skip_groups:
            tail = b""
            break
        if size == rest:
            tail = data[done:]
            break
        whole = done == 0  # nothing final in a window (a format decision needs more bytes): cut all
    if successors is not None and learned:
        successors.learn(learned, predicted)
    return out, bytes(tail), state


def _follow(
    successors: Successors,
    batch: Pieces,
    pos: int,
    prev: bytes,
    state: CutState,
    out: Chunks,
    learned: list[tuple[bytes, Guess]],
) -> tuple[int, bytes, CutState, bool]:
    """Accept predicted chunks from ``pos`` while they hash to their id; (pos, prev, state, wait)."""
    start = pos
    wait = False
    while (guess := successors.get(prev)) is not None:
        end = pos + guess.length
        if end >= batch.size:  # the chunk and the byte after it are needed
            wait = True
            break
        probe = guess.probe
        if batch.span(end, 1)[0] != guess.after or batch.span(end - len(probe), len(probe)) != probe:
            break
        data = batch.span(pos, guess.length)
        if chunk_id(data) != guess.cid:
            break
        out.append((guess.cid, data))
        learned.append((prev, guess))
        prev, pos = guess.cid, end
    return pos, prev, replace(state, pos=state.pos + pos - start), wait


def _take_cut(
    pieces: list[memoryview],
    data: memoryview,
    base: int,
    after: CutState,
    prev: bytes,
    out: Chunks,
    learned: list[tuple[bytes, Guess]],
    parallel: bool | Hurry = False,
) -> int:
    """Hash the cutter's chunks (of ``data``, which starts at file offset ``base``) into ``out``;
    learn those that ended at a content-defined cut: chunks of a cut with more bytes to come that
    lie in the open FastCDC segment the state ends in (a format's grid cuts and segment ends are not
    content-defined), with the byte after them. Returns the bytes taken."""
    cdc_from = after.segments[0].start if after.plain_cdc else None
    off = 0
    for p, cid in zip(pieces, chunk_ids(pieces, parallel), strict=True):
        out.append((cid, p))
        off += len(p)
        if cdc_from is not None and base + off - len(p) >= cdc_from and off < len(data):
            learned.append((prev, Guess(cid, len(p), bytes(p[-PROBE:]), data[off])))
        prev = cid
    return off
