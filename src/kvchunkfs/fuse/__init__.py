"""Layer 5, FUSE: ``Operations`` (inodes, handles, errno mapping) and the daemon's event loop.

POSIX and pyfuse3 semantics live here and nowhere else. Imports the layers below.
"""
