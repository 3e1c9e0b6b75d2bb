"""Restore accounting: a snapshot's read-only opens grouped into one restore (``Restore``),
counted once as a use of the snapshot, timed from its first open to its last close and reported
(metrics, history, one log line) when its content is closed or taken for something else.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import trio

from kvchunkfs.file.content import FileContent
from kvchunkfs.file.saves import mib as _mib
from kvchunkfs.fuse.bridge import Handle, Node, Restore
from kvchunkfs.store.repository import Repository

log = logging.getLogger(__name__)


class RestoreObserver(Protocol):
    """Told about restores (metrics); called on the FUSE thread, so it must be quick."""

    def on_restore(self, seconds: float, size: int) -> None: ...


class Restores:
    """The restores of one mount (the module's docstring)."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self.restores = 0  # restores begun (metrics)
        self.observer: RestoreObserver | None = None

    async def count(
        self, node: Node, rel: str, content: FileContent, handle: Handle, start: float, source: str, noted: bool
    ) -> None:
        """Make ``handle`` (on ``content``, the snapshot at ``rel``) part of the node's restore: a new
        one (counted, a use of the snapshot), or the one under way whose content it took
        (llama-server's second open of a restore)."""
        restore = node.restore
        if restore is None:
            self.restores += 1
            restore = node.restore = Restore(rel, content.size, source, start)
        else:
            restore.opens += 1
            noted = True  # its first open counted the use
        restore.handles += 1
        handle.restore = restore
        if not noted:  # the content was loaded already: no thread ran for this open
            async with node.gate.use():
                if node.path is not None:
                    await trio.to_thread.run_sync(self.repo.note_use, node.path)

    def end(self, node: Node) -> None:
        """The node's restore is over once none of its handles is open and its content is closed or
        taken by another open: report it (metrics, history, one log line)."""
        restore = node.restore
        if restore is None or restore.handles:
            return
        node.restore = None
        seconds = (restore.closed or time.monotonic()) - restore.start
        if self.observer is not None:
            try:
                self.observer.on_restore(seconds, restore.size)
            except Exception:  # metrics must never fail a restore
                log.exception("observer on_restore failed")
        log.info("restored %s: %s in %.0f ms from %s (%d open%s)", restore.name, _mib(restore.size), seconds * 1000,
                 restore.source, restore.opens, "" if restore.opens == 1 else "s")  # fmt: skip
