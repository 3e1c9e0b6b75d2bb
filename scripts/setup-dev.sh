#!/usr/bin/env bash
# Set up tests and development (scripts/test.sh runs it first): the system packages of
# scripts/setup.sh plus what only the tests need (scripts/lib.sh: TEST_PKGS: Chromium and its driver,
# casync, attr, make), with apt as root; then the virtual environment .venv in this checkout with
# every pin of requirements.lock (runtime, test and dev extras) and the package itself, editable.
# The Makefile's targets use .venv/bin/python when it exists. PYTHON picks the interpreter (default:
# the first Python >= 3.11 on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

venv=$PWD/.venv
py=$(find_python)
pyneed=$(python_packages "$py")
read -ra pypkgs <<<"$pyneed"
ensure_packages "${RUNTIME_PKGS[@]}" "${TEST_PKGS[@]}" "${pypkgs[@]}"
make_venv "$venv" "$py"
# The pins first, then the package without resolving its dependencies again.
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r requirements.lock
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
