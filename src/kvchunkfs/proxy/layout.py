"""What makes a saved slot loadable by a llama-server: its *layout*, read from a state file's headers.

llama-server restores a slot file (``llama_state_seq_load_file``) only if the memory it writes into
is built like the one that saved it; the sequence reader checks no model name. What the readers
compare (``llama_kv_cache::state_read``/``state_read_meta``/``state_read_data``, and the recurrent
state's reader for hybrid models), each recorded here:

- the file's version, the number of KV streams (``n_stream``: one per slot unless ``--kv-unified``);
- whether cells carry an extension (M-RoPE position, token id);
- per KV section: V transposed or not (``--flash-attn``), the layer count, the key and value
  rotations (``n_rot_k``/``n_rot_v``: Hadamard rotations llama.cpp applies to quantized K/V), each
  layer's K and V type and row size (``-ctk``/``-ctv``: f16, q8_0, q4_0, ...);
- per recurrent section: the state's layout the same way.

Not in the file but checked too: a snapshot must fit the slot (``n_ctx`` per slot), and the model,
which the sequence reader cannot tell: the proxy names both (``props``). ``describe`` reads only
headers (a few KiB at known offsets, whatever the file's size); a file it cannot follow gives
None, never a guess.
"""

from __future__ import annotations

import hashlib
import os
import struct

GGSQ_MAGIC = 0x67677371
MAX_SECTIONS = 16
MAX_STREAMS = 256
MAX_LAYERS = 4096
MAX_TYPE = 256
MAX_ROW = 1 << 26
CELL_EXTS = (0, 12, 8)  # llama_kv_cell_ext: none, {x, y, tok}, {x, y} (older)


class _Short(Exception):
    """The file ends inside a header."""


