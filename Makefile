# Developer targets; CI runs scripts/test.sh, which is `make full` on a fresh machine (setup included).
PYTEST = python3 -m pytest -q -p no:cacheprovider

.PHONY: setup lint format unit slow fuse busy full

setup:
	bash scripts/setup.sh

lint:
	ruff check src tests benchmarks e2e
	ruff format --check src tests benchmarks e2e
	python3 -m mypy

format:
	ruff format src tests benchmarks e2e
	ruff check --fix src tests benchmarks e2e

unit:  # no root, no FUSE: about a minute
	$(PYTEST) -m "unit and not slow"

slow:  # no root, no FUSE: the exhaustive interleavings of the streaming writer, minutes
	$(PYTEST) -m "unit and slow"

fuse:  # real mounts: root and /dev/fuse
	$(PYTEST) -m "not unit"

busy:  # the core streaming tests again beside a CPU hog, the chunker worker slowed and sped at random
	KVCFS_TEST_BUSY=1 KVCFS_STRESS_ROUNDS=100 $(PYTEST) \
		tests/test_fs_core.py tests/test_stream_stress.py tests/test_stream_interleave.py

full: setup lint unit slow fuse busy
