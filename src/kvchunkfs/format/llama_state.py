"""llama.cpp sequence-state files ("ggsq", versions 1-4): where their content shifts.

Layout (``llama_state_seq_save_file`` in src/llama-context.cpp, ``state_write`` in
src/llama-kv-cache.cpp and src/llama-memory-recurrent.cpp)::

    u32 magic "ggsq", u32 version, u32 n_words, n_words x u32 token words
        (llama-server: packed blob 0xFFFFFFFF, blob version, u32 n, n tokens, media keys, media)
    memory sections, one after another (KV cache; an iswa model has two; a hybrid model KV and
    then recurrent state):
      KV:        [u32 n_stream (v>=2)]; per stream: u32 cell_count; cell records
                 (i32 pos, u32 n_seq_id, [cell ext: M-RoPE, v>=3], n_seq_id x i32 seq_id);
                 u32 v_trans, u32 n_layer, [u32 n_rot_k, u32 n_rot_v (v4)];
                 per layer K: i32 type, u64 row_size, cell_count rows;
                 per layer V: the same, or (v_trans) i32 type, u32 el_size, u32 n_embd, then
                 n_embd runs of cell_count elements
      recurrent: u32 cell_count; records (i32 pos, u32 n_seq_id, seq ids); u32 s_trans,
                 u32 n_layer; R then S blocks (i32 type, u64 row_size, cell_count rows)
    anything appended later (a second pass): a llama_state_seq_get_data blob (u32 0xaf143cd8,
    i32 seq_id, memory sections) is parsed like the sections above; the rest is opaque.

``step`` turns the bytes at a position into the next ``Segment``\\ s and the state that parses
what follows them. It is pure: a decision reads only the bytes it asked for (``Need``), so feeding
more bytes at once never changes it, and with ``eof`` it never asks again. Whatever does not parse
(other magic, unknown version, an implausible header, a structure cut off by the end) becomes an
open segment: content-defined chunking to the end of the file. The cutter (cutter.py) turns
segments into chunk boundaries; nothing here knows chunk sizes.

The cell-record extension (M-RoPE models) is not flagged in the file: each candidate size is
tried in turn and the first whose records and following headers are consistent wins.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass, replace

GGSQ_MAGIC = 0x67677371
BLOB_MAGIC = 0xAF143CD8  # llama_state_seq_get_data: a context checkpoint's in-memory form
TOKEN_NULL = 0xFFFFFFFF
VERSIONS = range(1, 5)
MAX_LOOKAHEAD = 32 << 20  # bytes a decision may need past its position (cell records)
MAX_SECTIONS = 32
MAX_STREAMS = 256
MAX_SEQ_IDS = 64  # per cell
MAX_RECURRENT_CELLS = 1 << 16
MAX_LAYERS = 4096
MAX_TYPE = 256  # ggml type ids
MAX_ROW = 1 << 26
MAX_EL = 8
MAX_EMBD = 1 << 20
CELL_EXTS = (0, 12, 8)  # llama_kv_cell_ext: none, {x, y, tok} (v4), {x, y} (older)
_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, end)`` (``end`` None: to the end of the file).

    ``unit`` 0: opaque, chunked by content (FastCDC restarted at ``start``). Otherwise the bytes
    from ``origin`` on are whole units (rows) and grow only at the end, so the cutter may cut at
    unit multiples counted from ``origin``; ``[start, origin)`` is a header. ``phase`` is the token
    position of the first unit (a sliding-window cache starts past 0): cuts counted from position 0
    stay put when the window slides. ``period`` > 0: the body is runs of ``period`` bytes that each
    grow at their end (transposed V: one run of ``unit``-byte elements per dimension).
    """

    start: int
    end: int | None
    origin: int = 0
    unit: int = 0
    period: int = 0
    phase: int = 0
    group: Group | None = None  # chunker ``relayout``: blocks stored token-major (format/relayout.py)


