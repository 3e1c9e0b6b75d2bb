"""Layer 5, operations service: the HTTP API, its client, the snapshot catalog, metrics, the log
buffer and the token-prefix tree. Beside ``fuse``, never importing it: deletes go through the mount.
"""
