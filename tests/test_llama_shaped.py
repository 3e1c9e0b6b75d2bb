"""llama-server's file operations on the real mount, with synthetic state files (no build needed).

The same sequence as llama-server behind the proxy (see e2e/run.py for the real thing):
``fopen("NAME.tmp", "wb")`` + sequential fwrites of a ggsq v4 file, rename to ``NAME``, utime
touch; the next turn appends rows at the end of every per-layer K/V block; a second pass reopens
the file in append mode for checkpoints; restore opens the file twice and reads it sequentially.

"new bytes" is the growth of the files under STORE/packs/.
"""

from __future__ import annotations

import os
from pathlib import Path

from e2e import ggsq
from e2e.mount import dir_bytes

SPEC = ggsq.Spec(n_layer=4, row_bytes=1024)  # 8 KiB of KV per token: 16 insertion points/turn
SYSTEM = ggsq.synthetic_tokens(1000, seed=100)


def packs(kvfs) -> int:
    return dir_bytes(Path(kvfs.store) / "packs")


def proxy_save(mnt: Path, name: str, tokens: list[int], spec: ggsq.Spec = SPEC) -> int:
    """llama-server writes NAME.tmp; the proxy renames it over NAME and touches it."""
    tmp = mnt / f"{name}.tmp"
    n = ggsq.write_synthetic(tmp, tokens, spec)
    os.rename(tmp, mnt / name)
    os.utime(mnt / name)
    return n


def save_measured(kvfs, name: str, tokens: list[int], spec: ggsq.Spec = SPEC) -> tuple[int, int]:
    kvfs.ingested()  # saves are stored behind their close: earlier ones are not this one's bytes
    before = packs(kvfs)
    size = proxy_save(Path(kvfs.mnt), name, tokens, spec)
    kvfs.ingested()
    return size, packs(kvfs) - before


def conversation(seed: int, turns: int, first: int = 200, per_turn: int = 250) -> list[list[int]]:
    toks = SYSTEM + ggsq.synthetic_tokens(first, seed=seed * 1000)
    out = [toks]
    for t in range(1, turns):
        toks = toks + ggsq.synthetic_tokens(per_turn, seed=seed * 1000 + t)
        out.append(toks)
    return out


