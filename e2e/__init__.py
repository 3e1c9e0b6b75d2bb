"""End-to-end harness: real llama-server saving slot snapshots into a kv-chunk-fs mount.

See e2e/README.md. ``e2e.ggsq`` (synthetic state files) is also used by the default test suite.
"""

import sys
from pathlib import Path

# This checkout's kvchunkfs, not an installed one from another checkout (the mount child gets the
# same through PYTHONPATH, see mount.py).
_SRC = str(Path(__file__).resolve().parent.parent / "src")
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)
