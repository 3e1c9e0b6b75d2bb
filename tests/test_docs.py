"""The documents name things that exist: source paths, runnable modules, and a regenerate command
for the committed OpenAPI description that gives exactly the committed file."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import SRC

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_source_path_and_module_the_docs_name_exists() -> None:
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for path in re.findall(r"\b(src/kvchunkfs/[\w./-]*\w)", text):
            if not (ROOT / path).exists():
                missing.append(f"{doc.name}: {path}")
        for module in re.findall(r"python3? -m (kvchunkfs[\w.]*)", text):
            if importlib.util.find_spec(module) is None:
                missing.append(f"{doc.name}: python -m {module}")
    assert not missing, missing


def test_the_openapi_regenerate_command_of_api_md_gives_the_committed_file() -> None:
    found = re.search(r"regenerate with `([^`]+?) > docs/openapi\.json`", (ROOT / "docs/api.md").read_text())
    assert found, "docs/api.md says how to regenerate docs/openapi.json"
    argv = shlex.split(found.group(1))
    assert argv[0] == "python"
    r = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(SRC)),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout == (ROOT / "docs/openapi.json").read_text()


README_OPS = ["first save", "next-turn save", "cold restore", "warm restore"]  # its columns, in order


def measured() -> dict[tuple[str, str], tuple[float, float]]:
    """(state file, op) -> (plain ms, kv-chunk-fs ms) of benchmarks.md's "Passthrough, default
    settings" table (cells "plain / kv-chunk-fs (ratio...)")."""
    text = (ROOT / "docs/benchmarks.md").read_text()
    text = text[text.index("**Passthrough, default settings**") :]
    out = {}
    for line in text[: text.index("\n\n", text.index("| state file |"))].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not re.match(r"(f16|q4_0), ", cells[0]):
            continue
        for op, cell in zip(README_OPS, cells[1:5], strict=True):
            plain, ours = re.match(r"([\d.]+) / ([\d.]+)", cell).groups()  # type: ignore[union-attr]
            out[(cells[0], op)] = (float(plain), float(ours))
    return out


def test_readmes_performance_table_compares_with_a_plain_file_in_measured_figures() -> None:
    figures = measured()
    assert len(figures) >= 12  # README shows three of the measured state files
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Performance") :]
    header = next(line for line in table.splitlines() if line.startswith("| state file"))
    columns = [h.strip() for h in header.strip("|").split("|")][1:5]
    assert columns == ["first save", "next-turn save", "restore after a daemon restart (caches dropped)",
                       "restore right after"]  # fmt: skip
    rows = [line for line in table.splitlines() if line.startswith("| f16") or line.startswith("| q4_0")]
    assert len(rows) == 3
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for op, cell in zip(README_OPS, cells[1:5], strict=True):
            m = re.fullmatch(r"([\d.]+) / ([\d.]+) ms \(([\d.]+)x\)", cell)
            assert m, f"{cells[0]} {op}: {cell!r} is not 'plain / kv-chunk-fs ms (ratio)'"
            plain, ours, ratio = map(float, m.groups())
            want_plain, want_ours = figures[(cells[0], op)]
            assert abs(plain - want_plain) <= 0.05 * want_plain, (cells[0], op, cell, want_plain)
            assert abs(ours - want_ours) <= 0.05 * want_ours, (cells[0], op, cell, want_ours)
            assert abs(ratio - want_ours / want_plain) <= 0.05 * want_ours / want_plain + 0.01, (cells[0], op, cell)
