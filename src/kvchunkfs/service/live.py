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
never waits for a listing.

Unique and shared bytes are kept per snapshot by a reference count over distinct chunk ids
(``idarrays.RefCounts``: numpy arrays, no Python object per chunk): each distinct id has a slot
holding the id, its count and the xor of the numbers of the snapshots naming it, so when a count
falls to one the xor names the last holder, whose unique bytes grow by the chunk's length. A row
keeps the slots of its distinct chunks and their lengths (8 bytes a chunk); the counts take 44
bytes a distinct chunk of the store. A stub is read a piece of its index at a time (its token
prefix from the first piece), so a load never holds an index of a million chunks whole.

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
from kvchunkfs.format import index as idx
from kvchunkfs.format.index import Index
from kvchunkfs.formula import Formula
from kvchunkfs.service import catalog, prefixtree
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
HEAD_ENTRIES = 1 << 12  # index entries read for a token prefix (more only if the header is longer)
ReadChunks = Callable[[Index, int, int], bytes]


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
class Read:
    """What reading a stub gave: its row, its distinct chunks' slots and lengths, its tokens."""

    info: catalog.StubInfo
    slots: np.ndarray
    lens: np.ndarray
    tokens: array.array | None = None
    token_error: str | None = None


NO_SLOTS = np.empty(0, np.uint32)


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
        self.read_chunks = read_chunks
        # The store's ids that begin with some keys (``ChunkMap.ids_with_keys``): the counts keep
        # keys (``idarrays.KEY_LEN`` bytes), GC deletes by id.
        self.ids_with_keys = ids_with_keys
        self._lock = threading.Lock()  # the catalog itself; held across stub reads, never by FUSE
        self._queue_lock = threading.Lock()  # only list operations under it
        self._queue: list[str] = []
        self._ready = threading.Event()
        self.entries: dict[str, Entry] = {}
        self._refs = idarrays.RefCounts()
        self._by_sid: dict[int, Entry] = {}
        self._next_sid = 1
        self._sorted: list[str] | None = None
        # (tokens, path) of every row with a token prefix, in token order: a prefix match looks at
        # the neighbours of the query's place in it instead of at every row (see prefix_match).
        self._by_tokens: list[tuple[array.array, str]] = []
        # _lcp[i]: tokens row i shares with row i-1 (0 for the first): kept with _by_tokens, so the
        # prefix tree is built without comparing neighbours again (prefixtree.build_sorted).
        self._lcp: list[int] = []
        self._dirs: dict[str, int] = {}
        self._children: dict[str, set[str]] = {}  # directory -> names of its rows
        self._dir_mtimes: dict[str, int] = {}  # directories seen -> their mtime when listed
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
        self._watch_dirs()
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
            if parent not in self._dir_mtimes:  # e.g. made by mkdir through the mount: watch it too
                self._register_dirs(parent)
        elif stat.S_ISDIR(mode):
            self._drop(rel)
            self._refresh_dir(rel)
        else:
            self._drop(rel)
            self._drop_below(rel)

    def _register_dirs(self, rel: str) -> None:
        """Note the mtime of ``rel`` and every directory below it, each taken before it is listed."""
        stack = [rel]
        while stack:
            d = stack.pop()
            try:
                mtime = os.lstat(self.snapshots_dir / d).st_mtime_ns
                with os.scandir(self.snapshots_dir / d) as it:
                    subdirs = [e.name for e in it if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            self._dir_mtimes[d] = mtime
            stack += [f"{d}/{name}" if d else name for name in subdirs]

    def _watch_dirs(self) -> None:
        """Notice entries made or removed behind the daemon's back (in ``snapshots/`` itself, not
        through the mount): a directory whose mtime moved is listed again and the names that differ
        from its rows are refreshed. One ``lstat`` per directory, not per stub."""
        for d, seen in list(self._dir_mtimes.items()):
            try:
                mtime = os.lstat(self.snapshots_dir / d).st_mtime_ns
                names = set(os.listdir(self.snapshots_dir / d)) if mtime != seen else None
            except OSError:
                del self._dir_mtimes[d]
                self.changed(d)
                continue
            if names is None:
                continue
            self._dir_mtimes[d] = mtime
            base = f"{d}/" if d else ""
            subdirs = {p[len(base) :] for p in self._dir_mtimes if p != d and p.startswith(base)}
            subdirs = {p for p in subdirs if "/" not in p}
            known = self._children.get(d, set()) | subdirs
            self.changed(*(base + name for name in names ^ known))

    def _refresh_dir(self, rel: str) -> None:
        """Re-read every stub under directory ``rel`` and forget rows of files no longer there."""
        self._register_dirs(rel)
        base = f"{rel}/" if rel else ""
        paths = [base + entry.rel for entry in stubs.walk(self.snapshots_dir / rel) if entry.kind == "file"]
        seen = set(paths)
        if not self.entries:  # the first load: room for as many ids as the stubs may name
            self._refs.reserve(sum(_entries_in(self.snapshots_dir / p) for p in paths))
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
        parent, _, name = rel.rpartition("/")
        children = self._children.setdefault(parent, set())
        if step > 0:
            children.add(name)
        else:
            children.discard(name)
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
            read = self._read_stub(rel)
        except FileNotFoundError:
            return
        except OSError as e:
            read = Read(catalog.StubInfo(rel, 0, 0, {}, 0.0, 0, None, {}, error=str(e)), NO_SLOTS, NO_SLOTS)
        if read.info.error is not None:
            read.token_error = read.info.error
        self._add(read)

    def _read_stub(self, rel: str) -> Read:
        """Read the stub at ``rel`` (one open file throughout: a rename meanwhile changes nothing
        read) a piece of its index at a time; a stub that is not a valid index gives a row with
        ``error``. Its chunks get slots (count 0 until ``_add`` counts them)."""
        path = self.snapshots_dir / rel
        info = catalog.StubInfo(path=rel, size=stubs.stub_size(path) or 0, chunks=0, lengths={}, created=0.0,
                                use_count=0, last_use=None, labels={})  # fmt: skip
        catalog.read_metadata(path, info)
        fd = stubs.open_stub(path)
        try:
            info.digest = stubs.hash_stub(fd).digest()
            try:
                slots, lens = self._count_pieces(fd, path, info)
            except OSError as e:  # StubError, or the bytes ended early
                info.error = str(e)
                return Read(info, NO_SLOTS, NO_SLOTS)
            read = Read(info, slots, lens)
            if self.read_chunks is not None:
                read.tokens, read.token_error = self._tokens_of(fd, path)
            else:
                read.token_error = "no chunk reader"
            return read
        finally:
            os.close(fd)

    def _count_pieces(self, fd: int, path: Path, info: catalog.StubInfo) -> tuple[np.ndarray, np.ndarray]:
        """(slots, lengths) of the distinct chunks of the open stub ``fd`` (the length an id's
        last entry gives, as a dict filled in file order keeps); sets ``info``'s size and chunks.

        Each piece is made distinct on its own; across pieces, from the last one back, a flag per
        slot drops the ones a later piece had: a few bytes a chunk, no sort of the whole."""
        pieces = []
        end = chunks = 0
        try:
            for ends, ids in stubs.read_table(fd):
                lens = np.diff(ends, prepend=np.uint64(end))
                pieces.append(_last_of_each(self._refs.slots(ids), lens))
                end, chunks = int(ends[-1]), chunks + len(ends)
        except idx.IndexFormatError as e:
            raise stubs.StubError(f"{path}: {e}") from e
        size = stubs.stub_size(fd)
        if size is not None and size != end:
            raise stubs.StubError(f"{path}: size xattr {size} does not match index size {end}")
        info.size, info.chunks = end, chunks
        if len(pieces) <= 1:
            return pieces[0] if pieces else (NO_SLOTS, NO_SLOTS)
        seen = np.zeros(self._refs.n, bool)  # touched only where a slot is set
        wide = any(p[1].dtype != np.uint32 for p in pieces)
        # Room for every entry; only the distinct ones are written (the rest is never touched).
        slots = np.empty(sum(len(p[0]) for p in pieces), np.uint32)
        lengths = np.empty(len(slots), np.uint64 if wide else np.uint32)
        n = 0
        while pieces:  # each piece freed once copied
            piece, piece_lens = pieces.pop()
            fresh = ~seen[piece]
            seen[piece] = True
            k = int(np.count_nonzero(fresh))
            slots[n : n + k] = piece[fresh]
            lengths[n : n + k] = piece_lens[fresh]
            n += k
        return slots[:n], lengths[:n]

    def _tokens_of(self, fd: int, path: Path) -> tuple[array.array | None, str | None]:
        """The token prefix, from the first ``HEAD_ENTRIES`` entries of the index (the whole index
        only if the header reaches past them)."""

        def read(offset: int, size: int) -> bytes:
            return os.pread(fd, size, offset)

        length = os.fstat(fd).st_size
        index, n = idx.read_head(read, length, HEAD_ENTRIES)
        tokens, why, reached = self._tokens(index)
        if reached and n > len(index):  # the header may go on past the entries read
            index = stubs.decode_stub(stubs.read_stub(fd)[0], None, path)
            tokens, why, _ = self._tokens(index)
        return tokens, why

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

    def _tokens(self, index: Index) -> tuple[array.array | None, str | None, bool]:
        """(the token prefix, why there is none, whether reading it reached the end of ``index``),
        read once per change of the stub (later trees need no pack reads)."""
        assert self.read_chunks is not None
        reader = catalog.ChunkReader(index, self.read_chunks)
        try:
            tokens = array.array("i", prefixtree.read_tokens(reader))  # type: ignore[arg-type]
            return tokens, None, reader.pos + len(reader._buf) >= index.size
        except (OSError, ValueError, LookupError) as e:  # not a ggsq file, a missing or corrupt chunk
            return None, str(e) or type(e).__name__, reader.pos + len(reader._buf) >= index.size

    # -- reference counts --------------------------------------------------------------------

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
            self._insert_tokens(read.tokens, info.path)
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
            self._remove_tokens(entry.tokens, rel)
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

    def _insert_tokens(self, tokens: array.array, rel: str) -> None:
        order, lcp = self._by_tokens, self._lcp
        at = bisect.bisect_left(order, (tokens, rel))
        order.insert(at, (tokens, rel))
        lcp.insert(at, self._common(at - 1, at))
        if at + 1 < len(order):
            lcp[at + 1] = self._common(at, at + 1)

    def _remove_tokens(self, tokens: array.array, rel: str) -> None:
        order, lcp = self._by_tokens, self._lcp
        at = bisect.bisect_left(order, (tokens, rel))
        del order[at]  # the same (tokens, path) pair _add inserted
        del lcp[at]
        if at < len(order):
            lcp[at] = self._common(at - 1, at)

    def _common(self, i: int, j: int) -> int:
        order = self._by_tokens
        return prefixtree.common_prefix_len(order[i][0], order[j][0]) if i >= 0 else 0

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
            order = self._by_tokens

            def common(j: int) -> int:
                return prefixtree.common_prefix_len(want, order[j][0]) if 0 <= j < len(order) else 0

            up = bisect.bisect_left(order, (want, ""))
            down = up - 1
            n_down, n_up = common(down), common(up)
            while (n := max(n_down, n_up)) > 0:
                if len(found) >= limit and n < found[limit - 1].match:
                    break
                if n_down >= n_up:
                    j, down = down, down - 1
                    n_down = common(down)
                else:
                    j, up = up, up + 1
                    n_up = common(up)
                have, path = order[j]
                if path.startswith(prefix) and not (exclude_suffix and path.endswith(exclude_suffix)):
                    found.append(PrefixMatch(path, n, len(have), dict(self.entries[path].info.labels)))
        found.sort(key=lambda m: (-m.match, m.tokens, m.path))
        return found[:limit]

    def token_tree(self, prefix: str = "") -> tuple[prefixtree.Node, dict[str, str]]:
        prefix = prefix.lstrip("/")
        names = catalog.display_name
        with self._reading():  # the token-ordered index: no sort, no copies of the token arrays
            order = self._by_tokens
            if prefix:
                kept = [i for i, (_, p) in enumerate(order) if p.startswith(prefix)]
                entries = [(order[i][0], names(order[i][1])) for i in kept]
                lcp = _subset_lcp(self._lcp, kept)
            else:
                entries = [(tokens, names(p)) for tokens, p in order]
                lcp = list(self._lcp)
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


_gc_lock = threading.Lock()
_gc_pauses = 0


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a big answer is built. Each full collection
    scans every object the catalog holds, and building a 50,000-snapshot tree allocates enough to
    start several: 2.07 s with them, 0.42 s without. Reference counting still frees everything
    at once; only cycles wait for the next collection. Nested and concurrent uses are counted."""
    global _gc_pauses
    with _gc_lock:
        _gc_pauses += 1
        gc.disable()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0:
                gc.enable()


def _total(lens: np.ndarray, where: np.ndarray | None = None) -> int:
    """The sum of ``lens`` (where ``where`` is set), as a Python int (no widened copy)."""
    if where is None:
        return int(lens.sum(dtype=np.int64))
    return int(np.sum(lens, where=where, dtype=np.int64))


def _entries_in(path: Path) -> int:
    """How many entries the index at ``path`` has, going by its size (0 if it cannot be told)."""
    try:
        return max(0, os.lstat(path).st_size - idx.FIXED_BYTES) // idx.ITEM_BYTES
    except OSError:
        return 0


def _last_of_each(slots: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct slots as uint32, the length of each one's last entry): uint32 lengths unless one
    needs more."""
    distinct, last = np.unique(slots[::-1], return_index=True)
    lengths = lens[::-1][last]
    narrow = len(lengths) and int(lengths.max()) < 1 << 32
    return distinct.astype(np.uint32), lengths.astype(np.uint32) if narrow or not len(lengths) else lengths


def _subset_lcp(lcp: list[int], kept: list[int]) -> list[int]:
    """Common prefixes of consecutive kept rows: in sorted order the common prefix of two rows is
    the least of the neighbours' ones between them."""
    out = []
    for n, i in enumerate(kept):
        out.append(min(lcp[kept[n - 1] + 1 : i + 1]) if n else 0)
    return out


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


def direct_reader(get_many: Callable[[list[bytes]], list[bytes]]) -> ReadChunks:
    """Read a byte range of a snapshot straight from the store, past the read-ahead cache (a
    catalog refresh must neither evict what restores read nor count as one)."""

    def read_chunks(index: Index, offset: int, size: int) -> bytes:
        end = min(index.size, offset + size)
        if offset >= end:
            return b""
        first, last = index.find(offset), index.find(end - 1)
        data = b"".join(get_many(index.ids[first : last + 1]))
        start = index.start(first)
        return data[offset - start : end - start]

    return read_chunks
