#!/usr/bin/env bash
# Set up, lint, then run the whole test suite (real FUSE mounts; needs root and /dev/fuse).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ruff check src tests benchmarks e2e
python3 -m pytest -q -p no:cacheprovider "$@"