@dataclass(frozen=True)
class Group:
    """``count`` consecutive K (or V) blocks that the ``relayout`` chunker stores token-major.

    In the file: per block a header (``lead`` + 12 bytes on the first, 12 on the others) then
    ``cells`` rows of ``width`` bytes (``el`` > 0: transposed V, ``width // el`` runs of ``cells``
    elements of ``el`` bytes). In the stored stream: the headers, back to back, then ``cells``
    records, record ``p`` holding row ``p`` of every block in turn (transposed V's row ``p``: element
    ``p`` of each run). Every block is assumed as wide as the first: only the first header is read,
    which sits at the same offset in the file and in the stream. (A decision before the group may
    still read ahead into it, where the stream differs: where the groups are is recorded with the
    snapshot, format/filerecord.py.)
    """

    count: int
    lead: int
    width: int
    el: int
    cells: int


@dataclass(frozen=True)
class State:
    """What to parse at ``pos``, with what the file said so far."""

    step: str
    pos: int
    version: int = 4
    sections: int = 0
    n_stream: int = 1
    stream: int = 0
    cells: int = 0
    n_layer: int = 0
    layer: int = 0
    v_trans: int = 0
    phase: int = 0  # position of the stream's first cell
    group_w: int = 0  # > 0 (chunker ``relayout``): group blocks up to this many bytes per cell


@dataclass(frozen=True)
class Need:
    """``n`` bytes from the position are needed to decide."""

    n: int


@dataclass(frozen=True)
class Plan:
    """The next segments (contiguous, from the state's position) and the state after them;
    ``next`` is None when the last segment is open (runs to the end)."""

    segments: tuple[Segment, ...]
    next: State | None


START = State("file", 0)
Result = Need | Plan
ReadAt = Callable[[int, int], bytes]


def step(state: State, view: memoryview, eof: bool) -> Result:
    """Decide the segments at ``state.pos``; ``view`` holds the bytes from there (all of them to
    the end of the file if ``eof``)."""
    return _STEPS[state.step](state, view, eof)


def opaque(pos: int) -> Plan:
    return Plan((Segment(pos, None),), None)


# -- small readers ---------------------------------------------------------------------------


def _u32(view: memoryview, off: int) -> int:
    return struct.unpack_from("<I", view, off)[0]


def _short(view: memoryview, n: int, eof: bool, pos: int) -> Result | None:
    """Need(n) (or, at the end, the opaque rest) when fewer than ``n`` bytes are there."""
    if len(view) >= n:
        return None
    return opaque(pos) if eof or n > MAX_LOOKAHEAD else Need(n)


def _typed_row_ok(view: memoryview, off: int) -> bool:
    """An ``i32 type, u64 row_size`` header that a ggml tensor could have written."""
    typ, row = struct.unpack_from("<iQ", view, off)
    return 0 <= typ < MAX_TYPE and 0 < row <= MAX_ROW


# -- file header and tokens ------------------------------------------------------------------


def _file(st: State, view: memoryview, eof: bool) -> Result:
    if len(view) < 4:
        return opaque(0) if eof else Need(4)
    magic = _u32(view, 0)
    if magic == BLOB_MAGIC:  # a bare checkpoint blob (sidecar): magic, seq_id, sections
        return _short(view, 8, eof, 0) or Plan((Segment(0, 8),), replace(st, step="section", pos=8))
    if magic != GGSQ_MAGIC:
        return opaque(0)
    short = _short(view, 12, eof, 0)
    if short:
        return short
    version, n_words = struct.unpack_from("<II", view, 4)
    if version not in VERSIONS:
        return opaque(0)
    end = 12 + 4 * n_words
    ids = 12
    if n_words >= 3:
        short = _short(view, 16, eof, 0)
        if short:
            return short
        if _u32(view, 12) == TOKEN_NULL:  # llama-server's packed blob: its counts change every turn
            ids = 24
    segments = [Segment(0, ids)]
    if end > ids:  # token ids grow at the end: whole words from the first id
        segments.append(Segment(ids, end, ids, 4))
    return Plan(tuple(segments), replace(st, step="section", pos=end, version=version))


