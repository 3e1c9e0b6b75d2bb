"""Room for a save, checked before its bytes: the store's disk, and the whole-file directory.

A staged save is acknowledged at its close and stored behind it (file/ingest.py), so the room it
needs must be there before it is acknowledged, not found missing later:

* **The store** takes every staged save's chunks. A new save is refused at its open (``refusal``:
  ENOSPC, EIO, EROFS) while ingestion cannot store what is staged (``Ingester.degraded``), or
  while the store's disk could not take what is staged plus a save as large as the recent ones
  (``expected``) if none of its bytes were shared; a save whose close finds the disk too full for
  it (``store_refusal(size)``) is refused there, its previous version kept. Both are counted, and
  logged once when refusing starts and once when it ends. A save admitted at its close holds its
  room (a ``Claim``) from that check on until ingestion has written its chunks (then the disk's
  free space shows them): closes are checked one at a time, and each counts the room of every save
  acknowledged before it, also one whose storing has not started (a file still open elsewhere) or
  is under way.
* **The whole-file directory** holds what clients write (passed through: a write cannot wait).
  An open waits (``shortfall``) while the directory's free room, hot copies evicted first, is less
  than a save as large as the recent ones plus what the writers already open may still write,
  and ingestion is storing saves that will make room. A save whose writes may have failed for
  lack of room (``torn``) is not committed: its close fails with ENOSPC.

The worst case is assumed (no byte of a save shared with the store, ``overhead`` for its index
and map rows): near a full disk a save that would have been deduplicated may be refused, never
one that cannot be kept acknowledged.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvchunkfs.file.content import FileContent
from kvchunkfs.file.ingest import Ingester
from kvchunkfs.store.wholefiles import WholeFiles

log = logging.getLogger(__name__)

RECENT = 16  # saves whose sizes make the expected size of the next one
TORN_FREE = 4 << 20  # the whole-file directory with less free than this at a close: a write may have failed
REFUSABLE = (errno.ENOSPC, errno.EIO, errno.EROFS, errno.EDQUOT)
INDEX_SHARE = 256  # a file's length over this: the most its index entries take (40 bytes a chunk)


def overhead(size: int) -> int:
    """The most a save of ``size`` new bytes takes on the store's disk: its chunks, their index
    entries and map rows, a pack's header."""
    return size + size // 32 + (1 << 20)


def needed(st: os.stat_result) -> int:
    """The room on the store's disk a save of the file ``st`` describes takes at most: the bytes it
    holds (a hole is no data: stored as one chunk of zeros), plus the index entries of its length."""
    return min(st.st_size, st.st_blocks * 512) + st.st_size // INDEX_SHARE


@dataclass(eq=False)
class Claim:
    """The room on the store's disk a save admitted at its close holds until its chunks are written
    (``release``: by ingestion once they are, or by the close if the save was not staged)."""

    room: Room
    size: int
    handed: bool = False  # its save was queued for ingestion, which releases it

    def release(self) -> None:
        self.room.release(self)


