"""How often a background loop wakes: at its own pace while something happens, slower and slower while nothing
does, and at its own pace again the moment something does (the queue monitor, the reaper, the inference
consumer's heartbeat, the device monitor). An idle stack then costs next to nothing, and a busy one is watched as
closely as ever."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Pace:
    """A loop's next wait: `base_s` while active; while idle, `factor` times the last wait, up to `max_s`."""

    base_s: float
    max_s: float
    factor: float = 2.0
    wait_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.max_s = max(self.max_s, self.base_s)  # a loop never waits longer than its own pace asks
        self.wait_s = self.base_s

    def next_wait(self, active: bool) -> float:
        """The wait before the loop's next round, after a round that was `active` (saw work) or not."""
        self.wait_s = self.base_s if active else min(self.wait_s * self.factor, self.max_s)
        return self.wait_s

    @property
    def slowed(self) -> bool:
        """Whether the loop waits longer than its own pace now (it has seen nothing for a while)."""
        return self.wait_s > self.base_s

    def reset(self) -> None:
        """Something happened elsewhere: back to the loop's own pace."""
        self.wait_s = self.base_s
