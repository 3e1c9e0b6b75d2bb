"""A stored save's staged file becomes a hot copy whose bytes are those of its checksum.

A hot copy is shared: every snapshot with the same content (other names, other users' files) is
served from it, so its bytes must be those of its name (the file record's checksum) for as long as
it exists, and no client may be able to change them. Ingestion stores a staged file only after the
last release of the file description that wrote it (a child's inherited descriptor keeps it open),
and checks, just before the stub is installed, that the file still hashes to the checksum stored.

Served, only the daemon ever wrote the staged file, and sealed it is never written again (a later
write copies it first): it is renamed into the hot tier. Passed through, the kernel wrote it
directly, and a ``MAP_SHARED`` mapping kept after ``close()`` goes on writing it: the kernel's
RELEASE comes at the close all the same (the mapping holds the backing file, not the FUSE file), so
nothing tells the daemon when the last writer is gone. There the hot copy is a fresh file no client
ever held: the staged file copied into a new part file, the part hashed, and renamed into the hot
tier only if it has the checksum; the staged file itself is deleted.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvchunkfs.file.copyrange import copy_range
from kvchunkfs.format.filerecord import file_hasher
from kvchunkfs.store.wholefiles import WholeFiles

PIECE = 8 << 20  # bytes hashed at a time


def same_sum(fd: int, file_sum: bytes) -> bool:
    """Whether the file ``fd`` now hashes to ``file_sum`` (a file record's checksum)."""
    hasher = file_hasher()
    pos = 0
    while piece := os.pread(fd, PIECE, pos):
        hasher.update(piece)
        pos += len(piece)
    return hasher.digest() == file_sum


def to_hot_tier(
    whole: WholeFiles, path: Path, fd: int, file_sum: bytes, size: int, fresh: bool, rel: str | None = None
) -> bool:
    """Make the stored staged file ``path`` (open as ``fd``; the snapshot ``rel``) the hot copy of
    ``file_sum``: renamed, or with ``fresh`` (a client may still write it) a copy of it. The staged file is gone after;
    False if no hot copy was made (its bytes changed, no room). Blocking."""
    if size > whole.budget or whole.short:  # memory short: no copy (a fresh one would double the file)
        whole.drop_staged(path)
        return False
    key = whole.key(file_sum, size)
    if not fresh:  # no one wrote it since ingestion hashed it again
        whole.hot_commit(path, key, size, put_back=False, rel=rel)
        return True
    whole.drop_staged(path)  # its fd is enough to copy it
    try:
        whole.reserve(size)  # hot copies evicted first; no room: no copy, and a client's write keeps its room
    except OSError:
        return False
    part, out = whole.new_part()
    try:
        pos = 0
        while pos < size and (n := copy_range(fd, out, size - pos, pos)):
            pos += n
        kept = pos == size and same_sum(out, file_sum)
    except OSError:  # no room for the copy: no hot copy, the snapshot is stored
        kept = False
    finally:
        os.close(out)
    if not kept:
        whole.drop_staged(part)
        return False
    whole.hot_commit(part, key, size, put_back=False, rel=rel)
    return True
