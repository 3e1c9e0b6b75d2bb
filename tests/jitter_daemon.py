"""Run the kv-chunk-fs CLI with every chunker worker slowed and sped at random (tests only).

The daemon is the real one; only ``FileContent._step`` (a no-op hook between the worker's steps)
sleeps for a random time, so the worker falls behind or keeps up with the client by turns.
``KVCFS_TEST_JITTER_SEED`` makes a run repeatable as far as the OS scheduler allows.
"""

from __future__ import annotations

import os
import random
import sys
import time

from kvchunkfs.cli import main as cli
from kvchunkfs.file.content import FileContent

_rng = random.Random(int(os.environ.get("KVCFS_TEST_JITTER_SEED", "0")))
_DELAYS = (0.0, 0.0, 0.0, 0.0001, 0.001, 0.005, 0.02, 0.05)


def _jitter(self: FileContent, point: str) -> None:
    delay = _rng.choice(_DELAYS)
    if delay:
        time.sleep(delay)


FileContent._step = _jitter  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
