"""Opens the kernel retries after ESTALE: the next rename over their name lets them in first.

An open of an inode whose name a rename replaced while the open waited (a save through
``NAME.tmp`` renamed over ``NAME``) cannot load that inode's file any more: it answers ESTALE, and
the kernel looks the name up again and retries the open once, at once (``do_filp_open`` with
``LOOKUP_REVAL``). Were the next rename over the name to come first, the retry would meet the same
race and the caller would see ESTALE. So a rename over a name whose opens are being retried waits
until as many opens of the name have gone through, or ``RETRY_WAIT`` seconds: it is delayed by one
lookup and one open, and never longer than that bound, however many readers there are (each
rename arms at most the retries of the opens it made stale).

On the trio thread: no lock, and the wait is a trio event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

RETRY_WAIT = 1.0  # seconds a rename over a name waits at most for the retried opens of it


@dataclass
class _Expected:
    count: int  # retries still to come
    since: int  # opens that arrived from this number on may be them
    deadline: float
    done: trio.Event = field(default_factory=trio.Event)


class StaleRetries:
    """Retried opens expected, by name."""

    def __init__(self) -> None:
        self._names: dict[str, _Expected] = {}
        self._arrivals = 0

    def arrival(self) -> int:
        """Number an open as it arrives (before it waits for anything)."""
        self._arrivals += 1
        return self._arrivals

    def expect(self, name: str | None) -> None:
        """An open of ``name`` answered ESTALE: the kernel retries it on that name."""
        if name is None:
            return
        now = trio.current_time()
        expected = self._names.get(name)
        if expected is None or expected.deadline <= now:
            expected = self._names[name] = _Expected(0, self._arrivals + 1, now)
        expected.count += 1
        expected.deadline = now + RETRY_WAIT

    def opened(self, name: str | None, arrival: int) -> None:
        """An open of ``name`` that arrived as ``arrival`` has its content (or failed): if it came
        after an ESTALE on that name, one retry fewer to wait for."""
        if name is None:
            return
        expected = self._names.get(name)
        if expected is None or arrival < expected.since:
            return
        expected.count -= 1
        if expected.count <= 0:
            expected.done.set()
            del self._names[name]

    async def let_in(self, name: str) -> None:
        """Before a rename over ``name``: wait for the retries of its opens (at most ``RETRY_WAIT``)."""
        expected = self._names.get(name)
        if expected is None:
            return
        while not expected.done.is_set() and trio.current_time() < expected.deadline:
            with trio.move_on_at(expected.deadline):
                await expected.done.wait()
        if self._names.get(name) is expected:
            del self._names[name]
