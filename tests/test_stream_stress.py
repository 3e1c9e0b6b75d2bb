"""Streaming paths on a real mount with the chunker worker slowed and sped at random.

Every round does the same file calls on the mount and on a plain directory and compares the bytes:
writes of every size from 1 B to 3 MiB, llama-server's two-pass save (write, then reopen in append
mode), O_TRUNC rewrites, a ``.tmp`` renamed while it is still being written, and reads during the
write. The daemon is tests/jitter_daemon.py (the real daemon with random sleeps between the worker's
steps); with ``KVCFS_TEST_BUSY=1`` a CPU hog runs beside it too. ``KVCFS_STRESS_ROUNDS`` sets the
number of rounds (default 60).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from conftest import Mount
from helpers import read_direct

MiB = 1 << 20
ROUNDS = int(os.environ.get("KVCFS_STRESS_ROUNDS", "60"))
SIZES = (1, 7, 4095, 4096, 4097, 65536, 65537, MiB, 3 * MiB)


@pytest.fixture
def jittered(tmp_path: Path):
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log", jitter=True)
    m.start()
    try:
        yield m
    finally:
        m.stop()


def write_sizes(rng: random.Random) -> list[int]:
    out = []
    total = rng.randrange(1, 14 * MiB)
    while total > 0:
        n = min(total, rng.choice(SIZES) if rng.random() < 0.7 else rng.randrange(1, 3 * MiB + 1))
        out.append(n)
        total -= n
    return out


class Pair:
    """The same calls on the mount and on a plain directory."""

    def __init__(self, mnt: Path, plain: Path, rng: random.Random) -> None:
        self.dirs = (mnt, plain)
        self.rng = rng

    def write(self, name: str, mode: str, check_during: bool = False, rename_to: str | None = None) -> None:
        sizes = write_sizes(self.rng)
        data = self.rng.randbytes(sum(sizes))
        files = [open(d / name, mode) for d in self.dirs]  # noqa: SIM115 - closed below
        rename_at = self.rng.randrange(len(sizes)) if rename_to else -1
        try:
            pos = 0
            for i, n in enumerate(sizes):
                for f in files:
                    f.write(data[pos : pos + n])
                    f.flush()
                pos += n
                if i == rename_at:
                    for d in self.dirs:
                        os.rename(d / name, d / rename_to)
                    name = rename_to
                if check_during and self.rng.random() < 0.3:
                    assert read_direct(self.dirs[0] / name) == (self.dirs[1] / name).read_bytes(), f"during {name}"
        finally:
            for f in files:
                f.close()

    def check(self, name: str) -> None:
        mnt, plain = self.dirs
        want = (plain / name).read_bytes()
        assert (mnt / name).stat().st_size == len(want), name
        assert read_direct(mnt / name) == want, name


def test_streaming_rounds_match_plain_files(jittered, plain):
    rounds = 0
    for r in range(ROUNDS):
        rng = random.Random(r)
        pair = Pair(jittered.mnt, plain, rng)
        name = f"s{r}"
        kind = r % 5
        if kind == 0:  # one pass, writes of every size, reads while writing
            pair.write(name, "wb", check_during=True)
        elif kind == 1:  # llama-server's two-pass save: state, then checkpoints appended
            pair.write(name, "wb")
            pair.write(name, "ab")
        elif kind == 2:  # O_TRUNC rewrite, shorter or longer
            pair.write(name, "wb")
            pair.check(name)
            pair.write(name, "wb")
        elif kind == 3:  # the proxy's save: NAME.tmp renamed to NAME while the worker still cuts
            pair.write(name, "wb")
            pair.write(name + ".tmp", "wb", rename_to=name)
        else:  # append while reading during the write
            pair.write(name, "wb")
            pair.write(name, "ab", check_during=True)
        pair.check(name)
        rounds += 1
    jittered.remount()
    for r in range(ROUNDS):
        Pair(jittered.mnt, plain, random.Random(r)).check(f"s{r}")
    assert rounds == ROUNDS
    print(f"{rounds} streaming rounds matched plain files (busy={os.environ.get('KVCFS_TEST_BUSY') == '1'})")
