"""Hypothesis strategies for llama.cpp state files of every shape the parser accepts (and some it
gives up on): versions 1-4, token words (plain or llama-server's packed blob), one or more KV
sections of one or more streams (empty streams, cell records with 0/8/12 extension bytes and one
or more sequence ids), v_trans 0/1 with element sizes 1-8, rows down to one byte, several layers
and tensor types, a recurrent section, an appended checkpoint blob, trailing bytes, a cut-off end.

Row bytes come from a small alphabet as often as not (words 0, 1, 2: what headers and cell records
are made of), so that a permuted group can look like headers to a parser that reads into it.
"""

from __future__ import annotations

import random
import struct

from hypothesis import strategies as st

MAGIC = 0x67677371
BLOB_MAGIC = 0xAF143CD8
TOKEN_NULL = 0xFFFFFFFF

small_words = st.sampled_from([0, 1, 2])


SMALL = 64  # rows up to this many bytes are drawn byte by byte; longer ones from a drawn seed


@st.composite
def filler(draw: st.DrawFn, n: int) -> bytes:
    """``n`` bytes of row data: random, words of 0/1/2, or zeros."""
    if n <= 0:
        return b""
    kind = draw(st.sampled_from(["random", "words", "zeros"]))
    if kind == "zeros":
        return bytes(n)
    words = (n + 3) // 4
    if n > SMALL:  # hypothesis keeps its choices small: a seed stands for the rest
        rng = random.Random(draw(st.integers(0, 2**32 - 1)))
        if kind == "random":
            return rng.randbytes(n)
        return struct.pack(f"<{words}I", *rng.choices([0, 1, 2], k=words))[:n]
    if kind == "random":
        return draw(st.binary(min_size=n, max_size=n))
    return struct.pack(f"<{words}I", *draw(st.lists(small_words, min_size=words, max_size=words)))[:n]


@st.composite
def tokens(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):  # llama-server's packed blob
        toks = draw(st.lists(st.integers(0, 2**32 - 1), max_size=5))
        words = [TOKEN_NULL, 1, len(toks), *toks, 0]
    else:
        words = draw(st.lists(st.one_of(small_words, st.integers(0, 2**32 - 1)), max_size=6))
    return struct.pack(f"<I{len(words)}I", len(words), *words)


@st.composite
def cell_records(draw: st.DrawFn, cells: int, version: int) -> bytes:
    ext = draw(st.sampled_from([0, 8, 12])) if version >= 3 else 0
    out = bytearray()
    for _ in range(cells):
        n_seq = draw(st.sampled_from([1, 1, 1, 2, 3]))
        out += struct.pack("<iI", draw(st.integers(0, 40)), n_seq)
        out += draw(filler(ext))
        out += struct.pack(f"<{n_seq}i", *draw(st.lists(st.integers(0, 3), min_size=n_seq, max_size=n_seq)))
    return bytes(out)


