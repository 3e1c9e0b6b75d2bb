"""Interop with the real casync: exported chunks + a stub rebuild the snapshot."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import SRC
from ggsq_shapes import ISSUE_FILE
from helpers import rand_bytes, write_in_pieces

from e2e import ggsq

MiB = 1 << 20


@pytest.mark.skipif(shutil.which("casync") is None, reason="casync not installed (scripts/setup-dev.sh installs it)")
def test_casync_extracts_exported_store(kvfs, tmp_path):
    shared = rand_bytes(6 * MiB, 30)
    files = {"one": shared + rand_bytes(MiB + 17, 31), "two": shared + b"\0" * (2 * MiB) + b"end"}
    # a state file: format-aware chunks, some far below chunk_min (headers, counts)
    files["state"] = ggsq.synthetic_bytes(ggsq.synthetic_tokens(700), ggsq.Spec(n_layer=2, row_bytes=1024))
    files["odd"] = ISSUE_FILE  # stored in file order: its token-major form would parse otherwise
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
    file_order = [sys.executable, "-m", "kvchunkfs.cli", "file-order"]
    env = dict(os.environ, PYTHONPATH=str(SRC))  # this checkout's code
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
        back = tmp_path / f"{name}.file"
        # ``file-order --stub`` puts the groups the stub's record lists back and checks the file
        snapshot = kvfs.store / "snapshots" / name  # the stub itself: its file record is an xattr
        r = subprocess.run([*file_order, str(target), str(back), "--stub", str(snapshot)], capture_output=True, env=env)
        assert r.returncode == 0 and not r.stderr, r.stderr
        assert back.read_bytes() == data
        if name != "state":
            assert got == data
            continue
        # a relayout store (the default) stores K/V blocks token-major: casync gives that stream,
        # the same length; ``kv-chunk-fs file-order`` puts it back (without --stub: as it parses)
        assert len(got) == len(data) and got != data
        back.unlink()
        subprocess.run([*file_order, str(target), str(back)], check=True, env=env)
        assert back.read_bytes() == data
        # a stream that is not the snapshot's: refused, nothing written
        target.write_bytes(got[:-1] + bytes([got[-1] ^ 1]))
        back.unlink()
        r = subprocess.run(
            [*file_order, str(target), str(back), "--stub", str(snapshot)], capture_output=True, text=True, env=env
        )
        assert r.returncode == 1 and "checksum" in r.stderr and not back.exists()
