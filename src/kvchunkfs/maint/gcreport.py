"""What one garbage collection did (or, for a dry run, would do), and its one-line summary."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class GCReport:
    mode: str = "walk"  # "walk": every stub read; "changes": only what changed since the last run
    chunks_freed: int = 0
    bytes_freed: int = 0  # chunk bytes whose map rows were deleted
    disk_bytes_freed: int = 0  # pack file bytes given back to the filesystem
    packs_deleted: int = 0
    packs_compacted: int = 0
    chunks_moved: int = 0
    bytes_moved: int = 0
    live_chunks: int = 0
    snapshots: int = 0
    unreadable_snapshots: int = 0
    missing_chunks: int = 0  # named by a stub but neither in the store nor in the shared tier (fsck tells which)
    skipped: list[str] = field(default_factory=list)  # entries under snapshots/ that are not snapshots
    unreadable: list[str] = field(default_factory=list)  # entries that could not be read: nothing was freed
    walks: int = 0
    catch_ups: int = 0  # rounds of reading stubs created by renames and saves during the walk
    interrupted: bool = False
    errors: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    dry_run: bool = False  # ``plan_gc``: the figures are what a run would free; nothing was deleted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return format_summary(self.to_dict())


def format_summary(r: dict[str, Any]) -> str:
    """One line for a report (also for the JSON a daemon sends back)."""
    where = f" in {r['snapshots']} snapshots" if r.get("mode", "walk") == "walk" else ""
    if r.get("dry_run"):
        return _dry_run_summary(r, where)
    text = (
        f"gc finished: freed {r['chunks_freed']} chunks ({r['bytes_freed']} bytes), "
        f"deleted {r['packs_deleted']} "
        f"packs, compacted {r['packs_compacted']} ({r['bytes_moved']} bytes moved), {r['disk_bytes_freed']} bytes "
        f"of disk reclaimed; {r['live_chunks']} live chunks{where}; {r['duration_s']:.2f}s"
    )
    text += "; every stub read" if r.get("mode", "walk") == "walk" else "; only the changes since the last run"
    if r.get("missing_chunks"):
        text += f"; {r['missing_chunks']} chunks missing (run fsck)"
    if r.get("skipped"):  # the first few by name; the report has them all
        more = f"; and {len(r['skipped']) - 5} more" if len(r["skipped"]) > 5 else ""
        text += f"; {len(r['skipped'])} entries skipped: " + "; ".join(r["skipped"][:5]) + more
    if r.get("interrupted"):
        text += "; interrupted"
    if r.get("errors"):
        text += f"; {len(r['errors'])} errors: " + "; ".join(r["errors"])
    return text


def _dry_run_summary(r: dict[str, Any], where: str) -> str:
    text = (
        f"gc dry run, nothing deleted: would free {r['chunks_freed']} chunks ({r['bytes_freed']} bytes), "
        f"delete {r['packs_deleted']} packs, compact {r['packs_compacted']} ({r['bytes_moved']} bytes to move), "
        f"reclaiming {r['disk_bytes_freed']} bytes of disk; {r['live_chunks']} live chunks{where}; "
        f"{r['duration_s']:.2f}s"
    )
    if r.get("missing_chunks"):
        text += f"; {r['missing_chunks']} chunks missing (run fsck)"
    if r.get("errors"):
        text += f"; {len(r['errors'])} errors: " + "; ".join(r["errors"])
    return text
