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
    """Free slots handed to requests, in this order: the slot whose content the prompt continues (the
    longest such prefix: the conversation's own slot), else an empty slot, else the least valuable one
    (its content already saved, then the longest shared prefix, then least recently used). So
    conversations sharing a system prompt do not take each other's slots while one sits empty; a
    shared prefix is restored from the store into the empty slot instead. Without a store to restore
    from (``restores`` False), the longest shared prefix comes first, as it cannot be brought back.

    Waits when every slot is busy, and when a slot still saving holds the conversation the prompt
    continues, ``min_gain`` tokens more than the pick: an agent sends its next turn as soon as it has
    the answer, and that turn belongs on the slot that just produced the answer (the save takes
    milliseconds)."""

    def __init__(self, n: int, min_gain: int = 1, restores: bool = True) -> None:
        self.slots = [Slot(i) for i in range(n)]
        self.min_gain = min_gain
        self.restores = restores
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

        def continued(s: Slot) -> bool:  # the prompt goes on from all the slot holds (as far as known)
            return held[s.id] > 0 and held[s.id] >= len(s.tokens)

        def rank(s: Slot) -> tuple[int, ...]:
            empty = not s.tokens and s.n_tokens == 0
            if continued(s):
                return (3, held[s.id])
            if not self.restores:
                return (1, held[s.id], empty, -int(s.last_used * 1000))
            if empty:
                return (2, -int(s.last_used * 1000))
            return (1, s.snapshot is not None, held[s.id], -int(s.last_used * 1000))

        free = [s for s in self.slots if not s.busy]
        best = max(free, key=rank) if free else None
        mine = best is not None and continued(best)
        saving = [held[s.id] for s in self.slots if s.busy and s.saving and continued(s)]
        if saving and max(saving) >= (held[best.id] if best is not None and mine else 0) + self.min_gain:
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
