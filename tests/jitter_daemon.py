"""Run the kv-chunk-fs CLI with every save's storing slowed and sped at random (tests only).

The daemon is the real one; only the step that stores a batch of a save's chunks
(``file/chunking.py``) first sleeps for a random time, so ingestion falls behind or keeps up with
the client by turns. ``KVCFS_TEST_JITTER_SEED`` makes a run repeatable as far as the OS scheduler
allows.
"""

from __future__ import annotations

import os
import random
import sys
import time

from kvchunkfs.cli import main as cli
from kvchunkfs.file import chunking

_rng = random.Random(int(os.environ.get("KVCFS_TEST_JITTER_SEED", "0")))
_DELAYS = (0.0, 0.0, 0.0, 0.0001, 0.001, 0.005, 0.02, 0.05)
_put = chunking._Run._put


def _jitter(self: chunking._Run, chunks: list[tuple[bytes, bytes | memoryview]]) -> None:
    delay = _rng.choice(_DELAYS)
    if delay:
        time.sleep(delay)
    _put(self, chunks)


chunking._Run._put = _jitter  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
