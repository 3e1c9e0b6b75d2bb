"""Fallback ``kvfs`` fixture for running tests/test_llama_shaped.py before tests/conftest.py has
one:  ``python -m pytest -p e2e.pytest_kvfs tests/test_llama_shaped.py``.

A conftest.py fixture of the same name takes precedence over this plugin's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .mount import Mount


class _Kvfs:
    def __init__(self, base: Path):
        self.store = base / "store"
        self.mnt = base / "mnt"
        self._m = Mount(self.store, self.mnt, base / "mount.log")
        self._m.start()

    def remount(self) -> None:
        self._m.remount()

    def close(self) -> None:
        self._m.stop()


@pytest.fixture
def kvfs(tmp_path):
    k = _Kvfs(tmp_path)
    try:
        yield k
    finally:
        k.close()
