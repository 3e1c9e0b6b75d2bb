"""llama.cpp sequence-state files ("ggsq"): a synthetic writer and a parser for real ones.

Layout written by ``llama_state_seq_save_file`` (llama.cpp ``src/llama-context.cpp``,
``src/llama-kv-cache.cpp``, ``src/llama-memory-recurrent.cpp``; version 4)::

    u32 magic 0x67677371, u32 version 4, u32 n_token_count, n_token_count x i32 words
        (llama-server writes a packed blob: 0xFFFFFFFF, blob version 1, u32 n, n tokens,
         u32 n_media (0), media chunks)
    attention KV (llama_kv_cache::state_write), absent for pure recurrent models:
        u32 n_stream; per stream: u32 cell_count; cell_count x (i32 pos, u32 n_seq_id,
        [12-byte cell ext for M-RoPE models], n_seq_id x i32 seq_id);
        u32 v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v;
        n_layer x (i32 type, u64 row_size, cell_count rows)      <- K, one block per layer
        n_layer x (i32 type, u64 row_size, cell_count rows)      <- V (when v_trans == 0)
    recurrent state (hybrid models): cell_count, meta, s_trans, n_layer, R and S per layer.

Appending tokens appends one row at the end of every K and V block: 2 x n_layer insertion
points per turn. The recurrent state at the end changes completely every turn.

``write_synthetic`` produces a file of the same shape (flash-attention layout, v_trans = 0)
whose row contents are a deterministic function of the token prefix, so two "conversations"
with a common prefix share rows exactly like recomputed KV does. It is used by the default test
suite (tests/test_llama_shaped.py), which needs no llama-server.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

MAGIC = 0x67677371
VERSION = 4
TOKEN_NULL = 0xFFFFFFFF
PACKED_BLOB_VERSION = 1
GGML_TYPE_F16 = 1
CELL_EXT_SIZE = 12
BLOB_MAGIC = 0xAF143CD8


# ---------------------------------------------------------------------------------------------
# synthetic writer


@dataclass(frozen=True)
class Spec:
    """Shape of a synthetic state file (the defaults: a plain llama-like model, flash attention)."""

    n_layer: int = 4
    row_bytes: int = 512  # bytes per K (and per V) row, i.e. n_embd_kv * sizeof(f16)
    recurrent_bytes: int = 0  # a tail rewritten whole on every save (hybrid models)
    packed: bool = True  # llama-server's packed token blob
    seed: bytes = b"kv-chunk-fs"
    version: int = VERSION  # 1: no n_stream; 2: n_stream; 3: + cell ext; 4: + n_rot_k/n_rot_v
    v_trans: bool = False  # flash attention off: V written one dimension at a time
    el_bytes: int = 2  # V element size (transposed layout)
    cell_ext: int = 0  # bytes of M-RoPE cell extension per record (12 in v4, 8 before)
    n_stream: int = 1  # streams beyond the first are empty (a per-sequence save)
    seq_id: int = 0
    swa_window: int = 0  # > 0: iswa, a second KV cache holding the last swa_window tokens
    swa_layers: int = 2
    recurrent_layers: int = 0  # > 0: hybrid, R and S blocks per recurrent layer (real layout)
    r_row: int = 3072
    s_row: int = 16384
    ggml_type: int = GGML_TYPE_F16  # of the K and V rows (2: q4_0, 18 bytes per 32 values)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layer * self.row_bytes

    @property
    def bytes_per_token(self) -> int:
        """Everything a new token adds: K and V rows, a 12-byte cell record, a 4-byte token id."""
        return self.kv_bytes_per_token + 12 + self.cell_ext + 4


def _prefix_hashes(tokens: Sequence[int], seed: bytes) -> list[bytes]:
    """h[p] identifies tokens[:p+1] (a rolling hash: rows depend on the whole prefix)."""
    out = []
    h = hashlib.blake2b(seed, digest_size=16).digest()
    for t in tokens:
        h = hashlib.blake2b(h + struct.pack("<I", t & 0xFFFFFFFF), digest_size=16).digest()
        out.append(h)
    return out


def _row(h: bytes, layer: int, kind: bytes, n: int) -> bytes:
    return hashlib.shake_128(h + kind + struct.pack("<I", layer)).digest(n)


def token_words(tokens: Sequence[int], packed: bool = True) -> list[int]:
    if not packed:
        return [t & 0xFFFFFFFF for t in tokens]
    return [TOKEN_NULL, PACKED_BLOB_VERSION, len(tokens), *(t & 0xFFFFFFFF for t in tokens), 0]


def _transposed(rows: list[bytes], el: int) -> bytes:
    """Row-major (cells x n_embd elements) to dimension-major, as llama.cpp writes V^T."""
    fmt = {1: "B", 2: "H", 4: "I"}[el]
    n_embd = len(rows[0]) // el
    flat = memoryview(b"".join(rows)).cast(fmt)
    return b"".join(flat[j::n_embd].tobytes() for j in range(n_embd))


def _kv_cache(
    hs: list[bytes], tokens: Sequence[int], first: int, spec: Spec, n_layer: int, tag: bytes
) -> Iterator[bytes]:
    """``llama_kv_cache::state_write`` for cells ``first..len(hs)-1`` of one sequence."""
    cells = range(first, len(hs))
    if spec.version >= 2:
        yield struct.pack("<I", spec.n_stream)
    yield struct.pack("<I", len(cells))
    if cells:
        for p in cells:
            ext = b""
            if spec.cell_ext == 12:
                ext = struct.pack("<iii", p, p, tokens[p])
            elif spec.cell_ext:
                ext = struct.pack("<ii", p, p)
            yield struct.pack("<iI", p, 1) + ext + struct.pack("<i", spec.seq_id)
        yield struct.pack("<II", int(spec.v_trans), n_layer)
        if spec.version >= 4:
            yield struct.pack("<II", 0, 0)  # n_rot_k, n_rot_v
        for il in range(n_layer):
            yield struct.pack("<iQ", spec.ggml_type, spec.row_bytes)
            yield b"".join(_row(hs[p], il, b"K" + tag, spec.row_bytes) for p in cells)
        for il in range(n_layer):
            rows = [_row(hs[p], il, b"V" + tag, spec.row_bytes) for p in cells]
            if spec.v_trans:
                yield struct.pack("<iII", spec.ggml_type, spec.el_bytes, spec.row_bytes // spec.el_bytes)
                yield _transposed(rows, spec.el_bytes)
            else:
                yield struct.pack("<iQ", spec.ggml_type, spec.row_bytes)
                yield b"".join(rows)
    for _ in range(1, spec.n_stream):  # the other streams hold nothing of this sequence
        yield struct.pack("<I", 0)


def _recurrent(hs: list[bytes], spec: Spec) -> Iterator[bytes]:
    """``llama_memory_recurrent::state_write``: one cell, rewritten whole every turn."""
    last = hs[-1] if hs else spec.seed
    if spec.recurrent_bytes:  # the compact form earlier tests used: one R block
        yield struct.pack("<IiIII", 1, max(len(hs) - 1, 0), 0, 0, 1)
        yield struct.pack("<iQ", 0, spec.recurrent_bytes)
        yield _row(last, 0, b"R", spec.recurrent_bytes)
        return
    n_total = spec.n_layer + spec.recurrent_layers
    yield struct.pack("<IiIII", 1, max(len(hs) - 1, 0), 0, 0, n_total)
    for kind, row in ((b"R", spec.r_row), (b"S", spec.s_row)):
        for il in range(spec.recurrent_layers):
            yield struct.pack("<iQ", 0, row) + _row(last, il, kind, row)


def iter_synthetic(tokens: Sequence[int], spec: Spec = Spec()) -> Iterator[bytes]:
    """The file as the sequence of write() calls llama.cpp's io would make."""
    n = len(tokens)
    words = token_words(tokens, spec.packed)
    yield struct.pack("<III", MAGIC, spec.version, len(words))
    yield struct.pack(f"<{len(words)}I", *words)
    hs = _prefix_hashes(tokens, spec.seed)
    yield from _kv_cache(hs, tokens, 0, spec, spec.n_layer, b"")
    if spec.swa_window:
        yield from _kv_cache(hs, tokens, max(0, n - spec.swa_window), spec, spec.swa_layers, b"swa")
    if spec.recurrent_bytes or spec.recurrent_layers:
        yield from _recurrent(hs, spec)


