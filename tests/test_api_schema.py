"""The daemon's HTTP API against its description, docs/openapi.json, with schemathesis.

A real daemon serves a small store over TCP behind its token; schemathesis generates requests from
the description (boundary values of every parameter, random valid and invalid ones, sequences of
calls that follow the links it infers) and runs all of its checks on every answer: no 5xx, every
status, content type, header and body as described, valid requests accepted and invalid ones
refused, 401 without the token, 405 and ``Allow`` for the methods not served. Bounded: a fixed
seed and a fixed number of examples per operation (about a minute here);
``KVCFS_SCHEMATHESIS_SEED`` picks another seed.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TESTS, Mount
from helpers import rand_bytes

ROOT = TESTS.parent
SPEC = ROOT / "docs" / "openapi.json"
TOKEN = "schema-test-token"
SEED = int(os.environ.get("KVCFS_SCHEMATHESIS_SEED", "1"))
EXAMPLES = 100  # per operation, in the fuzzing phase (the coverage phase makes every case it knows)
SCENARIOS = 40  # call sequences in the stateful phase


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ggsq(tokens: list[int]) -> bytes:
    """A llama-server state file (plain token layout) the prefix tree and prefix-match can read."""
    return struct.pack("<3I", 0x67677371, 4, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens) + bytes(4096)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[Mount, int]]:
    port = free_port()
    m = Mount(tmp_path / "store", tmp_path / "mnt", tmp_path / "daemon.log")
    m.start(extra=["--api-address", f"127.0.0.1:{port}", "--api-token", TOKEN])
    try:
        (m.mnt / "a").write_bytes(ggsq([1, 2, 3, 4]))
        (m.mnt / "b").write_bytes(ggsq([1, 2, 9]))
        (m.mnt / "junk").write_bytes(rand_bytes(50_000, 7))
        (m.mnt / "empty").write_bytes(b"")
        os.mkdir(m.mnt / "dir")
        (m.mnt / "dir" / "c").write_bytes(ggsq([5, 6]))
        os.setxattr(m.mnt / "a", "user.kvcfs.label.model", b"qwen")
        yield m, port
    finally:
        m.stop()


def schemathesis(port: int, cwd: Path, *args: str) -> str:
    """One ``schemathesis run`` against the daemon with every check; its report, asserted clean."""
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "--no-color", "run", str(SPEC),
        "--url", f"http://127.0.0.1:{port}", "--header", f"Authorization: Bearer {TOKEN}",
        "--checks", "all", "--seed", str(SEED), "--workers", "1",
        # Path parameters with astral characters are dropped by schemathesis (they would be split into
        # surrogates); {path} takes any string, so many are, and Hypothesis would call that a failure.
        "--suppress-health-check", "filter_too_much",
        *args,
    ]  # fmt: skip
    # The one rule the description cannot state (after= needs sort=path) is in the hooks module.
    env = dict(os.environ, SCHEMATHESIS_HOOKS="schemathesis_hooks", PYTHONPATH=str(TESTS))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    report = r.stdout + r.stderr
    assert r.returncode == 0, report[-20000:]
    return report


def cases_passed(report: str) -> int:
    m = re.search(r"(\d+) generated, (\d+) passed", report)
    assert m is not None and m.group(1) == m.group(2), report[-5000:]
    return int(m.group(2))


def test_the_api_answers_as_its_description_says(daemon: tuple[Mount, int], tmp_path: Path) -> None:
    m, port = daemon
    report = schemathesis(port, tmp_path, "--phases", "examples,coverage,fuzzing", "--max-examples", str(EXAMPLES))
    assert "Tested: 14" in report, report[-5000:]  # every operation of the description
    assert cases_passed(report) >= 5 * EXAMPLES  # the operations that take input: the others make one case
    report = schemathesis(port, tmp_path, "--phases", "stateful", "--max-examples", str(SCENARIOS))
    scenarios = re.search(r"Scenarios:\s+(\d+)", report)
    assert scenarios is not None and int(scenarios.group(1)) >= SCENARIOS, report[-5000:]
    assert m.proc is not None and m.proc.poll() is None, "the daemon died"
    assert "Traceback" not in m.log() and " ERROR " not in m.log(), m.log()[-5000:]
