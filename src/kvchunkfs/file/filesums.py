"""What a save knows of its file's bytes (the file record, format/filerecord.py), and the counts of
the checks that use it.

``SaveSums`` follows one save: the running xxh3-128 of the bytes its index holds as final chunks,
in file order (fed as chunks become final, so a tentative tail that is cut again is hashed once),
and the groups the cutter stored permuted, each with the checksum of its file bytes.
``FileChecks`` counts saves stored in file order and checksum mismatches, for the metrics.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

from kvchunkfs.format.filerecord import Listed, file_hasher, group_hasher
from kvchunkfs.format.llama_state import Segment

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
_ZEROS = bytes(1 << 20)


class SaveSums:
    """The checksum of a file's first ``size`` bytes and the groups stored permuted among them."""

    def __init__(self) -> None:
        self.size = 0
        self.hasher = file_hasher()
        self.groups: list[Listed] = []

    def add(self, pieces: Sequence[Buffer], lengths: Sequence[int], groups: Sequence[Listed] = ()) -> None:
        """The first bytes of ``pieces`` (in order) are now final chunks of these ``lengths``."""
        _feed(self.hasher, pieces, sum(lengths))
        self.size += sum(lengths)
        self.groups.extend(groups)

    def add_zeros(self, n: int) -> None:
        """The next ``n`` bytes are zeros (a hole), now final chunks."""
        self.size += n
        while n > 0:
            step = min(n, len(_ZEROS))
            self.hasher.update(memoryview(_ZEROS)[:step])
            n -= step

    def add_group(self, seg: Segment, pieces: Iterable[Buffer]) -> None:
        """The next bytes are the group ``seg``, now final chunks, its file bytes given in order
        (a group cut from its file a window at a time)."""
        whole = group_hasher()
        for p in pieces:
            self.hasher.update(p)
            whole.update(p)
            self.size += len(p)
        self.groups.append(Listed(seg, whole.digest()))

    def final(self, tail: Buffer, lengths: Sequence[int], groups: Sequence[Listed]) -> tuple[bytes, list[Listed]]:
        """(file checksum, groups) of the file whose last chunks (of these ``lengths``) hold ``tail``."""
        h = self.hasher.copy()
        _feed(h, [tail], sum(lengths))
        return h.digest(), [*self.groups, *groups]


def _feed(hasher: xxhash.xxh3_128, pieces: Sequence[Buffer], n: int) -> None:
    """Hash the first ``n`` bytes of ``pieces``."""
    left = n
    for p in pieces:
        if left <= 0:
            break
        view = memoryview(p)[:left]
        hasher.update(view)
        left -= len(view)
    if left:
        raise ValueError("fewer bytes than the chunks hold")


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