def checkpoint_blob(tokens: Sequence[int], spec: Spec) -> bytes:
    """A context checkpoint as ``llama_state_seq_get_data(..., PARTIAL_ONLY)`` returns it (what a
    second pass appends, or a sidecar holds): magic, seq_id, then the SWA cache or the recurrent
    state."""
    hs = _prefix_hashes(tokens, spec.seed)
    parts = [struct.pack("<Ii", BLOB_MAGIC, spec.seq_id)]
    if spec.swa_window:
        parts += _kv_cache(hs, tokens, max(0, len(tokens) - spec.swa_window), spec, spec.swa_layers, b"swa")
    else:
        parts += _recurrent(hs, spec)
    return b"".join(parts)


def synthetic_bytes(tokens: Sequence[int], spec: Spec = Spec()) -> bytes:
    return b"".join(iter_synthetic(tokens, spec))


def write_synthetic(path: str | os.PathLike, tokens: Sequence[int], spec: Spec = Spec(), buffering: int = 4096) -> int:
    """Write like ``fopen(path, "wb")`` + fwrite + fclose (buffered, sequential, no fsync)."""
    n = 0
    with open(path, "wb", buffering=buffering) as f:
        for piece in iter_synthetic(tokens, spec):
            f.write(piece)
            n += len(piece)
    return n


