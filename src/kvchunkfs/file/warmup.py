"""The warm-up: after a reboot, the hot tier is filled again before clients ask.

A mount that finds the memory tier empty (a reboot wiped it; a new directory, as after a stop with
``memory_tier_on_stop = free``) puts the snapshots most recently used back into the hot tier, in a
thread of its own at low priority, until their bytes reach ``warm_up`` (a share of the hot copies'
budget): their first restore is then a plain read of a whole copy, not a put-back from chunks.

**Which.** Most recently used first: each stub's ``last_use`` (its last restore) or its modification
time (its last save), whichever is later; ties by ``use_count``. Snapshots that do not fit what is
left of the budget are passed over for smaller ones. Recency, not the score: the hot tier itself
keeps copies by recency (least recently used evicted), so this rebuilds what it held before the
reboot; llama-server's conversations come back most recent first; and recency is one stat and one
attribute per stub, known at mount, where the score needs the catalog (docs/memory.md).

**Clients first.** Before each snapshot and before each piece of one (``Restore.scatter``'s, about
1 MiB), the warm-up waits while a client's restore is under way (``Files.restores``) or a save waits
in the tier to be stored, so a client's restore waits at most for the piece in hand. It reads with
one worker of its own at low priority (a client's put-back has three of the restore pool's). A
client's open of the very snapshot being warmed does its own put-back, and the warm-up's copy is
then dropped. Its copies are first in line for eviction, so a client's copy, or a save, never goes
for one of them.

**Stops** when the budget is filled, when memory is short (``WholeFiles.short``: the copy being made
is dropped; the pressure watcher evicts warmed copies first), when the tier's room is what the
budget leaves clients (``tier_size`` less the budget: staged saves are taking it), and at unmount.

``put_back`` is the one call into the restore path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvchunkfs.file.files import Files, _hot_key
from kvchunkfs.file.queues import lower_priority
from kvchunkfs.format.index import Index
from kvchunkfs.store import stubs
from kvchunkfs.store.packs import Location
from kvchunkfs.store.wholefiles import WholeFiles

log = logging.getLogger(__name__)

READERS = 1  # workers reading the warm-up's pieces
POLL = 0.02  # seconds between looks while waiting for clients
# Tests: while the file it names exists, the warm-up waits after each piece once it has written the
# number of pieces the file holds (none: from the first).
HOLD_ENV = "KVCFS_WARM_UP_HOLD"


class Stopped(Exception):
    """The warm-up must stop (why: the message)."""


def put_back(files: Files, rel: str, scatter: Callable[..., Generator[int, None, None]]) -> int:
    """Put the snapshot at ``rel`` back into the hot tier, its stored bytes read through ``scatter``
    and checked against its file record as a restore's are; the bytes put back (0: none needed: a
    copy is there already, the snapshot is empty or staged, or has chunks only the bucket has,
    which a client's open fetches). Blocking."""
    whole = files.repo.whole
    content = files._load(rel)
    try:
        key = _hot_key(content)
        if whole is None or content.staged is not None or key is None or whole.hot_has(key) or not content.all_local:
            return 0
        files.restore.warm(content, rel, key, scatter)
        return content.index.size
    finally:
        content.close()


@dataclass
class Candidate:
    rel: str
    size: int
    recency: float  # later of last use and last save (epoch seconds)
    uses: int


def ranked(files: Files) -> list[Candidate]:
    """Every snapshot with bytes and no staged save, most recently used first (blocking: one stat
    and a few attribute reads per stub)."""
    remote = files.repo.remote
    found: list[Candidate] = []
    for entry in stubs.walk(files.repo.snapshots):
        if entry.kind != "file":
            continue
        try:
            fd = entry.open()
        except OSError:
            continue
        try:
            size = stubs.stub_size(fd) or 0
            if not size or stubs.read_staged(fd) is not None:
                continue
            mtime = os.fstat(fd).st_mtime
            last = _attr(fd, stubs.LAST_USE, float)
            uses = int(_attr(fd, stubs.USE_COUNT, int))
        except (OSError, ValueError):
            continue
        finally:
            os.close(fd)
        if remote is not None and remote.is_partial(entry.rel):
            continue  # chunks only the bucket has: not fetched over the network ahead of a client
        found.append(Candidate(entry.rel, size, max(last, mtime), uses))
    found.sort(key=lambda c: (c.recency, c.uses), reverse=True)
    return found


def _attr(fd: int, name: str, kind: Callable[[str], float]) -> float:
    try:
        return kind(os.getxattr(fd, name).decode())
    except (OSError, ValueError):
        return 0


def choose(candidates: list[Candidate], budget: int) -> list[Candidate]:
    """The candidates, in their order, whose sizes fit ``budget`` together (one that does not fit
    what is left is passed over for the next)."""
    out, left = [], budget
    for c in candidates:
        if c.size <= left:
            out.append(c)
            left -= c.size
    return out


