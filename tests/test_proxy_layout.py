"""The proxy's reading of a llama.cpp slot file's KV layout (proxy/layout.py): what llama-server
checks before it loads one, from the headers alone, over the layouts e2e/ggsq.py writes."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from e2e import ggsq
from kvchunkfs.proxy.layout import describe_file, tag

TOKENS = ggsq.synthetic_tokens(40)


def layout_of(tmp_path: Path, spec: ggsq.Spec, tokens: list[int] = TOKENS) -> str | None:
    path = tmp_path / "state"
    ggsq.write_synthetic(path, tokens, spec)
    return describe_file(path)


SPECS = {
    "plain": ggsq.Spec(),
    "v transposed": ggsq.Spec(v_trans=True),
    "m-rope cells": ggsq.Spec(cell_ext=12),
    "four streams": ggsq.Spec(n_stream=4),
    "iswa": ggsq.Spec(swa_window=16),
    "hybrid": ggsq.Spec(recurrent_layers=3, n_layer=2),
    "other rows": ggsq.Spec(row_bytes=288),
    "more layers": ggsq.Spec(n_layer=6),
    "version 3": ggsq.Spec(version=3, cell_ext=8),
}


def test_every_layout_is_read_and_told_apart(tmp_path: Path) -> None:
    found = {name: layout_of(tmp_path, spec) for name, spec in SPECS.items()}
    assert None not in found.values(), found
    assert len(set(found.values())) == len(found), found  # each a layout of its own
    assert found["plain"] == "v4 kv s1 ext0 vt0 L4 rk0 rv0 K1:512*4 V1:512*4"
    assert len({tag(text) for text in found.values() if text}) == len(found)


@pytest.mark.parametrize("n", [1, 40, 300])
def test_the_layout_does_not_depend_on_the_tokens(tmp_path: Path, n: int) -> None:
    assert layout_of(tmp_path, ggsq.Spec(), ggsq.synthetic_tokens(n, seed=n)) == layout_of(tmp_path, ggsq.Spec())


def test_a_quantized_cache_and_its_rotation_differ_from_f16(tmp_path: Path) -> None:
    path = tmp_path / "state"
    ggsq.write_synthetic(path, TOKENS, ggsq.Spec())
    data = bytearray(path.read_bytes())
    f16 = describe_file(path)
    rot = data.find(struct.pack("<4I", 0, 4, 0, 0))  # v_trans, n_layer, n_rot_k, n_rot_v
    assert rot > 0
    data[rot + 8 : rot + 16] = struct.pack("<2I", 64, 64)  # llama.cpp's Hadamard rotation for q4_0
    path.write_bytes(bytes(data))
    assert describe_file(path) not in (None, f16)


def test_what_is_not_a_whole_state_file_has_no_layout(tmp_path: Path) -> None:
    path = tmp_path / "state"
    ggsq.write_synthetic(path, TOKENS, ggsq.Spec())
    whole = path.read_bytes()
    for broken in (whole[:-1], whole + b"\0", b"not a state file", whole[:100], b""):
        path.write_bytes(broken)
        assert describe_file(path) is None, len(broken)
