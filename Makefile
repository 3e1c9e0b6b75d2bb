# Developer targets; CI runs scripts/test.sh, which is `make full` on a fresh machine (setup included).
# The interpreter: the checkout's .venv (scripts/setup-dev.sh) when there is one, else python3 on PATH;
# `make PYTHON=...` names another. (The environment's PYTHON, which picks setup's interpreter, is not used.)
PYTHON = $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
PYTEST = $(PYTHON) -m pytest -q -p no:cacheprovider

.PHONY: setup lock lint format unit slow fuse served busy full

setup:  # the test-only system packages and .venv (scripts/setup.sh installs for running)
	bash scripts/setup-dev.sh

# requirements.lock: every runtime, test and dev dependency pinned, resolved from pyproject.toml.
# setup-dev installs every pin; setup installs the runtime ones only (pip's constraint mode, -c). Run
# after changing the dependencies there; existing pins are kept where they still fit:
# `make lock LOCK_FLAGS=--upgrade` moves every pin to the newest release.
lock:
	$(PYTHON) -m piptools compile -q --extra test --extra dev --strip-extras --no-emit-index-url \
		--no-emit-find-links $(LOCK_FLAGS) -o requirements.lock pyproject.toml

lint:
	$(PYTHON) -m ruff check src tests benchmarks e2e
	$(PYTHON) -m ruff format --check src tests benchmarks e2e
	$(PYTHON) -m mypy

format:
	$(PYTHON) -m ruff format src tests benchmarks e2e
	$(PYTHON) -m ruff check --fix src tests benchmarks e2e

unit:  # no root, no FUSE: about a minute
	$(PYTEST) -m "unit and not slow"

slow:  # no root, no FUSE: the exhaustive interleavings of the streaming writer, minutes
	$(PYTEST) -m "unit and slow"

fuse:  # real mounts: root and /dev/fuse
	$(PYTEST) -m "not unit"

# The core, crash, flush, stop and staged-save tests again with passthrough off: every byte through
# the daemon, as on kernels before 6.9 or a daemon without CAP_SYS_ADMIN.
SERVED_TESTS = tests/test_fs_core.py tests/test_recovery.py tests/test_flush_copies.py tests/test_staged.py \
	tests/test_stop.py tests/test_stream_stress.py tests/test_linger.py tests/test_powerloss.py \
	tests/test_staged_reboot.py tests/test_late_writes.py tests/test_room.py tests/test_open_races.py \
	tests/test_golden_saves.py
served:
	KV_CHUNK_FS_FUSE_PASSTHROUGH=false $(PYTEST) $(SERVED_TESTS)

busy:  # the core streaming tests again beside a CPU hog, the chunker worker slowed and sped at random
	KVCFS_TEST_BUSY=1 KVCFS_STRESS_ROUNDS=100 $(PYTEST) \
		tests/test_fs_core.py tests/test_stream_stress.py tests/test_stream_interleave.py

full: setup lint unit slow fuse served busy