def synthetic_tokens(n: int, seed: int = 0, vocab: int = 32000) -> list[int]:
    """Deterministic pseudo-random token ids (seed selects the "conversation")."""
    out: list[int] = []
    i = 0
    while len(out) < n:
        d = hashlib.blake2b(struct.pack("<QQ", seed, i), digest_size=64).digest()
        out.extend(x % vocab for x in struct.unpack("<16I", d))
        i += 1
    return out[:n]


# ---------------------------------------------------------------------------------------------
# parser for real files


@dataclass
class Block:
    kind: str  # "K" or "V"
    layer: int
    offset: int  # first row byte
    row_size: int
    n_rows: int

    @property
    def end(self) -> int:
        return self.offset + self.row_size * self.n_rows


@dataclass
class StateInfo:
    size: int
    n_token_words: int
    tokens: list[int]
    packed: bool
    kv_offset: int  # start of the memory state
    cell_count: int = 0
    cell_ext: bool = False
    v_trans: int = 0
    n_layer: int = 0
    blocks: list[Block] = field(default_factory=list)
    kv_end: int = 0  # end of the attention KV section
    tail_bytes: int = 0  # everything after it: recurrent state (+ appended data)

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(b.row_size for b in self.blocks)


def _u32(b: bytes, off: int) -> int:
    return struct.unpack_from("<I", b, off)[0]


def parse_tokens(words: list[int]) -> tuple[list[int], bool]:
    if words and words[0] == TOKEN_NULL:
        if len(words) < 3 or words[1] != PACKED_BLOB_VERSION:
            raise ValueError("unknown packed token blob")
        n = words[2]
        return words[3 : 3 + n], True
    return words, False


