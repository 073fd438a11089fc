"""Queue pressure: depth against limits, drain rates, and what admission and the tokenize stage make of them.

Pure values and decisions; sampling the broker and the counters happens at the edges (api/, tasks/).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QueueState:
    """One queue at one moment."""

    name: str
    depth: int
    limit: int
    #: Messages taken off this queue per second, measured over the recent window (0 when nothing drained).
    drain_per_s: float

    @property
    def over(self) -> bool:
        """At or past its limit: new work is refused."""
        return self.depth >= self.limit


@dataclass(frozen=True)
class Refusal:
    """Why a job was refused, and when to come back."""

    queue: str
    depth: int
    limit: int
    retry_after_s: int


def queue_refusal(
    states: Sequence[QueueState], resume_ratio: float, min_s: int = 1, max_s: int = 120
) -> Refusal | None:
    """None when every queue is under its limit; else the refusal for the queue that needs longest to recover.
    One of admission control's two checks; the other, which also takes the job's place, is its tenant's
    (`api.tenancy.admit`: in stoker's code only that admits).

    Retry-After is the time that queue needs, at its measured drain rate, to fall back to `resume_ratio` of its
    limit; with nothing draining, the longest wait.
    """
    refusals = [_refusal(s, resume_ratio, min_s, max_s) for s in states if s.over]
    return max(refusals, key=lambda r: r.retry_after_s) if refusals else None


def _refusal(state: QueueState, resume_ratio: float, min_s: int, max_s: int) -> Refusal:
    excess = state.depth - math.floor(state.limit * resume_ratio)
    wait = math.ceil(excess / state.drain_per_s) if state.drain_per_s > 0 else max_s
    return Refusal(state.name, state.depth, state.limit, min(max(wait, min_s), max_s))


#: Queues whose stage waits on the inference queue's watermarks before its messages count as drained.
GATED_BY_INFERENCE = ("tokenize",)


def drain_rate(queue: str, rates: Mapping[str, float]) -> float:
    """The drain rate a queue's Retry-After is computed from: its own, as measured.

    Only a queue whose stage is held back by the inference watermarks (tokenize), and which has measured nothing
    yet, takes the inference queue's rate: it drains as fast as inference lets it. Any other queue keeps its own,
    however fast the queues after it drain: when OCR is the bottleneck, text-only jobs racing through inference
    must not make the OCR queue's clients come back too early.
    """
    own = rates.get(queue, 0.0)
    if own == 0 and queue in GATED_BY_INFERENCE:
        return rates.get("infer", 0.0)
    return own


def room_to_enqueue(depth: int, high: int, low: int, held: bool) -> bool:
    """The inference queue's watermarks: a producer stops above `high` and, once it (or anyone) is held, starts
    again only at or below `low`."""
    return depth <= (low if held else high)


@dataclass(frozen=True)
class _Sample:
    at: float
    counters: dict[str, int]
    #: Queue depths at `at`; None when not known (then every interval counts as busy).
    depths: dict[str, int] | None


class DrainMeter:
    """Drain rates from monotonically growing per-queue counters, sampled over a sliding window.

    Only the time a queue had work counts: an interval during which it was empty and drained nothing says nothing
    about how fast it drains, so a burst that starts after a quiet spell is measured at the speed it is served at,
    not diluted by the quiet (which would make Retry-After far too long right when it matters).

    A queue that drains in bursts further apart than the window (the synchronous baseline's one thread finishes a
    whole batch every several seconds) would read as not draining at all, and its clients would be told to come
    back in two minutes; such a queue's rate is taken over the longer `horizon_s` instead.
    """

    def __init__(self, window_s: float = 30.0, horizon_s: float = 120.0) -> None:
        self.window_s = window_s
        self.horizon_s = max(horizon_s, window_s)
        self._samples: deque[_Sample] = deque()

    def add(self, now: float, counters: Mapping[str, int], depths: Mapping[str, int] | None = None) -> None:
        """Record the counters (and, where known, the queues' depths) as read at `now`."""
        self._samples.append(_Sample(now, dict(counters), dict(depths) if depths is not None else None))
        while len(self._samples) > 2 and now - self._samples[1].at >= self.horizon_s:
            self._samples.popleft()

    def rate(self, queue: str) -> float:
        """Messages per second drained from `queue` while it had work, across the window (across the horizon if
        nothing drained in the window)."""
        samples = list(self._samples)
        if len(samples) < 2:
            return 0.0
        newest = samples[-1].at
        # From the newest sample at least a window old (the oldest, while the meter is younger than a window).
        start = next((i for i in range(len(samples) - 1, -1, -1) if newest - samples[i].at >= self.window_s), 0)
        for first in (start, 0):
            drained, busy = _busy_drain(samples[first:], queue)
            if drained and busy > 0:
                return drained / busy
        return 0.0


def _busy_drain(samples: Sequence[_Sample], queue: str) -> tuple[int, float]:
    """Messages drained from `queue` over consecutive samples, and the seconds of those intervals in which it had
    work (messages waiting at the interval's start, or drained during it)."""
    drained, busy = 0, 0.0
    for before, after in itertools.pairwise(samples):
        step = max(after.counters.get(queue, 0) - before.counters.get(queue, 0), 0)
        waiting = before.depths is None or before.depths.get(queue, 0) > 0
        if step or waiting:
            drained, busy = drained + step, busy + (after.at - before.at)
    return drained, busy


@dataclass(frozen=True)
class StoreMemory:
    """The job store's memory at one moment: bytes used, and its `maxmemory` (0: none set)."""

    at: float
    used: int
    limit: int

    def nearly_full(self, high_ratio: float) -> bool:
        """Whether new work must wait: the store has a limit and uses at least `high_ratio` of it."""
        return self.limit > 0 and self.used >= high_ratio * self.limit
