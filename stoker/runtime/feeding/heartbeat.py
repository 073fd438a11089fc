"""The consumer's heartbeat: every `beat_s` while jobs come, slower and slower while none comes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from stoker.core.pacing import Pace
from stoker.runtime.feeding.registry import Registry

log = logging.getLogger(__name__)


class Heartbeat:
    """Beats for the consumer (the jobs it holds are written as they come and go). Each beat lasts three of its
    waits, so it never lapses while the consumer lives; the first jobs after a quiet spell beat at once
    (`arrival`), back at `beat_s`."""

    def __init__(self, registry: Registry, beat_s: float, idle_max_wait_s: float, holding: Callable[[], bool]) -> None:
        self.registry = registry
        self.beat_s = beat_s
        #: Every `beat_s` while the consumer holds jobs, slower while it holds none.
        self.pace = Pace(beat_s, idle_max_wait_s)
        self._holding = holding
        self._beat_now = threading.Event()
        self._arrived = False  # messages came since the last beat

    def arrival(self) -> None:
        """Messages arrived: a beat at once if the last one promised life for longer than a death may go unnoticed
        now."""
        self._arrived = True
        try:
            if self.pace.slowed:
                self.beat_at_pace(active=True)
                self._beat_now.set()
        except Exception as exc:  # the store is away: the heartbeat's next round tries again
            log.warning("could not beat: %s", exc)

    def step(self) -> None:
        """One round: a beat, then its wait (cut short by `wake`)."""
        try:
            arrived, self._arrived = self._arrived, False
            wait = self.beat_at_pace(active=arrived or self._holding())
        except Exception as exc:  # the store is away: the next beat tries again
            log.warning("heartbeat failed: %s", exc)
            wait = self.beat_s
        self._beat_now.wait(wait)
        self._beat_now.clear()

    def beat_at_pace(self, active: bool) -> float:
        """Beat for three of the next waits; the next wait."""
        wait = self.pace.next_wait(active)
        self.registry.beat(ttl_s=wait * 3)
        return wait

    def wake(self) -> None:
        """End the round's wait now."""
        self._beat_now.set()
