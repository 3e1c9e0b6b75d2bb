"""Bytes copied from one file to another inside the kernel where it can (``copy_file_range``: no
bytes through Python, a reflink where the file system has them), else through a bounded buffer:
between file systems (a snapshot put back on the store's disk copied into the memory tier) the
kernel refuses with ``EXDEV``."""

from __future__ import annotations

import errno
import os

PIECE = 4 << 20  # the fallback's buffer
_FALLBACK = {errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def copy_range(src: int, dst: int, n: int, pos: int) -> int:
    """Copy up to ``n`` bytes at ``pos`` of ``src`` to the same offset of ``dst``; the bytes
    copied (0: ``src`` ends at ``pos``)."""
    try:
        return os.copy_file_range(src, dst, n, pos, pos)
    except OSError as e:
        if e.errno not in _FALLBACK:
            raise
    data = os.pread(src, min(n, PIECE), pos)
    done = 0
    while done < len(data):
        done += os.pwrite(dst, memoryview(data)[done:], pos + done)
    return len(data)
