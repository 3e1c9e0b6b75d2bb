"""Layer 1, formats: pure encodings with no I/O of their own (the casync index, FastCDC chunking,
the llama.cpp state-file parser and the cutter that turns it into chunk boundaries).

Imports nothing from other layers.
"""