# -- memory sections -------------------------------------------------------------------------


def _section(st: State, view: memoryview, eof: bool) -> Result:
    """A section boundary: another memory section, an appended blob, or the opaque rest."""
    if st.sections >= MAX_SECTIONS:
        return opaque(st.pos)
    if not view and eof:
        return opaque(st.pos)
    st = replace(st, sections=st.sections + 1)
    for attempt in (_kv_section, _recurrent_section, _blob):
        r = attempt(st, view, eof)
        if r is not None:
            return r
    return opaque(st.pos)


def _blob(st: State, view: memoryview, eof: bool) -> Result | None:
    if len(view) < 8:
        return None if eof else Need(8)
    if _u32(view, 0) != BLOB_MAGIC:
        return None
    return Plan((Segment(st.pos, st.pos + 8),), replace(st, step="section", pos=st.pos + 8, version=4))


def _kv_section(st: State, view: memoryview, eof: bool) -> Result | None:
    """u32 n_stream (v>=2), then the first stream. None if it is not a KV section."""
    head = 8 if st.version >= 2 else 4
    if len(view) < head:
        return None if eof else Need(head)
    n_stream = _u32(view, 0) if st.version >= 2 else 1
    if not 1 <= n_stream <= MAX_STREAMS:
        return None
    st = replace(st, step="stream", n_stream=n_stream, stream=0)
    return _stream_at(st, view, head - 4, eof)


def _stream(st: State, view: memoryview, eof: bool) -> Result:
    return _stream_at(st, view, 0, eof) or opaque(st.pos)


def _stream_at(st: State, view: memoryview, count_at: int, eof: bool) -> Result | None:
    """A stream's u32 cell_count at ``count_at`` (after n_stream for the first), then its cells."""
    if len(view) < count_at + 4:
        return None if eof else Need(count_at + 4)
    cells = _u32(view, count_at)
    p, body = st.pos, count_at + 4
    counts = Segment(p, p + body)  # counts change every turn: a chunk of their own
    if cells == 0:  # an empty stream has no records and no data
        return Plan((counts,), _after_stream(replace(st, pos=p + body)))
    found = _cell_records(view, body, cells, st.version, eof)
    if isinstance(found, Need) or found is None:
        return found
    end, unit = found
    phase = max(0, struct.unpack_from("<i", view, body)[0])
    records = Segment(p + body, p + end, p + body, unit, 0, phase if unit > 4 else 0)
    after = replace(st, step="k", pos=p + end, cells=cells, layer=0, phase=phase)
    return Plan((counts, records), after)


def _after_stream(st: State) -> State:
    if st.stream + 1 < st.n_stream:
        return replace(st, step="stream", stream=st.stream + 1)
    return replace(st, step="section")


def _cell_records(view: memoryview, off: int, cells: int, version: int, eof: bool) -> Need | tuple[int, int] | None:
    """(end, unit) of a stream's cell records, checked against the headers after them."""
    data_head = 16 if version >= 4 else 8
    for ext in CELL_EXTS if version >= 3 else (0,):
        found = _walk_records(view, off, cells, ext, eof)
        if isinstance(found, Need):
            return found
        if found is None:
            continue
        end, unit = found
        need = end + data_head + 12
        if len(view) < need:
            if eof or need > MAX_LOOKAHEAD:
                continue
            return Need(need)
        if _kv_data_ok(view, end, version):
            return end, unit
    return None


def _walk_records(view: memoryview, off: int, cells: int, ext: int, eof: bool) -> Need | tuple[int, int] | None:
    """Records of 12 + ext bytes when every cell has one seq id (the usual case, checked in C);
    otherwise walked one by one. None if they are not records."""
    rec = 12 + ext
    end = off + cells * rec
    if end > MAX_LOOKAHEAD:
        return None
    probe = _walk_mixed(view, off, min(cells, 16), ext, eof)  # garbage fails here, before waiting
    if probe is None or isinstance(probe, Need):
        return probe
    if len(view) < end:
        return None if eof else Need(end)
    words = array("I")
    words.frombytes(view[off:end])
    if not _LITTLE:
        words.byteswap()
    step_w = rec // 4
    if words[1::step_w].count(1) == cells:
        return (end, rec) if max(words[0::step_w]) < 1 << 31 else None
    return _walk_mixed(view, off, cells, ext, eof)


