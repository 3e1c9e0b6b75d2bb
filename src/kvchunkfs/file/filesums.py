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
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from kvchunkfs.format.filerecord import Listed, file_hasher

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

    def add(self, pieces: Sequence[Buffer], n: int, groups: Sequence[Listed] = ()) -> None:
        """The first ``n`` bytes of ``pieces`` (in order) are now final chunks."""
        if n <= 0:
            return
        self.marks.append((self.size, self.hasher.copy()))
        left = n
        for p in pieces:
            if left <= 0:
                break
            view = memoryview(p)[:left]
            self.hasher.update(view)
            left -= len(view)
        assert left == 0, "fewer bytes than the chunks hold"
        self.size += n
        self.groups.extend(groups)

    def final(self, tail: Buffer, groups: Sequence[Listed]) -> tuple[bytes, list[Listed], list[Mark]]:
        """(file checksum, groups, marks) of the file that ends with ``tail`` (this object is
        unchanged: the stream goes on with its tentative tail)."""
        h = self.hasher.copy()
        marks = [*self.marks, (self.size, self.hasher.copy())]
        h.update(tail)
        return h.digest(), [*self.groups, *groups], marks


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
