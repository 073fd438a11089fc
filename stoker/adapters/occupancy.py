"""Which children of a worker's pool run a task at this moment: a byte per child in memory that the pool's parent
shares with every child it forks, so a child tells without a round trip whether a core of its host is idle.

Hand-written: Celery knows which children are busy only in the parent (and tells others by a broadcast that
takes a round trip of the broker); a child needs the answer in microseconds, in the middle of its own work.
"""

from __future__ import annotations

import multiprocessing


class PoolOccupancy:
    """Made in the pool's parent before it forks; each child marks its own slot (its index in the pool)."""

    def __init__(self, children: int) -> None:
        self._slots = multiprocessing.RawArray("B", max(children, 1))  # lock-free: one writer per slot

    def mark(self, index: int, busy: bool) -> None:
        """Child `index` starts (busy) or ends a task; an index past the slots (a pool grown later) is not seen."""
        if 0 <= index < len(self._slots):
            self._slots[index] = int(busy)

    def busy(self) -> int:
        """How many children run a task now."""
        return sum(self._slots)
