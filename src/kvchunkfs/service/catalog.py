"""Snapshot listing: sizes, unique and shared bytes, metadata and score, read from the stubs alone.

Everything here is a pure function of the ``snapshots/`` directory (plus, for store totals, the chunk
map read-only), so the CLI can list a store without a daemon and the API can list it beside one.

Unique and shared bytes come from a reference count over the *distinct* chunk ids of every stub:

* ``unique_bytes``: bytes of this snapshot's chunks that no other snapshot names, i.e. what deleting
  the snapshot would free (once GC runs);
* ``shared_bytes``: bytes of its chunks that at least one other snapshot names too.

A chunk repeated inside one file counts once, so ``unique_bytes + shared_bytes`` can be less than
``size``. Chunk lengths come from the index (the differences of its end offsets), not the store.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchunkfs.format.index import Index
from kvchunkfs.formula import Formula
from kvchunkfs.service import figures, prefixtree
from kvchunkfs.store import stubs
from kvchunkfs.store.chunkmap import MapReader
from kvchunkfs.store.layout import Layout
from kvchunkfs.units import parse_size

HOUR = 3600.0
# Sortable and filterable numeric fields (min_<field>, max_<field>); the formula's fields plus a few.
NUMERIC = (
    "size",
    "chunks",
    "distinct_chunks",
    "unique_bytes",
    "shared_bytes",
    "use_count",
    "last_use",
    "created",
    "age_hours",
    "idle_hours",
    "score",
)
BYTE_FIELDS = frozenset({"size", "unique_bytes", "shared_bytes"})
MAX_JSON_FLOAT = 1.7976931348623157e308  # JSON has no inf: report it as the largest float


class QueryError(ValueError):
    """A sort or filter parameter is invalid; the message says which and why."""


@dataclass
class StubInfo:
    """What one stub says: its index's chunks and its metadata xattrs."""

    path: str  # relative to snapshots/, "/"-separated
    size: int
    chunks: int
    lengths: dict[bytes, int]  # distinct chunk id -> length
    created: float
    use_count: int
    last_use: float | None
    labels: dict[str, str]
    error: str | None = None  # the stub could not be read as an index
    digest: bytes | None = None  # SHA-256 of the stub's index bytes (a metadata change keeps it)
    broken: str | None = None  # why ``fsck --repair`` marked it: it cannot be read in full


@dataclass
class Snapshot:
    """One row of the listing."""

    path: str
    size: int
    chunks: int
    distinct_chunks: int
    unique_bytes: int
    shared_bytes: int
    use_count: int
    last_use: float | None
    created: float
    age_hours: float
    idle_hours: float
    labels: dict[str, str] = field(default_factory=dict)
    score: float = 0.0
    error: str | None = None
    broken: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out.update(path_fields(self.path))
        out["labels"] = {display_name(k): display_name(v) for k, v in self.labels.items()}
        out["score"] = json_float(self.score)
        for name in ("error", "broken"):
            if out[name] is None:
                del out[name]
            else:
                out[name] = display_name(out[name])
        return out

    def number(self, name: str) -> float:
        value = getattr(self, name)
        return 0.0 if value is None else float(value)


def display_name(name: str) -> str:
    """A file name (``os.fsdecode``d bytes), or text holding one, as text JSON and UTF-8 can carry:
    bytes that are not UTF-8 become U+FFFD."""
    if name.isascii():  # nearly every name: nothing to convert
        return name
    try:
        return os.fsencode(name).decode("utf-8", "replace")
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte
        return name.encode("utf-8", "backslashreplace").decode()


def path_fields(rel: str) -> dict[str, str]:
    """``path`` for display, plus ``path_b64`` (the name's exact bytes, base64) when they are not UTF-8:
    names are bytes, and a client gives those bytes back, percent-encoded, in ``/snapshots/{path}``."""
    raw = os.fsencode(rel)
    out = {"path": raw.decode("utf-8", "replace")}
    if out["path"].encode() != raw:
        out["path_b64"] = base64.b64encode(raw).decode()
    return out


def json_float(x: float) -> float:
    """``x`` clamped to what strict JSON can carry (inf becomes the largest float)."""
    if math.isnan(x):
        return 0.0
    return max(-MAX_JSON_FLOAT, min(MAX_JSON_FLOAT, x))


