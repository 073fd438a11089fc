"""The batch lines' thread: lines taken from their own queue only into room interactive requests leave."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from stoker.core.pacing import Pace
from stoker.runtime.feeding.held import Held
from stoker.runtime.feeding.messages import bring_in, take_lines
from stoker.runtime.seams import LineSource, Message

#: How soon an empty batch-line queue is looked at again while lines come (it backs off while none do).
LINE_POLL_S = 0.02


class LineTaker:
    """Takes batch lines into the room `Held` has for them and hands them over as arrivals."""

    def __init__(
        self,
        lines: LineSource,
        held: Held,
        add: Callable[[Sequence[Message]], None],
        idle_max_wait_s: float,
        stopping: threading.Event,
    ) -> None:
        self.lines = lines
        self.held = held
        self._add = add
        self._stopping = stopping
        #: How often an empty line queue is looked at: soon while lines come, slower and slower while none do.
        self.pace = Pace(LINE_POLL_S, idle_max_wait_s)

    def step(self) -> None:
        """None while an interactive request waits, and never more than a batch of them held before the device takes
        them. So the prefetch an interactive request reaches the consumer through is never full of lines, and the
        device always has a batch of lines ready when no interactive request waits."""
        room = self.held.await_room_for_lines()
        if self._stopping.is_set():
            return
        taken = bring_in("batch lines", lambda: take_lines(self.lines, room), self._add, self._stopping)
        self._stopping.wait(self.pace.next_wait(active=bool(taken)) if len(taken) < room else 0)
