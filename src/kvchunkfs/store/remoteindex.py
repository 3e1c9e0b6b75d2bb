"""A snapshot's index object in the bucket: its file record, and how it becomes a local stub.

**The record travels with the index.** An index object carries the snapshot's file record
(format/filerecord.py) in its user metadata ``kvcfs-file``, put in the same request as the index
bytes, so the two are replaced together (an S3 PUT is atomic for readers). The value is
``1.<hex of the first 16 bytes of the index's SHA-256>.<the record, base64url, unpadded>``: a host
uses a record only if its version is ``1``, it names the index it arrived with, and it decodes for
a file of that index's size; otherwise (damaged, copied from another version, written by a newer
version) the snapshot is fetched without it, as one from before records travelled, and a line is
logged. S3 allows 2 KiB of user metadata an object: a record longer than ``MAX_META_RECORD``
(a ``LISTED`` one of many groups) travels as ``PARSED``, its file checksum only (the save checked
that the stored stream parses to exactly the groups listed, so parsing puts the same groups back).
An index object from before (no ``kvcfs-file``) reads as it always did; older versions ignore the
metadata.

**Fetched a piece at a time.** The index object streams into the new stub under ``tmp/`` (1 MiB
reads, hashed as they arrive) and is checked there a piece at a time (``index.read_table``): an
index of a million chunks (40 MB) never sits in the daemon's memory, neither as bytes nor parsed.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kvchunkfs.format import filerecord
from kvchunkfs.format import index as idx
from kvchunkfs.store import stubs
from kvchunkfs.store.s3 import Bucket, IndexObject

log = logging.getLogger(__name__)

RECORD_VERSION = "1"
BINDING_BYTES = 16  # of the index's SHA-256, in the record's metadata
# Raw record bytes carried as they are: base64 of them, the binding and the stream tag stay within
# S3's 2 KiB of user metadata an object.
MAX_META_RECORD = 1344


def record_meta(index_data: bytes, record: bytes | None, size: int) -> str:
    """The ``kvcfs-file`` metadata of an index object (``""``: none, a snapshot without a record)."""
    if record is None:
        return ""
    if len(record) > MAX_META_RECORD:
        try:
            rec = filerecord.decode(record, size)
        except filerecord.RecordError:
            return ""  # the local stub's record is not one: nothing to carry
        record = filerecord.FileRecord(filerecord.Form.PARSED, rec.file_sum).encode()
    binding = hashlib.sha256(index_data).digest()[:BINDING_BYTES].hex()
    return f"{RECORD_VERSION}.{binding}.{base64.urlsafe_b64encode(record).rstrip(b'=').decode()}"


def record_of(meta: str | None, index_sha: bytes, size: int) -> tuple[bytes | None, str | None]:
    """(the record an index object carries, why it is not used): (None, None) for one without."""
    if meta is None:
        return None, None
    version, _, rest = meta.partition(".")
    binding, _, coded = rest.partition(".")
    if version != RECORD_VERSION:
        return None, f"a record of version {version[:16]!r}, which this version does not read"
    if binding != index_sha[:BINDING_BYTES].hex():
        return None, "the record names another index"
    try:
        record = base64.urlsafe_b64decode(coded + "=" * (-len(coded) % 4))
        filerecord.decode(record, size)
    except (binascii.Error, ValueError) as e:  # RecordError is a ValueError
        return None, f"the record is not one: {e}"
    return record, None


@dataclass
class FetchedStub:
    """An index object written as a complete stub under ``tmp/`` (the caller installs or removes it)."""

    tmp: Path
    obj: IndexObject  # its ETag and metadata (``data`` empty)
    sha: bytes  # SHA-256 of the index bytes
    size: int  # the file's
    record: bytes | None


def fetch_stub(
    bucket: Bucket, rel: str, tmp_dir: Path, limit: int | None, max_file_size: int | None, like: Path | None
) -> FetchedStub:
    """The bucket's index of ``rel`` as a new stub under ``tmp_dir``, with the record it carries
    if that one is usable (see above), mode, owner and user xattrs from ``like`` as ``stubs.prepare``
    gives them. FileNotFoundError if there is none; TooLarge over ``limit`` bytes; IndexFormatError
    if it is not an index (or one of a file over ``max_file_size``). Blocking: network."""
    tmp, fd = stubs.new_tmp(tmp_dir)
    try:
        h = hashlib.sha256()

        def sink(piece: bytes) -> None:
            h.update(piece)
            view = memoryview(piece)
            while view:
                view = view[os.write(fd, view) :]

        obj = bucket.fetch_index(rel, sink, limit)
        size = 0
        for ends, _ in idx.read_table(lambda offset, n: os.pread(fd, n, offset), os.fstat(fd).st_size):
            if len(ends):
                size = int(ends[-1])
        if max_file_size is not None and size > max_file_size:
            raise idx.IndexFormatError(f"a file of {size} bytes, more than max_file_size ({max_file_size})")
        sha = h.digest()
        record, why = record_of(obj.record, sha, size)
        if why is not None:
            log.warning("remote: %s in %s: its file record is not used (%s): fetched without it, its bytes "
                        "not checked end to end", rel, bucket.url, why)  # fmt: skip
        stubs.finish(fd, size, like, record)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return FetchedStub(tmp, obj, sha, size, record)