# -- reading stubs -------------------------------------------------------------------------------


def stub_paths(snapshots_dir: Path) -> Iterator[str]:
    """Relative paths of the regular files under ``snapshots_dir``, sorted; symlinks, FIFOs and the
    like are skipped, and nothing a user shaped through the mount can make the walk fail or hang."""
    if not snapshots_dir.is_dir():
        return
    for entry in stubs.walk(snapshots_dir):
        if entry.kind == "file":
            yield entry.rel


def _float_attr(attrs: Mapping[str, bytes], name: str) -> float | None:
    try:
        value = float(attrs[name])
    except (KeyError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _int_attr(attrs: Mapping[str, bytes], name: str) -> int:
    try:
        return max(0, int(attrs[name]))
    except (KeyError, ValueError):
        return 0


def read_stub(snapshots_dir: Path, rel: str) -> StubInfo:
    """Read one stub; an unreadable index gives a row with ``error`` set instead of an exception."""
    return read_stub_index(snapshots_dir, rel)[0]


def read_stub_index(snapshots_dir: Path, rel: str) -> tuple[StubInfo, Index | None]:
    """``read_stub`` and the index it read (None for a row with ``error``)."""
    path = snapshots_dir / rel
    info = StubInfo(path=rel, size=stubs.stub_size(path) or 0, chunks=0, lengths={}, created=0.0, use_count=0,
                    last_use=None, labels={})  # fmt: skip
    read_metadata(path, info)
    try:
        data, size = stubs.read_stub(path)
        info.digest = hashlib.sha256(data).digest()
        index = stubs.decode_stub(data, size, path)
        del data  # the index shares it
    except FileNotFoundError:
        raise  # deleted meanwhile: no row at all
    except OSError as e:  # StubError is an OSError
        info.error = str(e)
        return info, None
    info.size, info.chunks = index.size, len(index)
    start = 0
    for end, cid in zip(index.ends, index.ids, strict=True):
        info.lengths[cid] = end - start
        start = end
    return info, index


def read_metadata(path: Path, info: StubInfo) -> None:
    """Set ``info``'s metadata fields (created, uses, labels) from the stub's xattrs."""
    st = os.lstat(path)
    attrs = stubs.user_xattrs(path)
    created = _float_attr(attrs, stubs.CREATED)
    labels = {
        name[len(stubs.LABEL_PREFIX) :]: value.decode("utf-8", "replace")
        for name, value in attrs.items()
        if stubs.is_user_settable(name)
    }
    info.created = created if created is not None else st.st_mtime  # stubs from before metadata existed
    info.use_count = _int_attr(attrs, stubs.USE_COUNT)
    info.last_use = _float_attr(attrs, stubs.LAST_USE)
    info.labels = dict(sorted(labels.items()))
    broken = attrs.get(stubs.BROKEN)
    info.broken = None if broken is None else broken.decode("utf-8", "replace") or "marked broken"


def same_index(snapshots_dir: Path, rel: str, digest: bytes) -> bool:
    """Whether the stub at ``rel`` still holds the index bytes of SHA-256 ``digest`` (read a piece
    at a time: a use or a label changes only xattrs, and a big index need not be decoded again)."""
    fd = stubs.open_stub(snapshots_dir / rel)
    try:
        return bool(stubs.hash_stub(fd).digest() == digest)
    finally:
        os.close(fd)


def scan(snapshots_dir: Path) -> list[StubInfo]:
    out = []
    for rel in stub_paths(snapshots_dir):
        try:
            out.append(read_stub(snapshots_dir, rel))
        except FileNotFoundError:
            continue
        except OSError as e:  # e.g. a store path longer than PATH_MAX: a row that says so
            out.append(StubInfo(rel, 0, 0, {}, 0.0, 0, None, {}, error=str(e)))
    return out


# -- the listing -----------------------------------------------------------------------------------


def share(infos: list[StubInfo]) -> dict[str, tuple[int, int]]:
    """path -> (unique_bytes, shared_bytes) by a reference count over distinct chunk ids."""
    refs: Counter[bytes] = Counter()
    for info in infos:
        refs.update(info.lengths.keys())
    out = {}
    for info in infos:
        unique = sum(n for cid, n in info.lengths.items() if refs[cid] == 1)
        out[info.path] = (unique, sum(info.lengths.values()) - unique)
    return out


def formula_fields(row: Snapshot) -> dict[str, float]:
    """The values a score formula can read (see formula.FIELDS); never-used gives last_use 0."""
    return {
        "size": row.size,
        "unique_bytes": row.unique_bytes,
        "shared_bytes": row.shared_bytes,
        "chunks": row.chunks,
        "use_count": row.use_count,
        "age_hours": row.age_hours,
        "idle_hours": row.idle_hours,
        "last_use": row.last_use or 0.0,
        "created": row.created,
    }


def listing(infos: list[StubInfo], formula: Formula | None = None, now: float | None = None) -> list[Snapshot]:
    now = time.time() if now is None else now
    shared = share(infos)
    rows = []
    for info in infos:
        unique, shared_bytes = shared[info.path]
        row = Snapshot(
            path=info.path,
            size=info.size,
            chunks=info.chunks,
            distinct_chunks=len(info.lengths),
            unique_bytes=unique,
            shared_bytes=shared_bytes,
            use_count=info.use_count,
            last_use=info.last_use,
            created=info.created,
            age_hours=max(0.0, (now - info.created) / HOUR),
            idle_hours=max(0.0, (now - (info.last_use or info.created)) / HOUR),
            labels=info.labels,
            error=info.error,
            broken=info.broken,
        )
        if formula is not None:
            row.score = formula.evaluate(formula_fields(row))
        rows.append(row)
    return rows


def snapshots(snapshots_dir: Path, formula: Formula | None = None, now: float | None = None) -> list[Snapshot]:
    return listing(scan(snapshots_dir), formula, now)


# -- sorting and filtering -------------------------------------------------------------------------


def _number_param(name: str, value: str, field_name: str) -> float:
    try:
        if field_name in BYTE_FIELDS:
            return float(parse_size(value))
        number = float(value)
    except ValueError:
        what = "a size (e.g. 1048576 or 1MiB)" if field_name in BYTE_FIELDS else "a number"
        raise QueryError(f"{name}={value!r}: not {what}") from None
    if math.isnan(number):
        raise QueryError(f"{name}={value!r}: not a number")
    return number


def _sort_key_fn(sort: str) -> Any:
    if sort == "path":
        return lambda r: r.path
    if sort in NUMERIC:
        return lambda r: (r.number(sort), r.path)
    if sort.startswith("label.") and len(sort) > len("label."):
        key = sort[len("label.") :]
        # Rows without the label sort after those with it (in ascending order).
        return lambda r: (key not in r.labels, r.labels.get(key, ""), r.path)
    known = ", ".join(("path", *NUMERIC, "label.<key>"))
    raise QueryError(f"sort={sort!r}: unknown field (known: {known})")


def select(rows: list[Snapshot], params: Mapping[str, str]) -> list[Snapshot]:
    """Filter, sort and limit rows by query parameters; QueryError for anything unknown or malformed.

    ``sort=FIELD`` (``-FIELD`` or ``order=desc`` for descending), ``prefix=PATH``, ``label.KEY=VALUE``,
    ``has_label=KEY``, ``min_FIELD=N`` / ``max_FIELD=N`` for numeric fields, ``limit=N``, and
    ``after=PATH`` (sort by path only): the rows past that path, for paging through a big store.
    """
    out = list(rows)
    for name, value in params.items():
        out = _apply_filter(out, name, value)
    sort = params.get("sort", "path")
    descending = sort.startswith("-")
    sort = sort.lstrip("-")
    order = params.get("order", "desc" if descending else "asc").lower()
    if order not in ("asc", "desc"):
        raise QueryError(f"order={order!r}: use asc or desc")
    out.sort(key=_sort_key_fn(sort), reverse=order == "desc")
    if "after" in params:
        if sort != "path":
            raise QueryError("after= pages through the listing sorted by path only")
        after = params["after"]
        out = [r for r in out if (r.path < after if order == "desc" else r.path > after)]
    offset = parse_limit(params["offset"], "offset") if "offset" in params else 0
    if "limit" in params:
        return out[offset : offset + parse_limit(params["limit"])]
    return out[offset:]


MAX_COUNT = 10**18 - 1  # the largest limit/offset: 18 digits (the API's description says so too)


def parse_limit(limit: str, name: str = "limit") -> int:
    # ASCII digits only (str.isdigit() takes '²', which int() refuses), and few enough for int().
    if not (limit.isascii() and limit.isdigit()) or len(limit) > len(str(MAX_COUNT)):
        raise QueryError(f"{name}={limit[:40]!r}: not a non-negative integer of at most 18 digits")
    return int(limit)


def page_params(params: Mapping[str, str]) -> tuple[str, int, str, bool] | None:
    """(after, limit, prefix, descending) when ``params`` ask only for a page in path order (which
    the daemon answers without building every row), else None."""
    if not set(params) <= {"after", "limit", "prefix", "sort", "order"}:
        return None
    sort = params.get("sort", "path")
    if sort.lstrip("-") != "path":
        return None
    order = params.get("order", "desc" if sort.startswith("-") else "asc").lower()
    if order not in ("asc", "desc"):
        return None  # select() says what is wrong
    limit = parse_limit(params["limit"]) if "limit" in params else 1 << 62
    return params.get("after", ""), limit, params.get("prefix", "").lstrip("/"), order == "desc"


def _apply_filter(rows: list[Snapshot], name: str, value: str) -> list[Snapshot]:
    if name in ("sort", "order", "limit", "after", "offset"):
        return rows
    if name == "prefix":
        return [r for r in rows if r.path.startswith(value.lstrip("/"))]
    if name == "has_label":
        return [r for r in rows if value in r.labels]
    if name.startswith("label.") and len(name) > len("label."):
        key = name[len("label.") :]
        return [r for r in rows if r.labels.get(key) == value]
    bound, _, field_name = name.partition("_")
    if bound in ("min", "max") and field_name in NUMERIC:
        limit = _number_param(name, value, field_name)
        if bound == "min":
            return [r for r in rows if r.number(field_name) >= limit]
        return [r for r in rows if r.number(field_name) <= limit]
    raise QueryError(
        f"unknown query parameter {name!r} (known: sort, order, limit, offset, after, prefix, label.<key>, has_label, "
        "min_<field>, max_<field>)"
    )


# -- store totals ----------------------------------------------------------------------------------


@dataclass
class StoreTotals:
    snapshots: int
    logical_bytes: int  # sum of snapshot sizes: what the files would take uncompressed
    referenced_bytes: int  # distinct chunk bytes named by some snapshot
    stored_bytes: int  # chunk bytes in the chunk map (live and not yet collected)
    pack_bytes: int  # pack files on disk, including dead space GC has not compacted yet
    chunks: int
    packs: int
    dedup_ratio: float  # logical_bytes / stored_bytes
    broken: int = 0  # snapshots that cannot be read in full: not a readable index, or marked by fsck --repair

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def unreadable(info: StubInfo) -> bool:
    """The snapshot cannot be read in full: its stub is no index, or fsck --repair marked it broken."""
    return info.error is not None or info.broken is not None


def chunk_map_stats(root: Path) -> tuple[int, int]:
    """(chunks, bytes) in the chunk map, read-only so it is safe beside a running daemon."""
    layout = Layout(root)
    if not layout.exists():
        return 0, 0
    chunk_map = MapReader.open(layout)
    try:
        return chunk_map.stats()
    finally:
        chunk_map.close()


def pack_files(root: Path) -> list[Path]:
    layout = Layout(root)
    return [layout.pack_path(p) for p in layout.pack_ids()]


def totals(infos: list[StubInfo], chunk_stats: tuple[int, int], packs: list[Path]) -> StoreTotals:
    referenced: dict[bytes, int] = {}
    for info in infos:
        referenced.update(info.lengths)
    logical = sum(i.size for i in infos)
    chunks, stored = chunk_stats
    pack_bytes = 0
    for p in packs:
        with contextlib.suppress(FileNotFoundError):  # GC may delete a pack meanwhile
            pack_bytes += p.stat().st_size
    return StoreTotals(
        snapshots=len(infos),
        logical_bytes=logical,
        referenced_bytes=sum(referenced.values()),
        stored_bytes=stored,
        pack_bytes=pack_bytes,
        chunks=chunks,
        packs=len(packs),
        dedup_ratio=figures.dedup_ratio(logical, stored),
        broken=sum(1 for i in infos if unreadable(i)),
    )


def store_totals(root: Path) -> StoreTotals:
    """Totals of a store directory without a daemon."""
    return totals(scan(root / "snapshots"), chunk_map_stats(root), pack_files(root))


# -- token prefixes ------------------------------------------------------------------------------

ReadChunks = Callable[[Index, int, int], bytes]


class ChunkReader:
    """A snapshot's content as a file, read through its chunks: ``read_tokens`` reads just the header.

    Reading the chunks directly (not the file on the mount) keeps a listing from counting as a restore.
    """

    def __init__(self, index: Index, read_chunks: ReadChunks) -> None:
        self.index = index
        self.read_chunks = read_chunks
        self.pos = 0
        self._buf = b""  # bytes read ahead, starting at ``pos``

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = self.index.size - self.pos
        start = self.pos + len(self._buf)
        if size > len(self._buf) and start < self.index.size:
            # To the end of the chunk it starts in, at least: the token header takes three small reads,
            # each of which would fetch that chunk again.
            end = max(self.pos + size, self.index.ends[self.index.find(start)])
            self._buf += self.read_chunks(self.index, start, end - start)
        data, self._buf = self._buf[:size], self._buf[size:]
        self.pos += len(data)
        return data


def snapshot_tokens(
    snapshots_dir: Path, read_chunks: ReadChunks, paths: Iterable[str]
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """(path -> prompt tokens, path -> why it was skipped) for the given snapshots."""
    tokens: dict[str, list[int]] = {}
    skipped: dict[str, str] = {}
    for rel in paths:
        try:
            index = stubs.read_index(snapshots_dir / rel)
            tokens[rel] = prefixtree.read_tokens(ChunkReader(index, read_chunks))  # type: ignore[arg-type]
        except FileNotFoundError:
            continue  # deleted meanwhile
        except (OSError, ValueError, LookupError) as e:  # bad stub, not a ggsq file, missing/corrupt chunk
            skipped[rel] = str(e) or type(e).__name__
    return tokens, skipped


def token_tree(
    snapshots_dir: Path, read_chunks: ReadChunks, prefix: str = ""
) -> tuple[prefixtree.Node, dict[str, str]]:
    """The token-prefix tree of the snapshots under ``prefix`` and the ones that were skipped."""
    paths = [p for p in stub_paths(snapshots_dir) if p.startswith(prefix.lstrip("/"))]
    tokens, skipped = snapshot_tokens(snapshots_dir, read_chunks, paths)
    # Names go out as JSON and text: display forms (a name that is not UTF-8 is shown with U+FFFD).
    tokens = {display_name(p): t for p, t in tokens.items()}
    return prefixtree.build_tree(tokens), {display_name(p): display_name(why) for p, why in skipped.items()}


# The fields of a row the daemon keeps up to date by change events (the others move with the clock).
COUNTED = ("path", "size", "chunks", "distinct_chunks", "unique_bytes", "shared_bytes", "use_count", "labels", "error")
COMPARE_TRIES = 3


def compare_with_daemon(root: Path) -> tuple[int, list[str], str]:
    """The mounted daemon's rows (its unique and shared bytes: the reference counts GC without a
    walk relies on) against a recount of every stub: (rows compared, differences, why not compared).
    Compared only if no row changed meanwhile (the catalog's generation before and after): saves
    running the whole time leave it not compared, not failed."""
    from kvchunkfs.service.apiclient import DaemonClient

    client = DaemonClient(root)
    for _ in range(COMPARE_TRIES):
        try:
            before = client.json("GET", "/stats")["catalog_generation"]
            served = client.json("GET", "/snapshots")["snapshots"]
            full = [r.to_dict() for r in snapshots(Layout(root).snapshots)]
            after = client.json("GET", "/stats")["catalog_generation"]
        except (OSError, KeyError, ValueError) as e:
            return 0, [], f"the daemon did not answer: {e}"
        if before != after:
            continue
        kept = {r["path"]: [r.get(k) for k in COUNTED] for r in served}
        counted = {r["path"]: [r.get(k) for k in COUNTED] for r in full}
        differ = [
            f"the daemon's catalog row of {path} ({kept.get(path)}) differs from a recount of the stubs "
            f"({counted.get(path)}): remount to rebuild it"
            for path in sorted(kept.keys() | counted.keys())
            if kept.get(path) != counted.get(path)
        ]
        return len(counted), differ, ""
    return 0, [], f"snapshots changed during each of {COMPARE_TRIES} tries"
