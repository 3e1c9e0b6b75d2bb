"""What the daemon did since it started, kept in memory for the dashboard's charts (``GET /history``).

Bounded ring buffers of saves, restores and GC runs. Appending is what the FUSE thread pays (through
``Metrics.on_save``/``on_restore``): a tuple into a deque under a lock that is only ever held for an
append or a copy, never across I/O. The store size per event comes from the store's kept count
(``cached_stats``), which needs no lock either.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_CAPACITY = 5000  # events per kind: ~40 bytes each
SAVE_FIELDS = ("time", "seconds", "size", "new_bytes", "store_bytes", "close_seconds")  # seconds: until stored
RESTORE_FIELDS = ("time", "seconds", "size")
GC_FIELDS = ("time", "seconds", "bytes_freed", "store_bytes")
StoreBytes = Callable[[], tuple[int, int] | None]


class History:
    def __init__(self, store_stats: StoreBytes | None = None, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self.started = time.time()
        self._store_stats = store_stats
        self._lock = threading.Lock()
        self._saves: deque[tuple[float, ...]] = deque(maxlen=capacity)
        self._restores: deque[tuple[float, ...]] = deque(maxlen=capacity)
        self._gcs: deque[tuple[float, ...]] = deque(maxlen=capacity)

    def _store_bytes(self) -> float:
        stats = self._store_stats() if self._store_stats is not None else None
        return float(stats[1]) if stats is not None else float("nan")

    def on_save(self, seconds: float, size: int, new_bytes: int, closed: float | None = None) -> None:
        """A save stored ``seconds`` after its close began; its close took ``closed``."""
        row = (time.time(), seconds, float(size), float(max(0, new_bytes)), self._store_bytes(),
               seconds if closed is None else closed)  # fmt: skip
        with self._lock:
            self._saves.append(row)

    def on_restore(self, seconds: float, size: int) -> None:
        row = (time.time(), seconds, float(size))
        with self._lock:
            self._restores.append(row)

    def on_gc(self, seconds: float, bytes_freed: int) -> None:
        row = (time.time(), seconds, float(bytes_freed), self._store_bytes())
        with self._lock:
            self._gcs.append(row)

    def to_dict(self, since: float = 0.0) -> dict[str, Any]:
        """Columns (one list per field, as charting libraries take them) of the events after ``since``,
        plus latency percentiles over everything kept."""
        with self._lock:
            saves, restores, gcs = list(self._saves), list(self._restores), list(self._gcs)
        return {
            "started": self.started,
            "capacity": self.capacity,
            "saves": _columns(SAVE_FIELDS, [r for r in saves if r[0] > since]),
            "restores": _columns(RESTORE_FIELDS, [r for r in restores if r[0] > since]),
            "gc": _columns(GC_FIELDS, [r for r in gcs if r[0] > since]),
            "latency": {
                "save": percentiles([r[1] for r in saves]),
                "close": percentiles([r[5] for r in saves]),
                "restore": percentiles([r[1] for r in restores]),
            },
        }


def _columns(fields: Sequence[str], rows: list[tuple[float, ...]]) -> dict[str, list[float | None]]:
    if not rows:
        return {name: [] for name in fields}
    # NaN is not JSON: an unknown store size is null.
    columns = zip(*rows, strict=True)
    return {name: [None if v != v else v for v in col] for name, col in zip(fields, columns, strict=True)}


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """count, p50, p90, p99 (nearest rank) of ``values``; None for an empty list."""
    if not values:
        return {"count": 0, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)
    n = len(ordered)

    def rank(p: float) -> float:
        return ordered[min(n - 1, max(0, int(p * n + 0.999999) - 1))]

    return {"count": n, "p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99)}
