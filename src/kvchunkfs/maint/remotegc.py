"""``gc --remote``: delete the bucket's chunks that no index names and that are older than the grace.

Order (docs/design.md, "The remote tier"): read every index first, list the chunks after, and
delete a chunk only if it is unnamed and its modification time (server clock) is older than
``grace``. An upload puts (or touches) its chunks before its index, and treats a chunk older than
half the grace as absent, so the chunks of an upload in flight are young and stay. Each candidate is
looked at again just before the delete (a touch meanwhile makes it young).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from kvchunkfs.format import index as idx
from kvchunkfs.store.remote import decode_checked
from kvchunkfs.store.s3 import Bucket, TooLarge

log = logging.getLogger(__name__)


@dataclass
class RemoteGCReport:
    indexes: int = 0
    chunks: int = 0
    named: int = 0
    young: int = 0  # unnamed but within the grace: kept
    deleted: int = 0
    bytes_freed: int = 0
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return (
            f"remote: {self.indexes} indexes, {self.chunks} chunks; deleted {self.deleted} unnamed chunks "
            f"({self.bytes_freed} bytes), kept {self.young} unnamed ones younger than the grace"
            + (f"; {len(self.errors)} errors" if self.errors else "")
        )


def run_remote_gc(
    bucket: Bucket, grace: float, dry_run: bool = False, max_index: int | None = None, max_file_size: int | None = None
) -> RemoteGCReport:
    """``max_index``: index objects larger than this are not read (``remote.max_index_bytes``)."""
    report = RemoteGCReport()
    named: set[bytes] = set()
    for rel in bucket.list_indexes():
        try:
            data, _ = bucket.get_index(rel, max_index)
            named.update(decode_checked(data, max_file_size).ids)
            report.indexes += 1
        except FileNotFoundError:
            continue  # deleted meanwhile: its chunks are garbage or named elsewhere
        except (idx.IndexFormatError, TooLarge) as e:
            # An index we cannot read may name anything: collect nothing rather than something live.
            report.errors.append(f"index {rel}: {e}")
            log.error("remote gc: index %s is unreadable, nothing is deleted: %s", rel, e)
            return report
    chunks, now = bucket.list_chunks()
    report.chunks = len(chunks)
    doomed = []
    for cid, info in chunks.items():
        if cid in named:
            report.named += 1
        elif now - info.modified < grace:
            report.young += 1
        else:
            doomed.append((cid, info.size))
    for cid, size in doomed:
        head = bucket.head_chunk(cid)
        if head is None:
            continue
        modified, now = head
        if now - modified < grace:  # touched by an upload since the listing
            report.young += 1
            continue
        if not dry_run:
            bucket.delete_chunks([cid])
        report.deleted += 1
        report.bytes_freed += size
    log.info("%s", report.summary())
    return report