class WarmUp:
    """The warm-up of one mount (``start`` at mount if the tier was found empty, ``close`` at unmount)."""

    def __init__(self, files: Files, whole: WholeFiles, share: float) -> None:
        self.files = files
        self.whole = whole
        self.budget = int(whole.budget * share) if share > 0 else 0
        self.warming = False
        self.planned = 0  # snapshots chosen
        self.warmed = 0  # ... put back
        self.warmed_bytes = 0
        self.skipped = 0  # chosen, but needing no copy, or failed (logged)
        self.pieces = 0
        self.yields = 0  # times it found a client's restore or save under way and waited
        self.stopped_short = False  # it stopped because memory was short
        self.elapsed = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="warm-up", daemon=True)
        # Its own reader, at low priority too: a client's put-back has the restore pool's workers.
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="warm-up-read", initializer=lower_priority)

    def start(self) -> None:
        if self.budget > 0:
            self.warming = True
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._readers.shutdown(wait=False)

    def stats(self) -> dict[str, int]:
        return {
            "warm_up_budget": self.budget,
            "warm_up_warming": int(self.warming),
            "warm_up_planned": self.planned,
            "warm_up_files": self.warmed,
            "warm_up_bytes": self.warmed_bytes,
            "warm_up_skipped": self.skipped,
            "warm_up_pieces": self.pieces,
            "warm_up_yields": self.yields,
            "warm_up_stopped_short": int(self.stopped_short),
            "warm_up_ms": int(self.elapsed * 1000),
            "restores_loading": int(self.files.restores.busy()),
        }

    def _run(self) -> None:
        lower_priority()
        start = time.monotonic()
        why = "done"
        try:
            chosen = choose(ranked(self.files), self.budget)
            self.planned = len(chosen)
            log.info("warm-up: %d snapshots (%d MiB) to put back into the memory tier, most recently used first, "
                     "within %d MiB", len(chosen), sum(c.size for c in chosen) >> 20, self.budget >> 20)  # fmt: skip
            for c in chosen:
                self._gate()
                self._room(c.size)
                self._warm(c)
        except Stopped as e:
            why = str(e)
        except Exception:  # never let it take the daemon down: a warm-up is a cache's
            log.exception("the warm-up failed")
            why = "failed"
        finally:
            self.elapsed = time.monotonic() - start
            self.warming = False
        mib = self.warmed_bytes / (1 << 20)
        log.info("warm-up %s: %d of %d snapshots (%.0f MiB) put back in %.1f s (%.0f MiB/s), %d skipped; it waited "
                 "for clients %d times", why, self.warmed, self.planned, mib, self.elapsed,
                 mib / self.elapsed if self.elapsed else 0, self.skipped, self.yields)  # fmt: skip

    def _warm(self, c: Candidate) -> None:
        try:
            n = put_back(self.files, c.rel, self._scatter)
        except Stopped:
            raise
        except (OSError, ValueError) as e:  # StubError, ChunkMissing, ChunkCorrupt, ENOSPC: a client's open says
            self.skipped += 1
            gone = isinstance(e, FileNotFoundError)
            log.log(logging.DEBUG if gone else logging.WARNING, "warm-up: %s not put back: %s", c.rel, e)
            return
        if n:
            self.warmed += 1
            self.warmed_bytes += n
        else:
            self.skipped += 1

    def _scatter(
        self, index: Index, write: Callable[[int, memoryview], None], locations: dict[bytes, Location] | None
    ) -> Generator[int, None, None]:
        """``Restore.scatter`` with one reader, each piece written only when no client waits."""

        def gated(pos: int, view: memoryview) -> None:
            self._gate(count=True)
            write(pos, view)
            self.pieces += 1
            self._hold()

        inner = self.files.restore.scatter(index, gated, locations, readers=READERS, executor=self._readers)
        try:
            for done in inner:
                self._gate()
                yield done
        finally:
            inner.close()

    def _hold(self) -> None:
        hold = os.environ.get(HOLD_ENV)
        while hold and not self._stop.is_set():
            try:
                after = int(Path(hold).read_text().strip() or 0)
            except (OSError, ValueError):
                return
            if self.pieces < after:
                return
            time.sleep(POLL)

    def _gate(self, count: bool = False) -> None:
        """Return once no client's restore or save is under way; Stopped if the warm-up must stop."""
        waited = False
        while True:
            if self._stop.is_set():
                raise Stopped("stopped at unmount")
            if self.whole.short:
                self.stopped_short = True
                raise Stopped("stopped: memory is short")
            restores = self.files.restores
            if restores.busy():
                restores.wait_idle(POLL)
            elif self.whole.staged_bytes()[0]:  # a save waits to be stored (or a file is being rewritten)
                self._stop.wait(POLL)
            else:
                return
            if count and not waited:
                self.yields += 1
            waited = True

    def _room(self, size: int) -> None:
        """Stopped if putting back ``size`` bytes would leave clients less room than the budget leaves them."""
        keep = self.whole.tier_size - self.budget
        if self.whole.room() < size + keep:
            raise Stopped(f"stopped: the memory tier's room is for clients ({self.whole.room() >> 20} MiB left)")


def tier_empty(whole: WholeFiles) -> bool:
    """Whether the tier holds neither a hot copy nor a staged save (what a mount found: call it first)."""
    try:
        return not whole.hot_usage()[0] and not whole.staged_names()
    except OSError:
        return False
