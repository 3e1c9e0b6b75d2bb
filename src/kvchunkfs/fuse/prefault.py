"""Fault in the daemon's library code at start, so that its first restore after a boot does not
wait for code pages to be read from disk.

A fresh daemon has mapped its shared libraries (the interpreter, numpy, OpenSSL's SHA-256, SQLite)
but touched only the pages its start-up ran. The first restore then runs code nothing has
run yet, and with a cold page cache every such page is a disk read on the request's path: measured
here, a few milliseconds for each of the first numpy slicing, the first group decode and the first
header parse. ``MADV_POPULATE_READ`` maps every page of a library now; a page mapped by a process
is also what the kernel's cache dropping leaves in place. The cost is the libraries' size in
resident, clean, file-backed pages (about 30 MiB, shared with any other Python process using them).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from collections.abc import Iterable

log = logging.getLogger(__name__)

MADV_POPULATE_READ = 22  # Linux 5.14
# numpy's bundled BLAS and Fortran runtimes (about 30 MiB): only for linear algebra, never called.
SKIP = ("/numpy.libs/",)
_LIBRARY = re.compile(r"\.so(\.[0-9.]+)?$")


def library_ranges(maps: Iterable[str]) -> list[tuple[int, int]]:
    """The readable address ranges of the shared libraries in ``/proc/self/maps`` lines."""
    ranges = []
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[1].startswith("r"):
            continue
        path = fields[5].strip()
        if not _LIBRARY.search(path) or any(s in path for s in SKIP):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        ranges.append((lo, hi))
    return ranges


def prefault_libraries() -> int:
    """Map every page of the process's shared libraries; the bytes populated (0 where the kernel
    or the C library cannot: then the first restore pays as before)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/self/maps") as f:
            ranges = library_ranges(f)
    except OSError as e:
        log.info("library code not prefaulted: %s", e)
        return 0
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for lo, hi in ranges:
        if madvise(lo, hi - lo, MADV_POPULATE_READ) == 0:
            done += hi - lo
        elif ctypes.get_errno() == 22:  # EINVAL: a kernel before 5.14
            log.info("library code not prefaulted: %s", os.strerror(22))
            return done
    return done
