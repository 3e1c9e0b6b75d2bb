"""Recent log lines kept in memory for ``GET /logs``.

A ring buffer, so a long-running daemon never grows; the journal or the log file keep the history.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import asdict, dataclass

DEFAULT_CAPACITY = 2000
LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class LogLine:
    time: float
    level: str
    logger: str
    message: str

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        # A file name that is not UTF-8 reaches messages as lone surrogates, which JSON cannot encode:
        # show its bytes as \xNN.
        try:
            raw = self.message.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raw = self.message.encode("utf-8", "backslashreplace")
        out["message"] = raw.decode("utf-8", "backslashreplace")
        return out


def parse_level(name: str) -> int:
    """``"warning"`` -> ``logging.WARNING``; ValueError for anything else."""
    key = name.strip().lower()
    if key not in LEVELS:
        raise ValueError(f"unknown log level {name!r} (use one of {', '.join(LEVELS)})")
    return logging.getLevelName(key.upper())


class LogBuffer(logging.Handler):
    """A logging handler that keeps the last ``capacity`` records."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        super().__init__()
        self._lines: deque[tuple[int, LogLine]] = deque(maxlen=capacity)
        self._lines_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                message += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
            line = LogLine(record.created, record.levelname.lower(), record.name, message)
        except Exception:  # a bad format string must not break the caller's logging
            self.handleError(record)
            return
        with self._lines_lock:
            self._lines.append((record.levelno, line))

    def lines(self, min_level: int = logging.NOTSET, limit: int | None = None) -> list[LogLine]:
        """The newest ``limit`` lines at ``min_level`` or above, oldest first."""
        with self._lines_lock:
            picked = [line for levelno, line in self._lines if levelno >= min_level]
        if limit is not None:
            picked = picked[-limit:] if limit > 0 else []
        return picked


def install(logger: logging.Logger | None = None, capacity: int = DEFAULT_CAPACITY) -> LogBuffer:
    """Attach a new buffer to ``logger`` (default: the root logger, so uvicorn's errors show too)."""
    buffer = LogBuffer(capacity)
    (logger or logging.getLogger()).addHandler(buffer)
    return buffer
