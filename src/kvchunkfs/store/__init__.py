"""Layer 2, the store: the on-disk layout, chunk packs and their map, stubs, and ``Repository``,
the only place a save is made durable (temp stub, rename). Knows nothing of open files or FUSE.

Imports only ``format`` (and the leaf modules ``units``).
"""
