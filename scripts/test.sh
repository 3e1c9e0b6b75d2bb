#!/usr/bin/env bash
# Set up, lint, type-check, then run the whole test suite (real FUSE mounts; needs root and /dev/fuse).
# With no arguments it ends with a "busy machine" round: the core streaming tests again with a
# CPU hog beside them and the chunker worker slowed and sped at random (tests/conftest.py BUSY).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ruff check src tests benchmarks e2e
python3 -m mypy
python3 -m pytest -q -p no:cacheprovider "$@"
if [ $# -eq 0 ]; then
    KVCFS_TEST_BUSY=1 KVCFS_STRESS_ROUNDS=100 python3 -m pytest -q -p no:cacheprovider \
        tests/test_fs_core.py tests/test_stream_stress.py tests/test_stream_interleave.py
fi
