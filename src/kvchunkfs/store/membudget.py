"""How much memory the machine has for the memory tier, and how short of it the machine is now.

The memory tier (staged saves and hot copies: ``wholefiles``) lives in tmpfs pages, which
nothing reclaims without swap. Its budget is derived from the memory the daemon may really use:
the host's ``MemTotal`` or, if smaller, the limit of the memory cgroup it runs in (cgroup v2
``memory.max``, v1 ``memory.limit_in_bytes``). By default staged saves and hot copies together
take at most a quarter of that (``TIER_SHARE``): a host whose main job is inference needs the
rest for model weights, its KV cache and the page cache.

"Short of memory" (``Memory.short``) is any of:

- the host's ``MemAvailable`` below ``LOW_SHARE`` of its memory;
- the cgroup's memory in use (its usage less the file pages the kernel can drop) within
  ``LOW_SHARE`` of its limit;
- pressure stall information (``/proc/pressure/memory``): tasks stalled on memory more than
  ``PSI_SOME_PCT`` percent of the last 10 s.

Reading these is a few small files under /proc and /sys: cheap enough to do several times a second.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

TIER_SHARE = 4  # the tier's default budget: 1/4 of the machine's memory
LOW_SHARE = 8  # short of memory: less than 1/8 of it available
LOW_MIN = 64 << 20  # ... and never a margin below this
PSI_SOME_PCT = 10.0  # short of memory: tasks stalled on it more than this share of the last 10 s
UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge number (2^63 rounded to pages)

MEMINFO = Path("/proc/meminfo")
PSI = Path("/proc/pressure/memory")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty if unreadable)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in MEMINFO.read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED else value


@dataclass(frozen=True)
class Cgroup:
    """The memory cgroup the daemon runs in: where its limit and usage are read."""

    path: Path
    v2: bool

    @property
    def limit(self) -> int | None:
        return _read_int(self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes"))

    def in_use(self) -> int | None:
        """Memory charged to the cgroup that the kernel cannot simply drop (its usage less its
        file pages: tmpfs pages are counted with anonymous memory, not as file pages)."""
        usage = _read_int(self.path / ("memory.current" if self.v2 else "memory.usage_in_bytes"))
        if usage is None:
            return None
        stat: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in (self.path / "memory.stat").read_text().splitlines():
                name, _, value = line.partition(" ")
                if value.strip().isdigit():
                    stat[name] = int(value)
        if self.v2:
            cache = stat.get("file", 0) - stat.get("shmem", 0)
        else:
            cache = stat.get("total_cache", stat.get("cache", 0)) - stat.get("total_shmem", stat.get("shmem", 0))
        return max(0, usage - max(0, cache))


def own_cgroup(proc_cgroup: str = "/proc/self/cgroup", root: Path = CGROUP_ROOT) -> Cgroup | None:
    """The memory cgroup of this process with a limit to read, the nearest limited ancestor
    included; None if there is none (no memory controller, or no limit anywhere above)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    candidates: list[Cgroup] = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if controllers == "" and (root / "cgroup.controllers").exists():
            candidates.append(Cgroup(root / rel, True))
        elif "memory" in controllers.split(","):
            candidates.append(Cgroup(root / "memory" / rel, False))
    for group in candidates:
        path = group.path
        while True:
            found = Cgroup(path, group.v2)
            if found.limit is not None:
                return found
            if path in (root, root / "memory") or path == path.parent:
                break
            path = path.parent
    return None


def machine_memory(cgroup: Cgroup | None = None) -> int:
    """The memory the daemon may use: the host's, or its cgroup's limit if smaller."""
    total = meminfo().get("MemTotal", 0)
    limit = cgroup.limit if cgroup is not None else None
    if limit is not None and (total == 0 or limit < total):
        return limit
    return total


def default_tier_size(cgroup: Cgroup | None = None) -> int:
    return machine_memory(cgroup) // TIER_SHARE


def psi_some_avg10(path: Path = PSI) -> float | None:
    try:
        first = path.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    for field in first[1:]:
        name, _, value = field.partition("=")
        if name == "avg10":
            with contextlib.suppress(ValueError):
                return float(value)
    return None


@dataclass
class Reading:
    """How short of memory the machine is now: ``need`` bytes to free (0: not short) and why."""

    need: int
    why: str


class Memory:
    """The host's and the daemon's cgroup's memory, read on demand."""

    def __init__(self, cgroup: Cgroup | None = None, psi: Path = PSI) -> None:
        self.cgroup = cgroup
        self.psi = psi
        self.total = meminfo().get("MemTotal", 0)
        self.margin = max(LOW_MIN, self.total // LOW_SHARE)

    def reading(self, slack: int = 0) -> Reading:
        """Bytes to free before the machine has its margin back, plus ``slack`` (0 and "" when
        it is not short). ``slack``: a little more than the shortfall, so one pass ends an episode."""
        needs: list[tuple[int, str]] = []
        avail = meminfo().get("MemAvailable")
        if avail is not None and avail < self.margin:
            needs.append((self.margin - avail, f"MemAvailable {avail >> 20} MiB"))
        group = self.cgroup
        if group is not None:
            limit, used = group.limit, group.in_use()
            if limit is not None and used is not None:
                cmargin = max(LOW_MIN, limit // LOW_SHARE)
                if limit - used < cmargin:
                    needs.append((cmargin - (limit - used), f"cgroup {used >> 20} of {limit >> 20} MiB in use"))
        some = psi_some_avg10(self.psi)
        if some is not None and some > PSI_SOME_PCT:
            needs.append((0, f"memory pressure {some:.0f}% (PSI some avg10)"))
        if not needs:
            return Reading(0, "")
        need = max(n for n, _ in needs)
        return Reading(need + slack if need or slack else 1, "; ".join(w for _, w in needs))
