"""Layer 3, open files: ``FileContent`` (streaming, staging, commit; its queues in ``queues``, the
reads of relayout groups in ``groups``), the read-ahead ``Fetcher`` and its chunk cache, and
``Files``, which turns a file's content into a durable save through the store. ``FileHandle``
(``handle``) is an open handle's async reads and writes, the one module here that imports trio.

Imports ``format`` and ``store``; knows nothing of FUSE, inodes or request handling.
"""