def _walk_mixed(view: memoryview, off: int, cells: int, ext: int, eof: bool) -> Need | tuple[int, int] | None:
    p = off
    for _ in range(cells):
        if len(view) < p + 8:
            return None if eof else Need(p + 8)
        pos, n_seq = struct.unpack_from("<iI", view, p)
        if pos < 0 or not 1 <= n_seq <= MAX_SEQ_IDS:
            return None
        p += 8 + ext + 4 * n_seq
        if p > MAX_LOOKAHEAD:
            return None
    if len(view) < p:
        return None if eof else Need(p)
    return p, 4


def _kv_data_ok(view: memoryview, off: int, version: int) -> bool:
    v_trans, n_layer = struct.unpack_from("<II", view, off)
    head = 16 if version >= 4 else 8
    return v_trans <= 1 and 1 <= n_layer <= MAX_LAYERS and _typed_row_ok(view, off + head)


def _k_block(st: State, view: memoryview, eof: bool) -> Result:
    """Layer ``layer``'s K rows; the first carries the stream's data header (v_trans, n_layer...)."""
    lead = 0
    if st.layer == 0:
        lead = 16 if st.version >= 4 else 8
        short = _short(view, lead + 12, eof, st.pos)
        if short:
            return short
        v_trans, n_layer = struct.unpack_from("<II", view, 0)
        if v_trans > 1 or not 1 <= n_layer <= MAX_LAYERS:
            return opaque(st.pos)
        st = replace(st, v_trans=v_trans, n_layer=n_layer)
    short = _short(view, lead + 12, eof, st.pos)
    if short:
        return short
    if not _typed_row_ok(view, lead):
        return opaque(st.pos)
    row = struct.unpack_from("<Q", view, lead + 4)[0]
    if st.group_w:
        return _group(st, lead, row, 0)
    rows = st.pos + lead + 12
    end = rows + st.cells * row
    if st.layer + 1 < st.n_layer:
        after = replace(st, pos=end, layer=st.layer + 1)
    else:
        after = replace(st, step="v", pos=end, layer=0)
    return Plan((Segment(st.pos, end, rows, row, 0, st.phase),), after)


