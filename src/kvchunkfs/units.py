"""Sizes and durations: parsing ``64KiB`` / ``1h30m`` and printing them back (a leaf module)."""

from __future__ import annotations

import re
from fractions import Fraction

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kib": KiB, "kb": 1000,
    "m": MiB, "mib": MiB, "mb": 1000**2,
    "g": GiB, "gib": GiB, "gb": 1000**3,
    "t": TiB, "tib": TiB, "tb": 1000**4,
}  # fmt: skip
_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", re.IGNORECASE)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION_RE = re.compile(r"(?:\d+[smhdw])+")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # bool is an int subclass


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``64KiB``, ``1.5GiB`` or ``500MB``."""
    if is_int(value):
        return value  # type: ignore[return-value]
    if not isinstance(value, str):
        raise ValueError("not a size")
    m = _SIZE_RE.fullmatch(value.strip())
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError("not a size")
    return int(Fraction(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_duration(value: object) -> int:
    """Seconds from an int or a string such as ``3600``, ``1h``, ``30m``, ``1h30m``."""
    if is_int(value):
        return value  # type: ignore[return-value]
    if not isinstance(value, str):
        raise ValueError("not a duration")
    text = value.strip().lower()
    if text.isdigit():
        return int(text)
    if not _DURATION_RE.fullmatch(text):
        raise ValueError("not a duration (use seconds or e.g. 1h, 30m, 10s)")
    return sum(int(n) * _DURATION_UNITS[u] for n, u in re.findall(r"(\d+)([smhdw])", text))


def format_size(n: int) -> str:
    """``65536`` -> ``64 KiB``; inexact values get one decimal, e.g. ``476.8 MiB``."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n // size} {unit}" if n % size == 0 else f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_duration(seconds: int) -> str:
    """``5400`` -> ``1h30m``; ``0`` -> ``0s``."""
    if seconds == 0:
        return "0s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts)
