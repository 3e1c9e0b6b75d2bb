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


README_CONFIGS = {  # README's row label (its start) -> the config in benchmarks.md's interleaved table
    "f16, 10 MiB": "f16-10M",
    "f16, 30 MiB": "f16-30M",
    "f16, 110 MiB": "f16-110M",
    "q4_0, 10 MiB": "q4-10M",
    "q4_0, 110 MiB": "q4-110M-l32",
}
README_OPS = ["cold restore", "warm restore", "next-turn save", "first save"]


def measured() -> dict[tuple[str, str], tuple[float, float]]:
    """(config, op) -> (plain ms, kv-chunk-fs ms) of benchmarks.md's "This version against the
    previous one" table."""
    text = (ROOT / "docs/benchmarks.md").read_text()
    text = text[text.index("### This version against the previous one") :]
    out, config = {}, ""
    for line in text[: text.index("\n\n", text.index("| config | op |"))].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 5 or not re.match(r"[\d.]+ \(", cells[2]):
            continue
        config = cells[0].split(" ")[0] or config
        out[(config, cells[1])] = (float(cells[2].split()[0]), float(cells[4].split()[0]))
    return out


def test_readmes_performance_table_compares_with_a_plain_file_in_measured_figures() -> None:
    figures = measured()
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Performance") :]
    header = next(line for line in table.splitlines() if line.startswith("| snapshot"))
    columns = [h.strip() for h in header.strip("|").split("|")][1:5]
    assert columns == ["cold restore (kv-chunk-fs after a daemon restart)", *README_OPS[1:]]
    rows = [line for line in table.splitlines() if line.startswith("| f16") or line.startswith("| q4_0")]
    assert len(rows) == len(README_CONFIGS)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        config = next(c for label, c in README_CONFIGS.items() if cells[0].startswith(label))
        for op, cell in zip(README_OPS, cells[1:5], strict=True):
            m = re.fullmatch(r"([\d.]+) / ([\d.]+) ms \(([\d.]+)x\)", cell)
            assert m, f"{config} {op}: {cell!r} is not 'plain / kv-chunk-fs ms (ratio)'"
            plain, ours, ratio = map(float, m.groups())
            want_plain, want_ours = figures[(config, op)]
            assert abs(plain - want_plain) <= 0.05 * want_plain, (config, op, cell, want_plain)
            assert abs(ours - want_ours) <= 0.05 * want_ours, (config, op, cell, want_ours)
            assert abs(ratio - want_ours / want_plain) <= 0.05 * want_ours / want_plain, (config, op, cell)
