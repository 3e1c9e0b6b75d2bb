"""A graceful stop: on SIGTERM/SIGINT, let the saves in flight finish before the session ends.

Ending the session closes the kernel connection: from then on every request on the mount, a
writer's next ``write`` or its ``close`` included, fails with ENOTCONN and the save is lost. So on
the first signal the mount keeps serving while it waits:

1. it stops taking new writes (``Writes.stopping``: an open for writing, a create or a truncate is
   refused with EROFS), so the wait ends; reads, renames, unlinks and metadata calls are served;
2. it waits until no file is open for writing and no save runs, and no writer has closed for
   ``SETTLE`` seconds (a save's client renames ``NAME.tmp`` over ``NAME`` right after the close),
   for at most ``bound`` seconds (setting ``stop_timeout``);
3. it ends the session (``terminate``). A writer still open then loses its unsaved writes: the
   file keeps its previous version, and the log names it.

A second signal ends the session at once. The session is reached only through ``terminate`` and
the ``Writes`` view of the operations, so this runs unchanged on any FUSE front end.
"""

from __future__ import annotations

import logging
import math
import signal
from collections.abc import Callable
from typing import Protocol

import trio

from kvchunkfs.fuse.sdnotify import notify

log = logging.getLogger(__name__)

SETTLE = 1.0  # seconds without a writer's close before the session ends (a save's rename follows its close)
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Writes(Protocol):
    """What a stop needs of the operations (``fuse.operations.Operations``)."""

    stopping: bool  # set: new writes are refused
    last_write_end: float  # trio time a write last ended

    @property
    def write_activity(self) -> trio.Event: ...  # set when a write ends

    # Writes under way: handles open for writing (from their open request until their release has
    # saved) and truncates by path (until saved).
    def writes_in_flight(self) -> int: ...

    def open_for_writing(self) -> list[str]: ...  # the names of the files open for writing


async def wait_for_writes(ops: Writes, settle: float = SETTLE) -> None:
    """Return once nothing is open for writing, no save runs and none ended in the last ``settle`` s."""
    while True:
        event = ops.write_activity
        quiet = trio.current_time() - ops.last_write_end
        if ops.writes_in_flight() == 0 and quiet >= settle:
            return
        with trio.move_on_after(settle - quiet if ops.writes_in_flight() == 0 else math.inf):
            await event.wait()


async def stop_gracefully(ops: Writes, terminate: Callable[[], None], bound: float, settle: float = SETTLE) -> None:
    """Refuse new writes, wait up to ``bound`` seconds for the writes in flight, then ``terminate``."""
    ops.stopping = True
    writers = ops.open_for_writing()
    if writers:
        log.info("stopping: new writes refused; waiting up to %s s for %d file(s) open for writing: %s",
                 bound, len(writers), ", ".join(writers))  # fmt: skip
        notify(f"STATUS=stopping: waiting for {len(writers)} file(s) open for writing")
    with trio.move_on_after(bound):
        await wait_for_writes(ops, settle)
    left = ops.open_for_writing()
    if left:
        log.warning("stopping after %s s with %d file(s) still open for writing: %s; their unsaved writes are "
                    "lost, each keeps its previous version", bound, len(left), ", ".join(left))  # fmt: skip
    elif ops.writes_in_flight():
        log.warning("stopping after %s s with a save still running: it completes or leaves the previous version",
                    bound)  # fmt: skip
    terminate()


async def stop_on_signals(ops: Writes, terminate: Callable[[], None], bound: float) -> None:
    """The first SIGINT/SIGTERM stops gracefully (``stop_gracefully``); a second one at once."""
    with trio.open_signal_receiver(*SIGNALS) as signals:
        async with trio.open_nursery() as nursery:
            async for signum in signals:
                if not ops.stopping:
                    log.info("signal %d: stopping (saves in flight finish, then unmount)", signum)
                    notify("STOPPING=1")
                    nursery.start_soon(_stop_then_leave, ops, terminate, bound, nursery.cancel_scope)
                    continue
                log.warning("signal %d again: unmounting now", signum)
                nursery.cancel_scope.cancel()
                terminate()
                return


async def _stop_then_leave(ops: Writes, terminate: Callable[[], None], bound: float, scope: trio.CancelScope) -> None:
    await stop_gracefully(ops, terminate, bound)
    scope.cancel()  # stop listening: the session ends