class Room:
    def __init__(self, store_root: Path, whole: WholeFiles, ingester: Ingester) -> None:
        self.store_root = store_root
        self.whole = whole
        self.ingester = ingester
        self._lock = threading.Lock()
        self._recent: deque[int] = deque(maxlen=RECENT)
        self._torn: weakref.WeakSet[object] = weakref.WeakSet()  # contents a write to failed
        self.refused = 0  # saves refused (at the open or the close) for the store's trouble
        self.waits = 0  # opens that waited for room in the whole-file directory
        self._refusing = False
        self._claims: set[Claim] = set()  # saves admitted at their close and not stored yet
        self._admitting = threading.Lock()  # one close's check and claim at a time

    # -- sizes ------------------------------------------------------------------------------

    def note_save(self, size: int) -> None:
        with self._lock:
            self._recent.append(size)

    def expected(self) -> int:
        """The size to make room for: the largest of the recent saves."""
        with self._lock:
            return max(self._recent, default=0)

    # -- the store --------------------------------------------------------------------------

    def store_free(self) -> int:
        sv = os.statvfs(self.store_root)
        return sv.f_bavail * sv.f_frsize

    def store_refusal(self, size: int | None = None) -> OSError | None:
        """Why a new save must be refused now (None: it may go on); blocking (statvfs). ``size``:
        the save's at its close; None: at its open, the expected size."""
        trouble = self.ingester.degraded()
        if trouble is not None:
            code = trouble.errno if trouble.errno in REFUSABLE else errno.EIO
            return self._refusing_now(OSError(code, f"the store cannot take the saves staged: {trouble.strerror}"))
        unstored = self.unstored_data()
        size = self.expected() if size is None else size
        if unstored + size == 0:
            return None  # nothing known yet: the close checks the save's own size
        need = overhead(unstored + size)
        free = self.store_free()
        if free < need:
            return self._refusing_now(OSError(errno.ENOSPC, f"the store's disk has {free >> 20} MiB free: "
                                              f"{unstored >> 20} MiB of saves wait to be stored and a save "
                                              f"takes up to {size >> 20} MiB"))  # fmt: skip
        if self._refusing:
            self._refusing = False
            log.warning("the store takes new saves again (%d MiB free)", free >> 20)
        return None

    def claim(self, size: int) -> Claim:
        claim = Claim(self, size)
        with self._lock:
            self._claims.add(claim)
        return claim

    def release(self, claim: Claim) -> None:
        with self._lock:
            self._claims.discard(claim)

    def claimed(self) -> int:
        """The room held by the saves admitted at their close and not stored yet."""
        with self._lock:
            return sum(c.size for c in self._claims)

    def unstored_data(self) -> int:
        """The data bytes of the saves not stored yet (a sparse file's holes take no room in the
        store: they are one chunk of zeros): the room each admitted save claims, and for one queued
        without a claim (staged before the last stop), its file's data (a ``stat``: blocking)."""
        total = self.claimed()
        for job in self.ingester.unstored():
            if job.claim is not None:
                continue
            try:
                st = os.stat(job.path)
            except OSError:
                continue
            total += min(st.st_size, st.st_blocks * 512)
        return total

    def _refusing_now(self, e: OSError) -> OSError:
        with self._lock:
            self.refused += 1
            first, self._refusing = not self._refusing, True
        log.log(logging.ERROR if first else logging.DEBUG, "new saves refused (%s): %s",
                errno.errorcode.get(e.errno or 0, e.errno), e.strerror)  # fmt: skip
        return e

    # -- the whole-file directory -----------------------------------------------------------

    def shortfall(self, writing: Iterable[int]) -> int:
        """Bytes the whole-file directory lacks for a new save, hot copies evicted first; 0 if it
        has room (blocking). ``writing``: the sizes of the files open for writing now."""
        expected = self.expected()
        need = expected + sum(max(0, expected - size) for size in writing) + TORN_FREE
        if expected == 0 or self.whole.short:  # memory short: saves are stored at their close, not staged
            return 0
        return max(0, need - self.whole.make_room(need))

    def can_make_room(self) -> bool:
        """Whether ingestion is storing saves (each one's staged file then leaves, or becomes a
        hot copy that can be evicted)."""
        return self.ingester.backlog()[0] > 0 and self.ingester.degraded() is None

    def at_open(self, writing: Iterable[int]) -> tuple[OSError | None, int]:
        """One look for an open for writing (blocking): why it is refused, else the whole-file
        directory's shortfall (``shortfall``)."""
        error = self.store_refusal()
        return error, 0 if error is not None else self.shortfall(writing)

    def at_close(self, content: FileContent) -> tuple[OSError | None, Claim | None]:
        """Why a staged save must not be committed (blocking), else the room it claims on the
        store's disk until stored (released by the caller if it is not queued for ingestion);
        then it counts among the recent saves. Its size is the bytes its file holds (a hole is no
        data: stored as one chunk of zeros), plus the index entries of its length."""
        fd = content.whole_fd()
        if fd < 0:
            return None, None
        st = os.fstat(fd)
        data = min(st.st_size, st.st_blocks * 512)
        size = needed(st)
        with self._admitting:  # another close's check cannot miss this one's claim
            error = self.store_refusal(size)
            if error is None and self.torn(content):
                error = OSError(errno.ENOSPC, "a write to it may have failed: the whole-file directory is full")
            if error is not None:
                return error, None
            self.note_save(data)
            return None, self.claim(size)

    def note_failed_write(self, content: object) -> None:
        self._torn.add(content)

    def torn(self, content: object) -> bool:
        """Whether a write to ``content`` failed, or may have (its file written by the kernel:
        passed through, the directory nearly full now): its save is not committed."""
        return content in self._torn or self.whole.fs_free() < TORN_FREE