def parse_state(data: bytes, *, attention: bool = True) -> StateInfo:
    """Parse header, tokens and (if ``attention``) the attention-KV section of a ggsq file."""
    if len(data) < 12:
        raise ValueError("short file")
    magic, version, n_words = struct.unpack_from("<III", data, 0)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic:#x}")
    if version != VERSION:
        raise ValueError(f"unsupported version {version}")
    words = list(struct.unpack_from(f"<{n_words}I", data, 12))
    tokens, packed = parse_tokens(words)
    off = 12 + 4 * n_words
    info = StateInfo(size=len(data), n_token_words=n_words, tokens=tokens, packed=packed, kv_offset=off)
    if not attention:
        info.kv_end = off
        info.tail_bytes = len(data) - off
        return info
    n_stream = _u32(data, off)
    off += 4
    if n_stream != 1:
        raise ValueError(f"n_stream {n_stream} not supported")
    cell_count = _u32(data, off)
    off += 4
    info.cell_count = cell_count
    if cell_count:
        # meta: find the cell-ext variant under which the following header is consistent
        for ext in (0, CELL_EXT_SIZE):
            p = off
            ok = True
            for _ in range(cell_count):
                if p + 8 > len(data):
                    ok = False
                    break
                n_seq = _u32(data, p + 4)
                if n_seq > 64:
                    ok = False
                    break
                p += 8 + ext + 4 * n_seq
            if not ok or p + 16 > len(data):
                continue
            v_trans, n_layer = struct.unpack_from("<II", data, p)
            if v_trans in (0, 1) and 0 < n_layer < 4096:
                try:
                    blocks, end = _parse_blocks(data, p + 16, n_layer, cell_count, v_trans)
                except (ValueError, struct.error):
                    continue
                info.cell_ext = bool(ext)
                info.v_trans = v_trans
                info.n_layer = n_layer
                info.blocks = blocks
                off = end
                break
        else:
            raise ValueError("cannot parse KV section")
    info.kv_end = off
    info.tail_bytes = len(data) - off
    return info


def _parse_blocks(data: bytes, off: int, n_layer: int, cells: int, v_trans: int):
    blocks = []
    for il in range(n_layer):
        _t, row = struct.unpack_from("<iQ", data, off)
        off += 12
        if row == 0 or off + row * cells > len(data):
            raise ValueError("bad K block")
        blocks.append(Block("K", il, off, row, cells))
        off += row * cells
    if v_trans:
        # transposed V: i32 type, u32 el_size, u32 n_embd_v, then n_embd_v x cells elements
        for il in range(n_layer):
            _t, el, n_embd = struct.unpack_from("<iII", data, off)
            off += 12
            if off + el * n_embd * cells > len(data):
                raise ValueError("bad V block")
            blocks.append(Block("V", il, off, el * n_embd, cells))
            off += el * n_embd * cells
    else:
        for il in range(n_layer):
            _t, row = struct.unpack_from("<iQ", data, off)
            off += 12
            if row == 0 or off + row * cells > len(data):
                raise ValueError("bad V block")
            blocks.append(Block("V", il, off, row, cells))
            off += row * cells
    return blocks, off


def parse_file(path: str | os.PathLike, **kw) -> StateInfo:
    with open(path, "rb") as f:
        return parse_state(f.read(), **kw)


def read_like_restore(path: str | os.PathLike, bufsize: int = 1 << 20) -> bytes:
    """Read a state file the way llama-server restores it: open, read the 12-byte header
    (probe), close; open again and read everything sequentially in one thread."""
    with open(path, "rb") as f:
        head = f.read(12)
    magic, version, _n = struct.unpack("<III", head)
    if magic != MAGIC or version != VERSION:
        raise ValueError("not a ggsq v4 file")
    parts = []
    with open(path, "rb") as f:
        while True:
            b = f.read(bufsize)
            if not b:
                break
            parts.append(b)
    return b"".join(parts)


def copy_stream(src: BinaryIO, dst: BinaryIO, bufsize: int = 1 << 20) -> int:
    n = 0
    while True:
        b = src.read(bufsize)
        if not b:
            return n
        dst.write(b)
        n += len(b)