@st.composite
def kv_stream(draw: st.DrawFn, version: int, max_cells: int, max_layers: int, max_row: int) -> bytes:
    cells = draw(st.integers(0, max_cells))
    out = bytearray(struct.pack("<I", cells))
    if not cells:
        return bytes(out)
    out += draw(cell_records(cells, version))
    v_trans = draw(st.integers(0, 1))
    n_layer = draw(st.integers(1, max_layers))
    out += struct.pack("<II", v_trans, n_layer)
    if version >= 4:
        out += struct.pack("<II", draw(small_words), draw(small_words))
    row = draw(st.integers(1, max_row))
    typ = draw(st.sampled_from([0, 1, 1, 8, 30]))
    uneven = draw(st.integers(0, 9)) == 0  # a layer of another width (damage, or per-layer widths)
    for il in range(n_layer):
        width = row + (il if uneven else 0)
        out += struct.pack("<iQ", typ, width) + draw(filler(cells * width))
    v_layers = n_layer if draw(st.integers(0, 7)) else draw(st.integers(0, n_layer))  # some without V
    el = draw(st.sampled_from([1, 2, 4, 8]))
    n_embd = draw(st.integers(1, max(1, max_row // el)))
    for _ in range(v_layers):
        if v_trans:
            out += struct.pack("<iII", typ, el, n_embd) + draw(filler(n_embd * cells * el))
        else:
            out += struct.pack("<iQ", typ, row) + draw(filler(cells * row))
    return bytes(out)


@st.composite
def kv_section(draw: st.DrawFn, version: int, max_cells: int, max_layers: int, max_row: int) -> bytes:
    n_stream = draw(st.integers(1, 3))
    out = bytearray(struct.pack("<I", n_stream) if version >= 2 else b"")
    for _ in range(n_stream if version >= 2 else 1):
        out += draw(kv_stream(version, max_cells, max_layers, max_row))
    return bytes(out)


@st.composite
def recurrent_section(draw: st.DrawFn, max_row: int) -> bytes:
    cells = draw(st.integers(0, 2))
    out = bytearray(struct.pack("<I", cells))
    for _ in range(cells):
        out += struct.pack("<iIi", draw(st.integers(0, 9)), 1, 0)
    n_layer = draw(st.integers(1, 2))
    out += struct.pack("<II", 0, n_layer)
    for _ in range(2 * n_layer):
        row = draw(st.integers(1, max_row))
        out += struct.pack("<iQ", 0, row) + draw(filler(cells * row))
    return bytes(out)


@st.composite
def tiny_ggsq_files(draw: st.DrawFn) -> bytes:
    """A small v3/v4 file whose every value is 0, 1 or 2 (records, extensions, counts, types, rows):
    where one cell-record guess reads another's bytes as headers. About one in 150 of them stores
    a form that parses to other groups than the file."""
    small = st.integers(0, 2)
    version = draw(st.sampled_from([3, 4]))
    cells = draw(st.integers(1, 3))
    ext = draw(st.sampled_from([0, 8, 12]))
    out = bytearray(struct.pack("<IIIII", MAGIC, version, 0, 1, cells))
    for _ in range(cells):
        n_seq = draw(st.sampled_from([1, 1, 2]))
        out += struct.pack("<iI", draw(small), n_seq)
        out += struct.pack(f"<{ext // 4}I", *(draw(small) for _ in range(ext // 4)))
        out += struct.pack(f"<{n_seq}i", *(draw(small) for _ in range(n_seq)))
    n_layer = draw(st.integers(1, 3))
    out += struct.pack("<II", 0, n_layer)
    if version >= 4:
        out += struct.pack("<II", draw(small), draw(small))
    row = draw(st.integers(1, 3))
    for _ in range(2 * n_layer):
        out += struct.pack("<iQ", draw(small), row) + bytes(draw(small) for _ in range(cells * row))
    return bytes(out)


@st.composite
def ggsq_files(draw: st.DrawFn, max_cells: int = 6, max_layers: int = 4, max_row: int = 24) -> bytes:
    """A state file: header, token words, memory sections, maybe a blob, a tail, a cut (a third of
    them ``tiny_ggsq_files``)."""
    if draw(st.integers(0, 2)) == 0:
        return draw(tiny_ggsq_files())
    version = draw(st.integers(1, 4))
    out = bytearray(struct.pack("<II", MAGIC, version)) + draw(tokens())
    for _ in range(draw(st.integers(1, 2))):  # an iswa model has two KV caches
        out += draw(kv_section(version, max_cells, max_layers, max_row))
    if draw(st.integers(0, 3)) == 0:
        out += draw(recurrent_section(max_row))
    if draw(st.integers(0, 3)) == 0:  # a second pass appends a checkpoint blob
        out += struct.pack("<Ii", BLOB_MAGIC, 0) + draw(kv_section(4, max_cells, max_layers, max_row))
    if draw(st.integers(0, 4)) == 0:
        out += draw(filler(draw(st.integers(1, 40))))
    if draw(st.integers(0, 5)) == 0:  # cut off anywhere
        return bytes(out[: draw(st.integers(0, len(out)))])
    return bytes(out)


# The file of the report that found a stored form parsing otherwise: ggsq v4, 1 stream, 2 cells
# whose records carry 8 extension bytes, v_trans 0, 2 layers of K and V (type 1, row size 1).
ISSUE_FILE = bytes.fromhex(
    (
        "71736767 04000000 00000000 01000000 02000000"
        + " 02000000 01000000 02000000 02000000 02000000" * 2
        + " 00000000 02000000 00000000 00000000"
        + " 01000000 0100000000000000 0000" * 4
    ).replace(" ", "")
)
