"""Layer 5, FUSE: ``Operations`` (inodes, handles, errno mapping) and the daemon's event loop.

The kernel's FUSE protocol and POSIX semantics live here and nowhere else. Imports the layers below.
"""
