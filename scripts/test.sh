#!/usr/bin/env bash
# Set up for tests (scripts/setup-dev.sh: the test-only system packages and .venv), then the test
# tiers in fail-fast order (Makefile): lint and types; unit tests (no FUSE); the exhaustive
# window splits of a save (`slow`); the real-mount suite (root and /dev/fuse); its core, crash
# and staged-save tests again with passthrough off (served mode); a "busy machine"
# round: the core save tests again with a CPU hog beside them and storing saves slowed and sped at
# random (tests/conftest.py BUSY). Everything runs on .venv/bin/python.
# Arguments, if any, are passed to one pytest run instead of the tiers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-dev.sh
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
make PYTHON=.venv/bin/python lint unit slow fuse served busy