def test_llama_shaped_turns_restore_and_remount(kvfs):
    mnt = Path(kvfs.mnt)
    conv_a = conversation(seed=1, turns=3)
    conv_b = conversation(seed=2, turns=2)
    expected: dict[str, bytes] = {}

    # conversation A: one snapshot rewritten every turn
    news = []
    for i, toks in enumerate(conv_a):
        size, new = save_measured(kvfs, "conv-a", toks)
        data = ggsq.synthetic_bytes(toks, SPEC)
        assert size == len(data)
        assert (mnt / "conv-a").stat().st_size == size
        assert ggsq.read_like_restore(mnt / "conv-a") == data
        assert not (mnt / "conv-a.tmp").exists()
        news.append((size, new))
        if i == 0:
            assert new > 0, "the first save must store something (is STORE/packs/ written?)"
        else:
            grown = len(toks) - len(conv_a[i - 1])
            minimum = grown * SPEC.bytes_per_token
            # turn N+1 stores the new rows plus each K/V block's last partial stride (< 64 rows
            # with the default 64 KiB average) and the token list/cell records' last chunks: at
            # most 8 x 64 KiB + ~64 KiB over the minimum here (plain CDC: 1.4-1.8x the minimum)
            assert new < size / 3, f"turn {i + 1}: {new} new bytes of {size}"
            assert new < minimum + 9 * 64 * 1024, f"turn {i + 1}: {new} new bytes, minimum {minimum}"
        expected["conv-a"] = data

    # second conversation sharing conversation A's system prompt
    for i, toks in enumerate(conv_b):
        size, new = save_measured(kvfs, "conv-b", toks)
        data = ggsq.synthetic_bytes(toks, SPEC)
        assert ggsq.read_like_restore(mnt / "conv-b") == data
        if i == 0:
            shared = len(SYSTEM) / len(toks)  # ~83% of the tokens are the shared prefix
            assert new < size * (1 - shared / 2), f"conv-b: {new} new bytes of {size}"
        expected["conv-b"] = data

    # second pass: reopen the saved file in append mode and add checkpoint-like data
    tail = b"CKPT" + os.urandom(64 * 1024 - 4)
    kvfs.ingested()
    before = packs(kvfs)
    with open(mnt / "conv-a", "ab", buffering=4096) as f:
        for i in range(0, len(tail), 10000):
            f.write(tail[i : i + 10000])
    os.utime(mnt / "conv-a")
    kvfs.ingested()
    new = packs(kvfs) - before
    expected["conv-a"] += tail
    assert (mnt / "conv-a").stat().st_size == len(expected["conv-a"])
    assert new < len(expected["conv-a"]) / 4, f"append stored {new} bytes: a full rewrite?"

    # restore: probe + sequential read, twice (warm)
    for _ in range(2):
        for name, data in expected.items():
            assert ggsq.read_like_restore(mnt / name) == data
    info = ggsq.parse_file(mnt / "conv-a")
    assert info.tokens == conv_a[-1]
    assert info.kv_bytes_per_token == SPEC.kv_bytes_per_token
    assert info.tail_bytes == len(tail)

    # the snapshots survive a remount (no hot copy: put back from the stored chunks)
    kvfs.remount(["--hot-tier-size", "0"])
    mnt = Path(kvfs.mnt)
    assert sorted(os.listdir(mnt)) == ["conv-a", "conv-b"]
    for name, data in expected.items():
        assert (mnt / name).stat().st_size == len(data)
        assert ggsq.read_like_restore(mnt / name) == data

    # and the next turn after the restart still dedups against the stored chunks
    nxt = conv_a[-1] + ggsq.synthetic_tokens(250, seed=1999)
    size, new = save_measured(kvfs, "conv-a", nxt)
    assert ggsq.read_like_restore(mnt / "conv-a") == ggsq.synthetic_bytes(nxt, SPEC)
    assert new < size / 3, f"after remount: {new} new bytes of {size}"


def test_llama_shaped_hybrid_state_and_plain_tokens(kvfs):
    """Recurrent state rewritten whole every turn, and the older unpacked token list."""
    mnt = Path(kvfs.mnt)
    spec = ggsq.Spec(n_layer=2, row_bytes=1024, recurrent_bytes=512 * 1024, packed=False)
    t1 = SYSTEM[:600]
    t2 = t1 + ggsq.synthetic_tokens(100, seed=7)
    proxy_save(mnt, "hyb", t1, spec)
    size, new = save_measured(kvfs, "hyb", t2, spec)
    data = ggsq.synthetic_bytes(t2, spec)
    assert ggsq.read_like_restore(mnt / "hyb") == data
    info = ggsq.parse_state(data)
    assert not info.packed and info.tokens == t2
    minimum = 100 * spec.bytes_per_token + spec.recurrent_bytes
    assert new >= spec.recurrent_bytes  # the recurrent state is new every time
    assert new < 2.5 * minimum, f"{new} new bytes, minimum {minimum}"
    assert new < size


def test_llama_shaped_rewrite_same_name_in_place(kvfs):
    """A save straight onto an existing NAME (no .tmp): fopen "wb" truncates, content replaced."""
    mnt = Path(kvfs.mnt)
    long = SYSTEM[:800]
    short = SYSTEM[:300]
    ggsq.write_synthetic(mnt / "direct", long, SPEC)
    ggsq.write_synthetic(mnt / "direct", short, SPEC)
    data = ggsq.synthetic_bytes(short, SPEC)
    assert (mnt / "direct").stat().st_size == len(data)
    assert ggsq.read_like_restore(mnt / "direct") == data
    kvfs.remount()
    assert ggsq.read_like_restore(Path(kvfs.mnt) / "direct") == data
