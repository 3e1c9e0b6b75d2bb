"""``gc --remote``: delete the bucket's chunks that no index names and that are older than the grace.

Packed layout (restic's prune): a pack none of whose chunks an index names and older than the
grace is deleted, and so is a pack index all of whose packs are gone. A pack older than the grace
whose named chunks are less than ``REPACK_BELOW`` of its bytes is repacked: its named chunks are
copied (checked against their ids) into new packs, described by a new pack index, and only then
is the old pack deleted (if a HEAD still finds it older than the grace).

Order (docs/design.md, "The remote tier"): read every index first, list the chunks after, and
delete a chunk only if it is unnamed and its modification time (server clock) is older than
``grace``. An upload puts (or touches) its chunks before its index, and treats a chunk older than
half the grace as absent, so the chunks of an upload in flight are young and stay. Each candidate is
looked at again just before the delete (a touch meanwhile makes it young).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from kvchunkfs.format import index as idx
from kvchunkfs.store import remotepacks as rp
from kvchunkfs.store.remotecore import decode_checked
from kvchunkfs.store.s3 import Bucket, NotItsName, TooLarge

log = logging.getLogger(__name__)
REPACK_BELOW = 0.5  # a pack older than the grace whose named chunks are less than this share of it is repacked


@dataclass
class RemoteGCReport:
    indexes: int = 0
    chunks: int = 0
    named: int = 0
    young: int = 0  # unnamed but within the grace: kept
    deleted: int = 0
    bytes_freed: int = 0
    packs: int = 0
    packs_used: int = 0
    packs_sparse: int = 0  # older than the grace and named chunks below REPACK_BELOW of its bytes
    packs_repacked: int = 0
    converted: int = 0  # named chunks held only loose, put into packs (--convert)
    repack_bytes: int = 0  # named chunk bytes copied into new packs
    packs_young: int = 0  # nothing named, but within the grace: kept
    packs_deleted: int = 0
    pack_bytes_freed: int = 0
    packidx_deleted: int = 0
    dry_run: bool = False
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return (
            f"remote: {self.indexes} indexes, {self.chunks} chunks; deleted {self.deleted} unnamed chunks "
            f"({self.bytes_freed} bytes), kept {self.young} unnamed ones younger than the grace; "
            f"{self.packs} packs ({self.packs_used} in use, {self.packs_sparse} below half used, "
            f"{self.packs_repacked} repacked: {self.repack_bytes} bytes copied): deleted "
            f"{self.packs_deleted} ({self.pack_bytes_freed} bytes) and {self.packidx_deleted} pack indexes, kept "
            f"{self.packs_young} unnamed younger than the grace; {self.converted} loose chunks put into packs"
            + (" (dry run: nothing deleted)" if self.dry_run else "")
            + (f"; {len(self.errors)} errors" if self.errors else "")
        )


def run_remote_gc(
    bucket: Bucket,
    grace: float,
    dry_run: bool = False,
    max_index: int | None = None,
    max_file_size: int | None = None,
    pack_size: int = 16 << 20,
    convert: bool = False,
) -> RemoteGCReport:
    """``max_index``: index objects larger than this are not read (``remote.max_index_bytes``).
    ``convert`` (a packed bucket that was loose): first put every named chunk held only as a
    loose object into packs; loose objects whose chunk a pack holds are then collected (after the
    grace) like unnamed ones. Only once every host reads packs: an older version reads loose only."""
    report = RemoteGCReport(dry_run=dry_run)
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
    if convert:
        _convert(bucket, named, dry_run, report, pack_size)
    packed = _collect_packs(bucket, named, grace, dry_run, report, pack_size)
    chunks, now = bucket.list_chunks()
    report.chunks = len(chunks)
    doomed = []
    for cid, info in chunks.items():
        if cid in named and not (convert and packed is not None and cid in packed):
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


def _read_packidx(bucket: Bucket, report: RemoteGCReport) -> dict[str, list[rp.PackDesc]] | None:
    """Every pack index by name; None (and an error) if one is unreadable: it may describe anything."""
    out = {}
    for name in bucket.list_packidx():
        try:
            out[name] = rp.decode(bucket.get_packidx(name, rp.MAX_PIDX_BYTES))
        except FileNotFoundError:
            continue
        except (rp.PackIndexError, TooLarge, NotItsName) as e:
            report.errors.append(f"pack index {name}: {e}")
            log.error("remote gc: pack index %s is unreadable, no pack is deleted: %s", name, e)
            return None
    return out


def _collect_packs(
    bucket: Bucket, named: set[bytes], grace: float, dry_run: bool, report: RemoteGCReport, pack_size: int
) -> set[bytes] | None:
    """Indexes were read first (``named``), pack indexes now, the packs' listing last: a pack an
    upload in flight put is young, one it reuses it touched if it was older than half the grace.
    The chunks that packs left in place hold (None: a pack index was unreadable)."""
    pidx = _read_packidx(bucket, report)
    if pidx is None:
        return None
    descs = {d.pack: d for packs in pidx.values() for d in packs}
    packs, now = bucket.list_packs()
    report.packs = len(packs)
    doomed, sparse = [], []
    for pack, info in packs.items():
        d = descs.get(pack)
        used = sum(n for cid, n in d.chunks if cid in named) if d is not None else 0
        old = now - info.modified >= grace
        if used:
            report.packs_used += 1
            if d is not None and old and used < d.size * REPACK_BELOW:
                report.packs_sparse += 1
                sparse.append(d)
        elif not old:
            report.packs_young += 1
        else:
            doomed.append((pack, info.size))
    gone = set(descs) - set(packs)
    if sparse:
        doomed += _repack(bucket, sparse, named, dry_run, report, pack_size, packs)
    for pack, size in doomed:
        head = bucket.head_pack(pack)  # (repacked ones too: reused by an upload since, it stays as well)
        if head is not None and head[1] - head[0] < grace:  # touched by an upload since the listing
            report.packs_young += 1
            continue
        if not dry_run and head is not None:
            bucket.delete_keys([bucket.pack_key(pack)])
        gone.add(pack)
        report.packs_deleted += 1
        report.pack_bytes_freed += size
    stale = [name for name, ps in pidx.items() if all(d.pack in gone for d in ps)]
    if stale and not dry_run:
        bucket.delete_keys([bucket.packidx_key(n) for n in stale])
    report.packidx_deleted = len(stale)
    return {cid for d in descs.values() if d.pack in packs and d.pack not in gone for cid, _ in d.chunks}


def _convert(bucket: Bucket, named: set[bytes], dry_run: bool, report: RemoteGCReport, pack_size: int) -> None:
    """Named chunks that only a loose object holds go into new packs (each checked against its id)."""
    pidx = _read_packidx(bucket, report)
    if pidx is None:
        return
    packs, _ = bucket.list_packs()
    in_packs = {cid for ps in pidx.values() for d in ps if d.pack in packs for cid, _ in d.chunks}
    loose, _ = bucket.list_chunks()
    todo = sorted(c for c in named if c in loose and c not in in_packs)
    report.converted = len(todo)
    if dry_run or not todo:
        return
    packer = rp.Packer(pack_size)
    new: list[rp.PackDesc] = []
    for cid in todo:
        data = bucket.get_chunk(cid)
        if hashlib.sha256(data).digest() != cid:
            report.errors.append(f"loose chunk {cid.hex()} fails its id: not converted")
            continue
        if (full := packer.add(cid, data)) is not None:
            bucket.put_pack(full[0].pack, full[1])
            new.append(full[0])
    if (full := packer.flush()) is not None:
        bucket.put_pack(full[0].pack, full[1])
        new.append(full[0])
    for group in rp.groups(new):
        bucket.put_packidx(rp.encode(group))


def _repack(
    bucket: Bucket, sparse: list[rp.PackDesc], named: set[bytes], dry_run: bool, report: RemoteGCReport,
    pack_size: int, listed: dict[bytes, Any],
) -> list[tuple[bytes, int]]:  # fmt: skip
    """Copy the named chunks of ``sparse`` packs into new packs and a new pack index; the old
    packs, to be deleted by the caller's age check. A pack whose chunk fails its id is left alone."""
    packer = rp.Packer(pack_size)
    new: list[rp.PackDesc] = []
    done = []

    def send(full: tuple[rp.PackDesc, bytes] | None) -> None:
        if full is not None:
            bucket.put_pack(full[0].pack, full[1])
            new.append(full[0])

    for d in sparse:
        live = [(cid, loc) for cid, loc in d.locs() if cid in named]
        report.repack_bytes += sum(loc.length for _, loc in live)
        if dry_run:
            report.packs_repacked += 1
            continue
        chunks = []
        try:
            for run in rp.coalesce(live):
                blob = bucket.get_ranges(d.pack, [(run.start, run.end)])[0]
                chunks += [(cid, blob[off : off + n]) for cid, off, n in run.parts]
        except FileNotFoundError:
            continue  # deleted meanwhile
        if any(hashlib.sha256(data).digest() != cid for cid, data in chunks):
            report.errors.append(f"pack {d.pack.hex()}: a chunk fails its id; not repacked")
            log.error("remote gc: pack %s holds a chunk that fails its id; not repacked", d.pack.hex())
            continue
        for cid, data in chunks:
            send(packer.add(cid, data))
        report.packs_repacked += 1
        done.append((d.pack, listed[d.pack].size))
    send(packer.flush())
    for group in rp.groups(new):  # the copies are described before any old pack goes
        bucket.put_packidx(rp.encode(group))
    return done
