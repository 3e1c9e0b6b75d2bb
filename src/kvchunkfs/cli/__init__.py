"""Layer 6, the command line: the only code that prints, and the one place that decides whether a
command talks to the running daemon or works on the store directly. Entry point: ``main.main``."""
