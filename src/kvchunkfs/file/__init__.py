"""Layer 3, open files: ``FileContent`` (streaming, staging, commit; its queues in ``queues``, where
its relayout groups are in ``groups``), ``Restore`` (``restore``: a stored snapshot put back into
the whole file every open reads), and ``Files``, which loads a file's content and turns it into a
durable save through the store. ``FileHandle`` (``handle``) is an open handle's async reads and
writes, the one module here that imports trio.

Imports ``format`` and ``store``; knows nothing of FUSE, inodes or request handling.
"""
