"""What the proxy knows of llama-server's slots, and which slot a request goes to."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvchunkfs.service.prefixtree import common_prefix_len


@dataclass
class Slot:
    """What the proxy knows of one llama-server slot."""

    id: int
    tokens: list[int] = field(default_factory=list)  # leading tokens it holds, as far as the proxy knows
    n_tokens: int = 0  # its token count as llama-server reported it (a change behind our back shows here)
    snapshot: str | None = None  # the stored file equal to its content
    prompt_len: int = 0  # the prompt part of ``snapshot``
    busy: bool = False
    saving: bool = False  # its request is answered; the save is running
    tenant: str | None = None  # with tenant isolation: whose content it holds (None: not known)
    last_used: float = 0.0

    def forget(self) -> None:
        self.tokens, self.n_tokens, self.snapshot, self.prompt_len = [], 0, None, 0


class SlotPool:
    """Free slots handed to requests: the one holding the longest prefix of the prompt, else the least
    recently used. Waits when every slot is busy, and when a slot still saving holds ``min_gain`` more
    of the prompt than any free one: an agent sends its next turn as soon as it has the answer, and
    that turn belongs on the slot that just produced the answer (the save takes milliseconds)."""

    def __init__(self, n: int, min_gain: int = 1) -> None:
        self.slots = [Slot(i) for i in range(n)]
        self.min_gain = min_gain
        self._changed = asyncio.Condition()

    async def acquire(self, tokens: list[int], tenant: str | None = None) -> Slot:
        """``tenant`` (with isolation): only slots holding that tenant's content count what they hold."""
        async with self._changed:
            while True:
                slot = self._pick(tokens, tenant)
                if slot is not None:
                    slot.busy = True
                    return slot
                await self._changed.wait()

    def _pick(self, tokens: list[int], tenant: str | None = None) -> Slot | None:
        held = {s.id: common_prefix_len(tokens, s.tokens) if tenant is None or s.tenant == tenant else 0
                for s in self.slots}  # fmt: skip
        free = [s for s in self.slots if not s.busy]
        best = max(free, key=lambda s: (held[s.id], -s.last_used)) if free else None
        saving = [held[s.id] for s in self.slots if s.busy and s.saving]
        if saving and max(saving) >= (held[best.id] if best else 0) + self.min_gain:
            return None
        return best

    @contextlib.asynccontextmanager
    async def changed(self) -> AsyncIterator[None]:
        """Change slots under the pool's lock; waiting requests look again afterwards."""
        async with self._changed:
            yield
            self._changed.notify_all()

    async def release(self, slot: Slot) -> None:
        async with self._changed:
            slot.busy = slot.saving = False
            slot.last_used = time.monotonic()
            self._changed.notify_all()
