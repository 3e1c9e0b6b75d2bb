"""One vocabulary for the daemon's figures: ``kv-chunk-fs stats``, ``GET /stats``, ``GET /metrics``
and the dashboard call each figure by the same name (the metric's, without ``kvcfs_``) and mean the
same by it; docs/api.md ("Figures") defines each once.

The filesystem keeps its counters under its own short names (``fuse.operations.Operations.stats``,
also the mount's ``user.kvcfs.stats`` xattr); :func:`public` gives them their published names.
"""

from __future__ import annotations

from collections.abc import Mapping

# The filesystem's counter name -> the published one, where they differ.
PUBLIC = {
    "bytes_written": "new_bytes",  # chunk bytes the store lacked and appended to a pack
    "bytes_deduped": "deduped_bytes",  # chunk bytes saves passed that the store already had
    "bytes_predicted": "predicted_bytes",
    "pack_bytes_read": "pack_read_bytes",
}


def public(counters: Mapping[str, int]) -> dict[str, int]:
    """The filesystem's counters under their published names."""
    return {PUBLIC.get(name, name): value for name, value in counters.items()}


def dedup_ratio(logical_bytes: int, stored_bytes: int) -> float:
    """The dedup ratio: the snapshots' logical bytes per chunk byte stored (1.0 for an empty store)."""
    return round(logical_bytes / stored_bytes, 4) if stored_bytes else 1.0