def _group(st: State, lead: int, width: int, el: int) -> Plan:
    """Blocks from layer ``layer`` on (K in step "k", V in step "v") as one ``Group``: the fewest
    groups per kind that keep a record near ``group_w`` bytes, of equal block counts. Decided by the
    first block's header alone (see ``Group``)."""
    n = st.n_layer
    parts = -(-n * width // st.group_w)
    count = min(-(-n // parts), n - st.layer)
    body = 12 + st.cells * width
    end = st.pos + lead + count * body
    if count == 1 and not el:  # one row block: stored as it is
        seg = Segment(st.pos, end, st.pos + lead + 12, width, 0, st.phase)
    else:
        group = Group(count, lead, width, el, st.cells)
        seg = Segment(st.pos, end, st.pos + lead + 12 * count, count * width, 0, st.phase, group)
    layer = st.layer + count
    if st.step == "k" and layer >= n:
        return Plan((seg,), replace(st, step="v", pos=end, layer=0))
    return Plan((seg,), replace(st, pos=end, layer=layer))


def _v_block(st: State, view: memoryview, eof: bool) -> Result:
    """Layer ``layer``'s V. A layer may have none (the header then does not fit): the stream ends."""
    if st.layer >= st.n_layer:
        return step(_after_stream(st), view, eof)
    if len(view) < 12:
        if not eof:
            return Need(12)
        return step(_after_stream(st), view, eof)
    rows = st.pos + 12
    after = replace(st, layer=st.layer + 1)
    if not st.v_trans:
        if not _typed_row_ok(view, 0):
            return step(_after_stream(st), view, eof)
        row = struct.unpack_from("<Q", view, 4)[0]
        if st.group_w:
            return _group(st, 0, row, 0)
        end = rows + st.cells * row
        return Plan((Segment(st.pos, end, rows, row, 0, st.phase),), replace(after, pos=end))
    typ, el, n_embd = struct.unpack_from("<iII", view, 0)
    if not (0 <= typ < MAX_TYPE and 1 <= el <= MAX_EL and 1 <= n_embd <= MAX_EMBD):
        return step(_after_stream(st), view, eof)
    if st.group_w:
        return _group(st, 0, n_embd * el, el)
    run = st.cells * el  # one embedding dimension across all cells
    end = rows + n_embd * run
    return Plan((Segment(st.pos, end, rows, el, run, st.phase),), replace(after, pos=end))


def _recurrent_section(st: State, view: memoryview, eof: bool) -> Result | None:
    """u32 cell_count, records, u32 s_trans, u32 n_layer, then R/S blocks. Rewritten whole every
    turn; parsed so that its end (where a second pass appends) is a boundary."""
    if len(view) < 4:
        return None if eof else Need(4)
    cells = _u32(view, 0)
    if cells > MAX_RECURRENT_CELLS:
        return None
    p = 4
    for _ in range(cells):
        if len(view) < p + 8:
            return None if eof or p + 8 > MAX_LOOKAHEAD else Need(p + 8)
        pos, n_seq = struct.unpack_from("<iI", view, p)
        if pos < 0 or n_seq > MAX_SEQ_IDS:
            return None
        p += 8 + 4 * n_seq
    need = p + 8 + 12
    if len(view) < need:
        return None if eof or need > MAX_LOOKAHEAD else Need(need)
    s_trans, n_layer = struct.unpack_from("<II", view, p)
    if s_trans > 1 or not 1 <= n_layer <= MAX_LAYERS or not _typed_row_ok(view, p + 8):
        return None
    head = Segment(st.pos, st.pos + p + 8)
    return Plan((head,), replace(st, step="rblock", pos=st.pos + p + 8, cells=cells, n_layer=n_layer, layer=0))


def _r_block(st: State, view: memoryview, eof: bool) -> Result:
    """One R or S block (same header); after at most 2 x n_layer, or a header that does not fit,
    the section ends."""
    if st.layer >= 2 * st.n_layer:
        return step(replace(st, step="section"), view, eof)
    if len(view) < 12:
        return Need(12) if not eof else step(replace(st, step="section"), view, eof)
    if not _typed_row_ok(view, 0):
        return step(replace(st, step="section"), view, eof)
    row = struct.unpack_from("<Q", view, 4)[0]
    end = st.pos + 12 + st.cells * row
    return Plan((Segment(st.pos, end, st.pos + 12, row),), replace(st, pos=end, layer=st.layer + 1))


_STEPS = {
    "file": _file,
    "section": _section,
    "stream": _stream,
    "k": _k_block,
    "v": _v_block,
    "rblock": _r_block,
}


def plan_at(state: State, read: ReadAt, size: int) -> Plan:
    """The plan at ``state.pos`` of a file of ``size`` bytes read through ``read(offset, n)``:
    only the bytes its decision needs are read."""
    n = 64
    while True:
        view = memoryview(read(state.pos, max(0, min(n, size - state.pos))))
        plan = step(state, view, state.pos + len(view) >= size)
        if isinstance(plan, Plan):
            return plan
        n = max(plan.n, 2 * n)


def segments(data: bytes | memoryview, group_w: int = 0) -> list[Segment]:
    """Every segment of a whole file (for tests and analysis)."""
    view = memoryview(data)
    out: list[Segment] = []
    st: State | None = replace(START, group_w=group_w)
    while st is not None:
        plan = step(st, view[st.pos :], True)
        assert isinstance(plan, Plan)
        out.extend(plan.segments)
        st = plan.next
    return out
