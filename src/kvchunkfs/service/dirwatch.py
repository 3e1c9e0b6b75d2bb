"""The catalog's directory watcher: entries made or removed in ``snapshots/`` behind the daemon's back.

Changes made through the mount or the repository are reported to the catalog as they happen
(``LiveCatalog.changed``); a file copied into, moved out of or deleted from ``snapshots/`` directly is
not. The watcher keeps every directory's mtime as of its last listing and the names of the
catalog's rows in it. Before each answer the catalog polls it: a directory whose mtime moved is
listed again and every name that differs from what is known is reported as changed. One ``lstat``
per directory, not per stub.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


class DirWatcher:
    def __init__(self, snapshots_dir: Path, changed: Callable[..., None]) -> None:
        self.snapshots_dir = snapshots_dir
        self.changed = changed  # report paths (relative to snapshots/) that may have changed
        self._children: dict[str, set[str]] = {}  # directory -> names of its rows
        self._dir_mtimes: dict[str, int] = {}  # directories seen -> their mtime when listed

    def watched(self, rel: str) -> bool:
        return rel in self._dir_mtimes

    def note_row(self, rel: str, step: int) -> None:
        """The catalog gained (``step`` > 0) or lost a row at ``rel``: a name its directory holds."""
        parent, _, name = rel.rpartition("/")
        children = self._children.setdefault(parent, set())
        if step > 0:
            children.add(name)
        else:
            children.discard(name)

    def register_dirs(self, rel: str) -> None:
        """Note the mtime of ``rel`` and every directory below it, each taken before it is listed."""
        stack = [rel]
        while stack:
            d = stack.pop()
            try:
                mtime = os.lstat(self.snapshots_dir / d).st_mtime_ns
                with os.scandir(self.snapshots_dir / d) as it:
                    subdirs = [e.name for e in it if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            self._dir_mtimes[d] = mtime
            stack += [f"{d}/{name}" if d else name for name in subdirs]

    def watch_dirs(self) -> None:
        """Notice entries made or removed behind the daemon's back (in ``snapshots/`` itself, not
        through the mount): a directory whose mtime moved is listed again and the names that differ
        from its rows are refreshed. One ``lstat`` per directory, not per stub."""
        for d, seen in list(self._dir_mtimes.items()):
            try:
                mtime = os.lstat(self.snapshots_dir / d).st_mtime_ns
                names = set(os.listdir(self.snapshots_dir / d)) if mtime != seen else None
            except OSError:
                del self._dir_mtimes[d]
                self.changed(d)
                continue
            if names is None:
                continue
            self._dir_mtimes[d] = mtime
            base = f"{d}/" if d else ""
            subdirs = {p[len(base) :] for p in self._dir_mtimes if p != d and p.startswith(base)}
            subdirs = {p for p in subdirs if "/" not in p}
            known = self._children.get(d, set()) | subdirs
            self.changed(*(base + name for name in names ^ known))
