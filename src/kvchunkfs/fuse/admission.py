"""A save admitted at its open, before any byte of it is written (a write passed through to its
file cannot wait, nor fail in a way the daemon sees): refused while the store cannot keep it, or
held while the whole-file directory lacks room and ingestion is making some (file/room.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from kvchunkfs.file.room import Room
from kvchunkfs.fuse import api as fuse

log = logging.getLogger(__name__)

WAIT_STEP = 0.05  # seconds between looks at the room while an open waits for it
MAX_WAIT = 60.0  # seconds an open waits for room at most (others' saves keeping ingestion busy cannot hold it for ever)


async def admit(room: Room, what: str, writing: Callable[[], list[int]], stopping: Callable[[], bool]) -> None:
    """Return once the save ``what`` may start; FUSEError (ENOSPC, EIO, EROFS) if it is refused.
    ``writing``: the sizes of the files open for writing; ``stopping``: the mount is stopping
    (the wait ends: the open is refused by the caller). The wait lasts at most ``MAX_WAIT``."""
    waited = False
    deadline = trio.current_time() + MAX_WAIT
    while True:
        error, short = await trio.to_thread.run_sync(room.at_open, writing())
        if error is not None:
            raise fuse.FUSEError(error.errno or 0)
        if not short or not room.can_make_room() or stopping():
            return
        if trio.current_time() >= deadline:  # it goes on: a write that finds no room fails its save, not others'
            log.warning("%s waited %.0f s for room: it goes on", what, MAX_WAIT)
            return
        if not waited:
            waited = True
            room.waits += 1
            log.info("%s waits: the whole-file directory lacks %d MiB, which ingestion is making", what, short >> 20)
        await trio.sleep(WAIT_STEP)
