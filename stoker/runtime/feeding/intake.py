"""The intake thread: on a Redis broker, interactive requests taken straight from their queue, as many as the
consumer has room for (the prefetch) per round trip."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from stoker.runtime.feeding.messages import bring_in
from stoker.runtime.seams import Intake, Message

#: How long the intake waits for a message before it looks again (and writes the acks gathered meanwhile).
INTAKE_BLOCK_S = 1.0


class IntakeTaker:
    """Takes interactive requests into the prefetch's room and hands them over as arrivals."""

    def __init__(
        self, intake: Intake, prefetch: int, add: Callable[[Sequence[Message]], None], stopping: threading.Event
    ) -> None:
        self.intake = intake
        self.prefetch = prefetch
        self._add = add
        self._stopping = stopping

    def step(self) -> None:
        """Interactive requests, as many as wait and the prefetch has room for, in one round trip; while none
        waits, the first to come (within INTAKE_BLOCK_S, then again)."""
        held = self.intake.wait_below(self.prefetch, INTAKE_BLOCK_S)
        if held >= self.prefetch or self._stopping.is_set():
            return
        take = self.prefetch - held
        bring_in("inference requests", lambda: self.intake.take(take, INTAKE_BLOCK_S), self._add, self._stopping)
