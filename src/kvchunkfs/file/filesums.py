"""What a save knows of its file's bytes (the file record, format/filerecord.py), and the counts of
the checks that use it.

``SaveSums`` follows one save: the running xxh3-128 of the bytes its index holds as final chunks,
in file order (fed as chunks become final, so a tentative tail that is cut again is hashed once),
and the groups the cutter stored permuted, each with the checksum of its file bytes. ``Resumes``
keeps, for the files saved last, the running checksum at a few positions: an append (llama-server's
second pass) continues from there instead of reading the whole file back. ``FileChecks`` counts
saves stored in file order and checksum mismatches, for the metrics.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

from kvchunkfs.format.filerecord import Listed, file_hasher, group_hasher
from kvchunkfs.format.llama_state import Segment

log = logging.getLogger(__name__)

MARKS = 8  # positions of the running checksum a save keeps (the last ones: an append resumes near the end)
RESUMES_KEPT = 16  # files whose marks are kept after their save

Buffer = bytes | bytearray | memoryview
Mark = tuple[int, xxhash.xxh3_128]  # (file offset, the checksum of the bytes before it)


class SaveSums:
    """The checksum of a file's first ``size`` bytes and the groups stored permuted among them."""

    def __init__(self, size: int = 0, hasher: xxhash.xxh3_128 | None = None, groups: Sequence[Listed] = ()) -> None:
        self.size = size
        self.hasher = hasher if hasher is not None else file_hasher()
        self.groups: list[Listed] = list(groups)
        self.marks: deque[Mark] = deque(maxlen=MARKS)

    def add(self, pieces: Sequence[Buffer], lengths: Sequence[int], groups: Sequence[Listed] = ()) -> None:
        """The first bytes of ``pieces`` (in order) are now final chunks of these ``lengths``."""
        _feed(self.hasher, self.size, pieces, lengths, groups, self.marks)
        self.size += sum(lengths)
        self.groups.extend(groups)

    def add_group(self, seg: Segment, pieces: Iterable[Buffer]) -> None:
        """The next bytes are the group ``seg``, now final chunks, its file bytes given in order
        (a group cut from its file a window at a time): one mark, at its start."""
        self.marks.append((self.size, self.hasher.copy()))
        whole = group_hasher()
        for p in pieces:
            self.hasher.update(p)
            whole.update(p)
            self.size += len(p)
        self.groups.append(Listed(seg, whole.digest()))

    def final(
        self, tail: Buffer, lengths: Sequence[int], groups: Sequence[Listed]
    ) -> tuple[bytes, list[Listed], list[Mark]]:
        """(file checksum, groups, marks) of the file whose last chunks (of these ``lengths``) hold
        ``tail`` (this object is unchanged: the stream goes on with its tentative tail)."""
        h = self.hasher.copy()
        marks = deque(self.marks, maxlen=MARKS)
        _feed(h, self.size, [tail], lengths, groups, marks)
        return h.digest(), [*self.groups, *groups], list(marks)


def _feed(
    hasher: xxhash.xxh3_128,
    at: int,
    pieces: Sequence[Buffer],
    lengths: Sequence[int],
    groups: Sequence[Listed],
    marks: deque[Mark],
) -> None:
    """Hash the first ``sum(lengths)`` bytes of ``pieces`` (file offset ``at`` on), marking the
    checksum where an append may resume: where they start, at each group's start and at the last
    chunk's start (an append resumes at the file's last chunk, or at the start of the group that
    holds it)."""
    n = sum(lengths)
    if n <= 0:
        return
    stops = {at, at + n - lengths[-1], *(x.seg.start for x in groups)}
    pos, left = at, n
    for p in pieces:
        view = memoryview(p)[:left]
        while len(view):
            if pos in stops:
                marks.append((pos, hasher.copy()))
            nxt = min((s for s in stops if s > pos), default=at + n)
            take = view[: nxt - pos]
            hasher.update(take)
            view, pos, left = view[len(take) :], pos + len(take), left - len(take)
        if left <= 0:
            break
    assert left == 0, "fewer bytes than the chunks hold"


class Resumes:
    """Marks of the files saved last, by their file checksum (which names the bytes they cover)."""

    def __init__(self, kept: int = RESUMES_KEPT) -> None:
        self.kept = kept
        self._marks: OrderedDict[bytes, list[Mark]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, file_sum: bytes, marks: list[Mark]) -> None:
        with self._lock:
            self._marks[file_sum] = marks
            self._marks.move_to_end(file_sum)
            while len(self._marks) > self.kept:
                self._marks.popitem(last=False)

    def before(self, file_sum: bytes, pos: int) -> Mark | None:
        """The kept mark of the file with checksum ``file_sum`` nearest before ``pos`` (a copy)."""
        with self._lock:
            marks = self._marks.get(file_sum, [])
            best = max((m for m in marks if m[0] <= pos), key=lambda m: m[0], default=None)
            return (best[0], best[1].copy()) if best is not None else None


@dataclass
class FileChecks:
    """Counts for the metrics (updated by any thread: always through ``add``)."""

    file_order_saves: int = 0  # saves whose stored form would not parse back: stored in file order
    mismatches: int = 0  # file or group checksums that did not match (the read or copy failed with EIO)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, n in amounts.items():
                setattr(self, name, getattr(self, name) + n)

    def mismatch(self, what: str) -> OSError:
        """Count and log a checksum mismatch; the error to fail with (never the bytes)."""
        self.add(mismatches=1)
        log.error("%s: checksum mismatch, not served (EIO)", what)
        return OSError(errno.EIO, f"{what}: checksum mismatch")
