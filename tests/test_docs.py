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
