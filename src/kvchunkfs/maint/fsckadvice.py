"""What fsck's findings mean and what to do about each: the lines ``kv-chunk-fs fsck`` prints
after its problems, one per kind of problem found."""

from __future__ import annotations

from kvchunkfs.maint.fsck import DISAGREES, REMAPPABLE, FsckReport

BROKEN = (
    "{n} broken snapshots: their content cannot be read in full (opening one fails with EIO; "
    "llama-server's restore of it fails). Per snapshot, either: fetch it from the bucket (with remote set, "
    "chunks the bucket holds are fetched when the snapshot is opened: `kv-chunk-fs ls` shows WHERE); "
    "delete it (rm MOUNTPOINT/NAME, or DELETE /snapshots/NAME): llama-server saves it again next time; or keep "
    "it for inspection (`fsck --repair` marks it broken so `ls`, `stats`, the API and the dashboard show it; "
    "what is intact stays readable through `kv-chunk-fs export-store`, and a save of the same bytes makes it "
    "whole again, after which `fsck --repair` removes the mark)"
)
CORRUPT = (
    "{n} chunks fail their checksum: bytes changed on disk (a disk, memory or file system fault). "
    "`fsck --repair` (store unmounted) drops them from the map; the snapshots naming them are then broken "
    "(above) until a save of the same bytes or the bucket brings them back"
)
STRUCTURE = (
    "{n} problems between the chunk map and the packs (a crash, a full disk, or a tool that changed the "
    "store): `fsck --repair` (store unmounted) catches the map up with the packs' records and cuts what no "
    "record describes; nothing a snapshot needs and a pack holds intact is deleted"
)
STALE = (
    "{n} snapshots name chunks the map lacks but a pack describes (a stale map, not lost data): the next "
    "mount or `fsck --repair` re-maps them"
)
LEFTOVERS = "leftover temp or staging files from a crash: the next mount or `fsck --repair` removes them"
CATALOG = "the running daemon's catalog differs from the stubs: restart the mount (its catalog is read again)"
MAP = "the chunk map cannot be read: `fsck --repair` moves it aside and rebuilds it from the packs' records"


def advice(report: FsckReport) -> list[str]:
    """One line per kind of problem in ``report``: what it means and what to do."""
    out = []
    broken = len(report.broken)
    if broken:
        marked = sum(1 for rel in report.broken if rel in report.marked)
        out.append(BROKEN.format(n=broken) + (f"; {marked} of them already marked broken" if marked else ""))
    corrupt = sum(1 for p in report.problems if p.endswith("fails its checksum"))
    if corrupt:
        out.append(CORRUPT.format(n=corrupt))
    structure = sum(1 for p in report.problems if p.startswith("pack ") and not p.endswith("fails its checksum"))
    structure += sum(1 for p in report.problems if DISAGREES in p and not p.startswith("pack "))
    if structure:
        out.append(STRUCTURE.format(n=structure))
    stale = sum(1 for p in report.problems if p.startswith("snapshot ") and f": {REMAPPABLE}" in p)
    if stale:
        out.append(STALE.format(n=stale))
    if any("leftover files" in p for p in report.problems):
        out.append(LEFTOVERS)
    if any("daemon's catalog row" in p for p in report.problems):
        out.append(CATALOG)
    if any("chunks.db" in p and not p.startswith(("pack ", "snapshot ")) for p in report.problems):
        out.append(MAP)
    return out