class _Reader:
    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size, self.pos = fd, size, 0

    def read(self, n: int) -> bytes:
        data = os.pread(self.fd, n, self.pos) if n else b""
        if len(data) != n:
            raise _Short
        self.pos += n
        return data

    def u32(self) -> int:
        return int(struct.unpack("<I", self.read(4))[0])

    def i32(self) -> int:
        return int(struct.unpack("<i", self.read(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.read(8))[0])

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Short
        self.pos += n

    def peek_u32(self, at: int) -> int | None:
        data = os.pread(self.fd, 4, at)
        return int(struct.unpack("<I", data)[0]) if len(data) == 4 else None


def describe_file(path: str | os.PathLike[str]) -> str | None:
    """The layout of the state file at ``path`` as a short text, or None if it cannot be followed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return describe(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def describe(fd: int, size: int) -> str | None:
    r = _Reader(fd, size)
    try:
        if r.u32() != GGSQ_MAGIC:
            return None
        version = r.u32()
        words = r.u32()
        r.skip(4 * words)  # the token words (llama-server: its packed token blob)
        parts = [f"v{version}"]
        for _ in range(MAX_SECTIONS):
            if r.pos == size:
                break
            start = r.pos
            part = _kv_section(r, version)
            if part is None:
                r.pos = start
                part = _recurrent_section(r)
            if part is None:
                return None
            parts.append(part)
        if r.pos != size:
            return None
        return " ".join(parts)
    except (_Short, struct.error, OSError):
        return None


def tag(layout: str) -> str:
    """The layout's short name, part of snapshot names."""
    return hashlib.sha256(layout.encode()).hexdigest()[:8]


def _runs(items: list[str]) -> str:
    """``a,a,a,b`` as ``a*3,b``: a 40-layer model's types stay short."""
    out: list[str] = []
    for item in items:
        if out and out[-1].rpartition("*")[0] == item:
            head, _, n = out[-1].rpartition("*")
            out[-1] = f"{head}*{int(n) + 1}"
        elif out and out[-1] == item:
            out[-1] = f"{item}*2"
        else:
            out.append(item)
    return ",".join(out)


def _kv_section(r: _Reader, version: int) -> str | None:
    """A KV cache section (``llama_kv_cache::state_write``): its layout, the reader past it."""
    n_stream = r.u32() if version >= 2 else 1
    if not 1 <= n_stream <= MAX_STREAMS:
        return None
    found: str | None = None
    for _ in range(n_stream):
        cells = r.u32()
        if cells == 0:
            continue
        if cells > (r.size - r.pos) // 12:
            return None
        ext = _cell_ext(r, cells, version)
        if ext is None:
            return None
        r.skip(cells * (12 + ext))
        v_trans, n_layer = r.u32(), r.u32()
        rot = (r.u32(), r.u32()) if version >= 4 else (0, 0)
        if v_trans > 1 or not 1 <= n_layer <= MAX_LAYERS:
            return None
        keys = [_rows(r, cells) for _ in range(n_layer)]
        values = [_trans(r, cells) if v_trans else _rows(r, cells) for _ in range(n_layer)]
        if None in keys or None in values:
            return None
        # A layer without V (MLA) writes no V block: the count read is what follows, so a model whose
        # layers all have V reads n_layer V blocks; others fail above and are not described.
        part = (f"kv s{n_stream} ext{ext} vt{v_trans} L{n_layer} rk{rot[0]} rv{rot[1]} "
                f"K{_runs([k for k in keys if k])} V{_runs([v for v in values if v])}")  # fmt: skip
        if found is not None and found != part:
            return None
        found = part
    return found or f"kv s{n_stream} empty"


def _cell_ext(r: _Reader, cells: int, version: int) -> int | None:
    """The cell-record extension's size (not flagged in the file): the one after whose records a
    plausible ``v_trans, n_layer`` follows, with every checked record naming one sequence."""
    for ext in CELL_EXTS if version >= 3 else (0,):
        rec = 12 + ext
        end = r.pos + cells * rec
        if end + 8 > r.size:
            continue
        if r.peek_u32(r.pos + 4) != 1 or r.peek_u32(r.pos + (cells - 1) * rec + 4) != 1:
            continue
        v_trans, n_layer = r.peek_u32(end), r.peek_u32(end + 4)
        if v_trans is not None and v_trans <= 1 and n_layer is not None and 1 <= n_layer <= MAX_LAYERS:
            return ext
    return None


def _rows(r: _Reader, cells: int) -> str | None:
    kind, row = r.i32(), r.u64()
    if not 0 <= kind < MAX_TYPE or not 0 < row <= MAX_ROW:
        return None
    r.skip(cells * row)
    return f"{kind}:{row}"


def _trans(r: _Reader, cells: int) -> str | None:
    kind, el, embd = r.i32(), r.u32(), r.u32()
    if not 0 <= kind < MAX_TYPE or not 0 < el <= 8 or not 0 < embd <= MAX_ROW:
        return None
    r.skip(cells * el * embd)
    return f"{kind}:{el}x{embd}"


def _recurrent_section(r: _Reader) -> str | None:
    """A recurrent state section (``llama_memory_recurrent::state_write``)."""
    cells = r.u32()
    if cells > 1 << 16:
        return None
    for _ in range(cells):
        r.skip(4)
        n_seq = r.u32()
        if n_seq > 64:
            return None
        r.skip(4 * n_seq)
    if cells == 0:
        return "rec empty"
    s_trans, n_layer = r.u32(), r.u32()
    if s_trans > 1 or not 1 <= n_layer <= MAX_LAYERS:
        return None
    blocks: list[str] = []  # R then S blocks of the layers that have them: to the end of the file
    while r.pos < r.size and len(blocks) < 2 * n_layer:
        kind, row = r.i32(), r.u64()
        if not 0 <= kind < MAX_TYPE or not 0 < row <= MAX_ROW:
            return None
        r.skip(cells * row)
        blocks.append(f"{kind}:{row}")
    return f"rec st{s_trans} L{n_layer} {_runs(blocks)}"
