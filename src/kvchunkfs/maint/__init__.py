"""Layer 4, maintenance: garbage collection, crash recovery, fsck and export. Algorithms only:
they return reports and never print (the CLI does).

Imports ``format``, ``store`` and ``file``.
"""
