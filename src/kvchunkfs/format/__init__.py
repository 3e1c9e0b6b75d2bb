"""Layer 1, formats: pure encodings with no I/O of their own (the casync index, FastCDC chunking).

Imports nothing from other layers.
"""
