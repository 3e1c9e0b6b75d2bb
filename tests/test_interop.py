"""Interop with the real casync: exported chunks + a stub rebuild the snapshot."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from helpers import rand_bytes, write_in_pieces

from e2e import ggsq

MiB = 1 << 20


@pytest.mark.skipif(shutil.which("casync") is None, reason="casync not installed (scripts/setup-dev.sh installs it)")
def test_casync_extracts_exported_store(kvfs, tmp_path):
    shared = rand_bytes(6 * MiB, 30)
    files = {"one": shared + rand_bytes(MiB + 17, 31), "two": shared + b"\0" * (2 * MiB) + b"end"}
    # a state file: format-aware chunks, some far below chunk_min (headers, counts)
    files["state"] = ggsq.synthetic_bytes(ggsq.synthetic_tokens(700), ggsq.Spec(n_layer=2, row_bytes=1024))
    for name, data in files.items():
        write_in_pieces(kvfs.path(name), data, MiB)
    dest = tmp_path / "castore"
    out = subprocess.run(
        [sys.executable, "-m", "kvchunkfs.cli", "export-store", "--store", str(kvfs.store), str(dest)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "exported" in out.stdout
    chunk_files = [p for p in dest.rglob("*") if p.is_file()]
    assert chunk_files and all(len(p.name) == 64 and p.parent.name == p.name[:4] for p in chunk_files)
    for name, data in files.items():
        target = tmp_path / f"{name}.out"
        stub = tmp_path / f"{name}.caibx"  # casync picks the format by file suffix
        shutil.copyfile(kvfs.store / "snapshots" / name, stub)
        subprocess.run(
            ["casync", "--digest=sha256", f"--store={dest}", "extract", str(stub), str(target)],
            check=True,
            capture_output=True,
        )
        got = target.read_bytes()
        if name != "state":
            assert got == data
            continue
        # a relayout store (the default) stores K/V blocks token-major: casync gives that stream,
        # the same length; ``kv-chunk-fs file-order`` puts it back
        assert len(got) == len(data) and got != data
        back = tmp_path / "state.file"
        subprocess.run([sys.executable, "-m", "kvchunkfs.cli", "file-order", str(target), str(back)], check=True)
        assert back.read_bytes() == data
