"""The daemon's catalog: every snapshot's row and token prefix, kept up to date by change events.

``catalog.snapshots`` reads every stub per call; a daemon serving tens of thousands of snapshots
cannot. ``LiveCatalog`` reads all stubs once (in the background, after mounting) and afterwards
only the paths the repository reports as changed (``Repository.watch``): saves, renames, unlinks,
metadata updates. Listings, totals and the prefix tree are then answered from memory.

Why it stays right: every change to ``snapshots/`` made while the daemon runs goes through the
repository (or ``Operations``, which reports xattr updates and creates), and each change is reported
*after* it happened. Refreshing a path reads its state at refresh time, which is at least as new as
the event, so once the queue of reported paths is drained every path equals what a full scan would
read. The events only go into a list under a lock that is never held across I/O, so the FUSE thread
never waits for a listing. Entries made or removed in ``snapshots/`` itself, not through the mount,
are noticed by the directory watcher (``dirwatch.py``) before each answer.

Unique and shared bytes are kept per snapshot by a reference count over distinct chunk ids
(``idarrays.RefCounts``: numpy arrays, no Python object per chunk): each distinct id has a slot
holding the id, its count and the xor of the numbers of the snapshots naming it, so when a count
falls to one the xor names the last holder, whose unique bytes grow by the chunk's length. A row
keeps the slots of its distinct chunks and their lengths (8 bytes a chunk); the counts take 44
bytes a distinct chunk of the store. A stub is read a piece of its index at a time (its token
prefix from the first piece: ``stubread.py``), so a load never holds an index of a million chunks
whole.

GC's collection of the changes (maint/gcchanges.py) asks ``unnamed`` which of some ids no snapshot names:
the ids whose count fell to zero since its last question, plus the ids the store mapped meanwhile.
The answer is only as good as the rows, so it is None while any row's chunks are unknown (a stub
that could not be read or decoded): GC then walks the stubs itself.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import dataclasses
import gc
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvchunkfs.format import idarrays
from kvchunkfs.formula import Formula
from kvchunkfs.service import catalog, prefixtree
from kvchunkfs.service.dirwatch import DirWatcher
from kvchunkfs.service.stubread import NO_SLOTS, Read, ReadChunks, StubReader, entries_in
from kvchunkfs.service.tokenorder import TokenOrder
from kvchunkfs.store import stubs

log = logging.getLogger(__name__)

_SID_LIMIT = 1 << 32  # snapshot numbers are 32-bit (``RefCounts.xor``)
# Rows read so far are moved out of the cyclic garbage collector's sight (``gc.freeze``) every so
# many: they live as long as their snapshot, hold no cycles (reference counting frees them), and a
# full collection scanning millions of catalog objects held the GIL, and so the FUSE thread, for
# 100s of ms (a 270 ms stall of a file read after a 50,000-row listing; a load that slowed down as
# it grew).
FREEZE_EVERY = 4096
DROPPED_MAX = 1 << 18  # ids kept for GC between its questions; past it GC walks every stub


@dataclass
class Entry:
    """One snapshot: its listing fields, its distinct chunks and its token prefix."""

    sid: int
    info: catalog.StubInfo  # ``lengths`` empty: the chunks are ``slots``/``lens``
    slots: np.ndarray  # the ``RefCounts`` slots of its distinct chunks (uint32)
    lens: np.ndarray  # their lengths (uint32; uint64 if a stub claims a chunk of 4 GiB or more)
    distinct: int
    distinct_bytes: int
    unique: int = 0
    tokens: array.array | None = None
    token_error: str | None = None


@dataclass
class PrefixMatch:
    """A snapshot sharing ``match`` leading tokens with a query; ``tokens`` is its own count."""

    path: str
    match: int
    tokens: int
    labels: dict[str, str]


class LiveCatalog:
    def __init__(self, snapshots_dir: Path, read_chunks: ReadChunks | None = None,
                 ids_with_keys: Callable[[list[bytes]], list[bytes]] | None = None) -> None:  # fmt: skip
        self.snapshots_dir = snapshots_dir
        # The store's ids that begin with some keys (``ChunkMap.ids_with_keys``): the counts keep
        # keys (``idarrays.KEY_LEN`` bytes), GC deletes by id.
        self.ids_with_keys = ids_with_keys
        self._lock = threading.Lock()  # the catalog itself; held across stub reads, never by FUSE
        self._queue_lock = threading.Lock()  # only list operations under it
        self._queue: list[str] = []
        self._ready = threading.Event()
        self.entries: dict[str, Entry] = {}
        self._refs = idarrays.RefCounts()
        self._stubs = StubReader(snapshots_dir, self._refs, read_chunks)
        self._by_sid: dict[int, Entry] = {}
        self._next_sid = 1
        self._sorted: list[str] | None = None
        self._token_order = TokenOrder()  # the rows with a token prefix, in token order
        self._dirs: dict[str, int] = {}
        self._watcher = DirWatcher(snapshots_dir, self.changed)
        self.logical_bytes = 0
        self.referenced_bytes = 0
        self._broken = 0  # rows whose chunks are unknown (``info.error``)
        # Keys whose count fell to 0 since GC asked (``RefCounts.keys`` rows); None: too many.
        self._dropped: list[np.ndarray] | None = []
        self._dropped_n = 0
        self.load_seconds = 0.0
        self.generation = 0  # bumped by every row added or dropped

    # -- events (any thread, cheap) ----------------------------------------------------------

    def changed(self, *paths: str) -> None:
        """``paths`` (files or directories, relative to snapshots/) may have changed."""
        with self._queue_lock:
            self._queue.extend(paths)

    # -- loading and refreshing ----------------------------------------------------------------

    def start(self, first: Callable[[], object] | None = None) -> threading.Thread:
        """Read every stub in a background thread (after ``first``); requests wait for it (``wait``)."""
        thread = threading.Thread(target=self.load, args=(first,), name="kvcfs-catalog", daemon=True)
        thread.start()
        return thread

    def load(self, first: Callable[[], object] | None = None) -> None:
        start = time.monotonic()
        try:
            if first is not None:
                first()
            with self._lock:
                self._refresh_dir("")
        except Exception:  # noqa: BLE001 - a listing then loads what it can on its own
            log.exception("loading the snapshot catalog failed")
        finally:
            self.load_seconds = time.monotonic() - start
            self._ready.set()
        log.info("catalog: %d snapshots read in %.2fs", len(self.entries), self.load_seconds)

    def wait(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def refresh(self) -> None:
        """Apply the reported changes (callers hold ``_lock``)."""
        self._watcher.watch_dirs()
        while True:
            with self._queue_lock:
                paths, self._queue = self._queue, []
            if not paths:
                return
            for rel in dict.fromkeys(paths):
                self._refresh_path(rel)

    def _refresh_path(self, rel: str) -> None:
        try:
            mode = os.lstat(self.snapshots_dir / rel).st_mode
        except OSError:
            mode = 0  # gone (or unreachable): no rows at or below it
        if stat.S_ISREG(mode):
            self._drop_below(rel)
            self._read(rel)
            parent = rel.rpartition("/")[0]
            if not self._watcher.watched(parent):  # e.g. made by mkdir through the mount: watch it too
                self._watcher.register_dirs(parent)
        elif stat.S_ISDIR(mode):
            self._drop(rel)
            self._refresh_dir(rel)
        else:
            self._drop(rel)
            self._drop_below(rel)

    def _refresh_dir(self, rel: str) -> None:
        """Re-read every stub under directory ``rel`` and forget rows of files no longer there."""
        self._watcher.register_dirs(rel)
        base = f"{rel}/" if rel else ""
        paths = [base + entry.rel for entry in stubs.walk(self.snapshots_dir / rel) if entry.kind == "file"]
        seen = set(paths)
        if not self.entries:  # the first load: room for as many ids as the stubs may name
            self._refs.reserve(sum(entries_in(self.snapshots_dir / p) for p in paths))
        # One thread: 8 reading stubs in parallel loaded 50,000 no faster with the page cache
        # warm (20.9/19.8 s against 19.6/15.8 s) and only unevenly faster cold (20.9/29.1 s
        # against 35.8/27.1 s): the work is Python under the GIL.
        for n, path in enumerate(paths):
            self._read(path)
            if n % FREEZE_EVERY == FREEZE_EVERY - 1:
                gc.freeze()
        gc.freeze()
        for path in [p for p in self._paths_below(rel) if p not in seen]:
            self._drop(path)

    def _paths_below(self, rel: str) -> list[str]:
        if not rel:
            return list(self.entries)
        if not self._dirs.get(rel):  # no row below: skip the scan (a save is not a directory change)
            return []
        prefix = rel + "/"
        return [p for p in self.entries if p.startswith(prefix)]

    def _drop_below(self, rel: str) -> None:
        if rel:
            for path in self._paths_below(rel):
                self._drop(path)

    def _count_dirs(self, rel: str, step: int) -> None:
        """Rows below each ancestor directory of ``rel``, so a file event need not scan for them."""
        self._watcher.note_row(rel, step)
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            self._dirs[d] = self._dirs.get(d, 0) + step

    def _read(self, rel: str) -> None:
        if self._metadata_only(rel):
            return
        # Dropped first: the slots a read makes for new ids must be counted before anything
        # tidies the counts (``RefCounts.tidy`` frees slots whose count is 0).
        self._drop(rel)
        try:
            read = self._stubs.read(rel)
        except FileNotFoundError:
            return
        except OSError as e:
            read = Read(catalog.StubInfo(rel, 0, 0, {}, 0.0, 0, None, {}, error=str(e)), NO_SLOTS, NO_SLOTS)
        if read.info.error is not None:
            read.token_error = read.info.error
        self._add(read)

    def _metadata_only(self, rel: str) -> bool:
        """Refresh only the row's metadata if its stub still holds the same index (a use, a label:
        xattrs): its chunks, counts and tokens stay, and an index of a million chunks is not
        decoded and counted again. False if the row must be read whole."""
        entry = self.entries.get(rel)
        if entry is None or entry.info.digest is None:
            return False
        try:
            if not catalog.same_index(self.snapshots_dir, rel, entry.info.digest):
                return False
            info = dataclasses.replace(entry.info)
            catalog.read_metadata(self.snapshots_dir / rel, info)
        except OSError:  # gone or unreadable now: read whole (drops or marks the row)
            return False
        entry.info = info
        self._sorted = None
        self.generation += 1
        return True

    def _new_sid(self) -> int:
        sid = self._next_sid
        while sid in self._by_sid or not 0 < sid < _SID_LIMIT:  # wrapped around: skip those in use
            sid = sid % (_SID_LIMIT - 1) + 1
        self._next_sid = sid + 1
        return sid

    def _add(self, read: Read) -> None:
        info, slots, lens = read.info, read.slots, read.lens
        sid = self._new_sid()
        entry = Entry(sid, info, slots, lens, len(slots), _total(lens), tokens=read.tokens,
                      token_error=read.token_error)  # fmt: skip
        refs = self._refs
        count = refs.count[slots]
        entry.unique = _total(lens, count == 0)
        self.referenced_bytes += entry.unique
        self._move_unique(slots, lens, count == 1, -1)
        count += 1
        refs.count[slots] = count
        del count
        np.bitwise_xor.at(refs.xor, slots, np.uint32(sid))
        refs.tidy()
        self.entries[info.path] = entry
        self._by_sid[sid] = entry
        self._broken += info.error is not None
        if read.tokens is not None:
            self._token_order.insert(read.tokens, info.path)
        self.logical_bytes += info.size
        self._count_dirs(info.path, 1)
        self._sorted = None
        self.generation += 1

    def _move_unique(self, slots: np.ndarray, lens: np.ndarray, only: np.ndarray, sign: int) -> None:
        """Add ``sign`` * the length of each chunk ``only`` picks to the unique bytes of the snapshot
        its xor names (its count is one: the xor is its one holder's number)."""
        if not only.any():
            return
        who, at = np.unique(self._refs.xor[slots[only]], return_inverse=True)
        sums = np.zeros(len(who), np.int64)
        np.add.at(sums, at.ravel(), lens[only])
        for sid, n in zip(who.tolist(), sums.tolist(), strict=True):
            self._by_sid[sid].unique += sign * n

    def _drop(self, rel: str) -> None:
        entry = self.entries.pop(rel, None)
        if entry is None:
            return
        del self._by_sid[entry.sid]
        if entry.tokens is not None:
            self._token_order.remove(entry.tokens, rel)
        refs, slots, lens = self._refs, entry.slots, entry.lens
        count = refs.count[slots]
        count -= 1
        refs.count[slots] = count
        np.bitwise_xor.at(refs.xor, slots, np.uint32(entry.sid))
        gone = count == 0
        self.referenced_bytes -= _total(lens, gone)
        self._note_dropped(refs.keys[slots[gone]])
        self._move_unique(slots, lens, count == 1, 1)
        del count, gone
        refs.tidy()
        self.logical_bytes -= entry.info.size
        self._broken -= entry.info.error is not None
        self._count_dirs(rel, -1)
        self._sorted = None
        self.generation += 1

    def _note_dropped(self, keys: np.ndarray) -> None:
        if self._dropped is not None and len(keys):
            self._dropped.append(keys)
            self._dropped_n += len(keys)
            if self._dropped_n > DROPPED_MAX:
                self._dropped = None

    # -- queries (each takes the catalog lock and applies pending changes first) ------------------

    def unnamed(self, ids: Iterable[bytes]) -> set[bytes] | None:
        """GC's question: after applying every reported change, which of ``ids`` and of the ids whose
        last snapshot went since the previous call no snapshot names. None if that cannot be told:
        a row's chunks are unknown, or more ids went than were kept (GC then walks every stub)."""
        with self._reading():
            dropped, self._dropped, self._dropped_n = self._dropped, [], 0
            if dropped is None or self._broken or (dropped and self.ids_with_keys is None):
                return None
            asked = list(dict.fromkeys([*ids, *self._ids_of(dropped)]))
            if not asked:
                return set()
            slots = self._refs.find(idarrays.from_list(asked))
            named = slots != idarrays.NONE
            named[named] = self._refs.count[slots[named]] > 0
            return {cid for cid, is_named in zip(asked, named.tolist(), strict=True) if not is_named}

    def _ids_of(self, dropped: list[np.ndarray]) -> list[bytes]:
        """The store's ids under the dropped keys that are still not named."""
        if not dropped:
            return []
        keys = np.concatenate(dropped)
        slots = self._refs.find_keys(keys)
        named = slots != idarrays.NONE
        named[named] = self._refs.count[slots[named]] > 0
        assert self.ids_with_keys is not None
        return self.ids_with_keys(idarrays.key_bytes(np.unique(keys[~named], axis=0)))

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """The catalog, loaded and with every reported change applied. Waits for the load *before*
        taking the lock: the loading thread holds it until it is done."""
        self._ready.wait()
        with self._lock:
            self.refresh()
            yield

    def current_generation(self) -> int:
        """The generation after applying pending changes (equal generations: the same rows)."""
        with self._reading():
            return self.generation

    def sorted_paths(self) -> list[str]:
        if self._sorted is None:
            self._sorted = sorted(self.entries)
        return self._sorted

    def rows(self, formula: Formula | None, paths: Iterable[str] | None = None, now: float | None = None
             ) -> list[catalog.Snapshot]:  # fmt: skip
        """Listing rows of ``paths`` (default: all, in path order)."""
        with self._reading():
            now = time.time() if now is None else now
            chosen = self.sorted_paths() if paths is None else paths
            rows = [self._row(self.entries[p], now) for p in chosen if p in self.entries]
        if formula is not None:
            scores = formula.evaluate_many(_columns(formula, [catalog.formula_fields(r) for r in rows]), len(rows))
            for row, score in zip(rows, scores, strict=True):
                row.score = score
        return rows

    def page(self, formula: Formula | None, after: str, limit: int, prefix: str = "", descending: bool = False
             ) -> tuple[list[dict], int]:  # fmt: skip
        """(up to ``limit`` rows (``Snapshot.to_dict`` form) after ``after`` in path order under ``prefix``,
        rows under ``prefix``)."""
        with self._reading():
            paths = self.sorted_paths()
            lo = bisect.bisect_left(paths, prefix) if prefix else 0
            hi = bisect.bisect_left(paths, prefix + "\U0010ffff") if prefix else len(paths)
            if descending:
                end = bisect.bisect_left(paths, after, lo, hi) if after else hi
                chosen = paths[max(lo, end - limit) : end][::-1]
            else:
                begin = bisect.bisect_right(paths, after, lo, hi) if after else lo
                chosen = paths[begin : min(hi, begin + limit)]
            now = time.time()
            rows = [self._row_dict(self.entries[p], now) for p in chosen]
        if formula is not None:
            scores = formula.evaluate_many(_columns(formula, rows), len(rows))
            for row, score in zip(rows, scores, strict=True):
                row["score"] = catalog.json_float(score)
        return rows, hi - lo

    def _row_dict(self, entry: Entry, now: float) -> dict:
        """``_row(...).to_dict()`` (without a score) built straight from the entry: a listing of
        50,000 rows makes no ``Snapshot`` objects, and nothing per row is kept between listings."""
        info = entry.info
        path = info.path
        out = {
            "path": path if path.isascii() else catalog.display_name(path),
            "size": info.size,
            "chunks": info.chunks,
            "distinct_chunks": entry.distinct,
            "unique_bytes": entry.unique,
            "shared_bytes": entry.distinct_bytes - entry.unique,
            "use_count": info.use_count,
            "last_use": info.last_use,
            "created": info.created,
            "age_hours": max(0.0, (now - info.created) / catalog.HOUR),
            "idle_hours": max(0.0, (now - (info.last_use or info.created)) / catalog.HOUR),
            "labels": {catalog.display_name(k): catalog.display_name(v) for k, v in info.labels.items()}
            if info.labels
            else {},
            "score": 0.0,
        }
        if not path.isascii():
            out.update(catalog.path_fields(path))
        for key, why in (("error", info.error), ("broken", info.broken)):  # a row that cannot be read in full
            if why is not None:
                out[key] = catalog.display_name(why)
        return out

    def _row(self, entry: Entry, now: float) -> catalog.Snapshot:
        info = entry.info
        row = catalog.Snapshot(
            path=info.path,
            size=info.size,
            chunks=info.chunks,
            distinct_chunks=entry.distinct,
            unique_bytes=entry.unique,
            shared_bytes=entry.distinct_bytes - entry.unique,
            use_count=info.use_count,
            last_use=info.last_use,
            created=info.created,
            age_hours=max(0.0, (now - info.created) / catalog.HOUR),
            idle_hours=max(0.0, (now - (info.last_use or info.created)) / catalog.HOUR),
            labels=info.labels,
            error=info.error,
            broken=info.broken,
        )
        return row

    def totals(self) -> tuple[int, int, int, int]:
        """(snapshots, logical bytes, referenced bytes, broken snapshots)."""
        with self._reading():
            broken = sum(1 for e in self.entries.values() if catalog.unreadable(e.info))
            return len(self.entries), self.logical_bytes, self.referenced_bytes, broken

    def prefix_match(self, tokens: list[int], prefix: str = "", exclude_suffix: str = "", limit: int = 1
                     ) -> list[PrefixMatch]:  # fmt: skip
        """The snapshots under ``prefix`` sharing the longest common token prefix with ``tokens``, best
        first (longest match, then fewest tokens: the least to restore), at most ``limit``, none with no
        common token.

        In token order, the common prefix with the query only shrinks moving away from the query's
        place, on either side: walking outwards from there, always on the side with the longer match,
        visits rows best first, and the walk stops once ``limit`` rows are found and the next is
        shorter. Cost: the rows sharing the best matches (a system prompt's conversations), not N.
        """
        want = array.array("i", tokens)
        found: list[PrefixMatch] = []
        with self._reading():
            for path, n, count in self._token_order.best_first(want):
                if len(found) >= limit and n < found[limit - 1].match:
                    break
                if path.startswith(prefix) and not (exclude_suffix and path.endswith(exclude_suffix)):
                    found.append(PrefixMatch(path, n, count, dict(self.entries[path].info.labels)))
        found.sort(key=lambda m: (-m.match, m.tokens, m.path))
        return found[:limit]

    def token_tree(self, prefix: str = "") -> tuple[prefixtree.Node, dict[str, str]]:
        prefix = prefix.lstrip("/")
        names = catalog.display_name
        with self._reading():  # the token-ordered index: no sort, no copies of the token arrays
            entries, lcp = self._token_order.under(prefix, names)
            skipped = {names(p): names(e.token_error or "") for p, e in self.entries.items()
                       if e.tokens is None and p.startswith(prefix)}  # fmt: skip
        return prefixtree.build_sorted(entries, lcp), skipped

    def freed_together(self, paths: Iterable[str]) -> tuple[int, int, list[str]]:
        """(bytes, chunks) that deleting all of ``paths`` together would free, and the paths not found.

        A chunk is freed when every snapshot naming it is among ``paths``: its reference count equals
        the number of chosen snapshots naming it. More than the sum of their ``unique_bytes`` when
        they share chunks only with each other (turns of one conversation)."""
        with self._reading():
            chosen = [self.entries[p] for p in dict.fromkeys(paths) if p in self.entries]
            missing = [p for p in dict.fromkeys(paths) if p not in self.entries]
            if not chosen:
                return 0, 0, missing
            slots = np.concatenate([e.slots for e in chosen])
            lens = np.concatenate([e.lens.astype(np.int64) for e in chosen])
            seen, first, times = np.unique(slots, return_index=True, return_counts=True)
            freed = self._refs.count[seen] == times
            return int(lens[first][freed].sum()), int(np.count_nonzero(freed)), missing

    def recount(self) -> dict[str, tuple[int, int]]:
        """path -> (unique, shared) recounted from scratch, for checks (``verify``)."""
        with self._reading():
            counts = np.zeros(self._refs.n, np.int64)
            for entry in self.entries.values():
                np.add.at(counts, entry.slots, 1)
            out = {}
            for path, entry in self.entries.items():
                unique = int(entry.lens.astype(np.int64)[counts[entry.slots] == 1].sum())
                out[path] = (unique, entry.distinct_bytes - unique)
            return out


def _total(lens: np.ndarray, where: np.ndarray | None = None) -> int:
    """The sum of ``lens`` (where ``where`` is set), as a Python int (no widened copy)."""
    if where is None:
        return int(lens.sum(dtype=np.int64))
    return int(np.sum(lens, where=where, dtype=np.int64))


def _columns(formula: Formula, rows: list[dict]) -> dict[str, list[float]]:
    """The fields ``formula`` reads, a list of floats each, from rows in ``Snapshot.to_dict`` form
    (``last_use``: 0 for never used, as ``catalog.formula_fields`` gives)."""
    out = {}
    for name in formula.names:
        if name == "last_use":
            out[name] = [float(r["last_use"] or 0.0) for r in rows]
        else:
            out[name] = [float(r[name]) for r in rows]
    return out
