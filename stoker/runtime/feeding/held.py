"""Every request the inference consumer holds, from its arrival to its batch written, under the one lock its threads
share (`Held` owns it: the other collaborators only call its methods).

One lock over the state, and a condition per thread that waits on it, so that each change wakes only the threads it
concerns: an arrival (once per message) wakes the collector, not the device and line threads as well. A wake-up costs
a futex call and a GIL hand-off to a thread that finds nothing to do; with a condition shared by all, arrivals'
wake-ups were the inference worker's largest own cost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stoker.core.batching import BatchPolicy, Plan, Waiting, start_at, top_up
from stoker.runtime.batches import BatchItem
from stoker.runtime.feeding.messages import as_waiting, is_batch_line, job_of
from stoker.runtime.seams import Message


@dataclass(frozen=True)
class TopUp:
    """What the collector took: the plan (None: no batch can take the arrivals now), the messages to load, those whose
    deadline passed, and the arrived jobs to name as held."""

    plan: Plan | None
    take: list[Message]
    expired: list[Message]
    unheld: list[str]


@dataclass(frozen=True)
class Taken:
    """A batch the device took: what runs, what missed its deadline waiting for the device, what was cancelled, when
    it was taken, and the device's idle gap before it (None: no work waited)."""

    items: list[BatchItem]
    late: list[BatchItem]
    dropped: list[BatchItem]
    at: float
    gap: float | None


class Held:
    """The requests the consumer holds: waiting for the collector, loading, prepared, on the device and written."""

    def __init__(
        self, policy: BatchPolicy, line_batch: int, interactive_quiet_s: float, stopping: threading.Event
    ) -> None:
        self.policy = policy
        #: Lines in a batch while interactive requests come (`_line_bound`).
        self.line_batch = line_batch
        self.interactive_quiet_s = interactive_quiet_s
        self._stopping = stopping
        self._lock = threading.RLock()
        self._to_collect = threading.Condition(self._lock)  # arrivals, room in the prepared batch
        self._to_run = threading.Condition(self._lock)  # a prepared batch for the device
        self._to_take_lines = threading.Condition(self._lock)  # room for batch lines
        self._waiting: dict[str, tuple[Waiting, Message]] = {}
        #: Jobs that arrived and are not yet named as held: the collector names them (`take_top_up`).
        self._unheld: list[str] = []
        self._loading: list[Message] = []
        self._prepared: list[BatchItem] = []
        self._running: list[BatchItem] = []
        self._written: list[BatchItem] = []
        self._interactive_at: float | None = None  # when the last interactive request arrived
        self._last_end: float | None = None
        self._work_at_end = False

    # -- arrivals -----------------------------------------------------------------------------------------------
    def arrive(self, requests: Sequence[Message], now: float) -> bool:
        """Messages that just arrived wait for the collector; False once the consumer stopped (`empty` has emptied
        what waits already: the caller hands them back)."""
        with self._lock:
            if self._stopping.is_set():
                return False
            for request in requests:
                self._waiting[request.id] = (as_waiting(request, now), request)
                self._unheld.append(job_of(request))
            if not all(is_batch_line(r) for r in requests):
                self._interactive_at = now
            # Neither the device's batch nor the room for lines grows with an arrival: the collector alone.
            self._to_collect.notify()
        return True

    # -- the collector ------------------------------------------------------------------------------------------
    def take_top_up(self) -> TopUp | None:
        """Wait until something fits the prepared batch (not full, within the token budget) or arrivals are to be
        named as held, and take it; None once the consumer stops."""
        with self._lock:
            plan = self._plan_top_up()
            while plan is None and not self._unheld:
                if self._stopping.is_set():
                    return None
                self._to_collect.wait()
                plan = self._plan_top_up()
            take = [self._waiting.pop(w.key)[1] for w in plan.run] if plan else []
            expired = [self._waiting.pop(w.key)[1] for w in plan.expired] if plan else []
            self._loading = take
            gone = {job_of(m) for m in expired}
            unheld, self._unheld = [j for j in self._unheld if j not in gone], []
        return TopUp(plan, take, expired, unheld)

    def prepare(self, items: list[BatchItem]) -> None:
        """The loaded items join the prepared batch."""
        with self._lock:
            self._prepared.extend(items)
            self._loading = []
            self._wake(self._to_run, self._to_take_lines)

    def unheld_again(self, job_ids: Sequence[str]) -> None:
        """Jobs still waiting whose naming as held failed: the next round names them."""
        with self._lock:
            self._unheld.extend(job_ids)

    def _plan_top_up(self) -> Plan | None:
        """What joins the prepared batch now (called holding the lock); None when nothing would change."""
        if not self._waiting:
            return None
        if any(not w.batch for w, _ in self._waiting.values()):
            self._lines_make_way()
        if len(self._prepared) >= self.policy.max_batch_size:
            return None
        waiting = [w for w, _ in self._waiting.values()]
        tokens = sum(len(i.request.prompt_ids) for i in self._prepared)
        lines = len(self._prepared_lines())
        interactive = lines < len(self._prepared)
        now = time.time()
        line_room = self._line_bound(now) - (lines if not interactive else 0)
        plan = top_up(waiting, len(self._prepared), tokens, now, self.policy, interactive, max(line_room, 0))
        return plan if plan.run or plan.expired else None

    def _lines_make_way(self) -> None:
        """Interactive requests wait: the batch lines of the prepared batch go back to the waiting ones, so the next
        batch is the interactive requests' alone and each waits at most for the batch on the device (called
        holding the lock)."""
        back = self._prepared_lines()
        for item in back:
            assert item.message is not None
            self._waiting[item.message.id] = (as_waiting(item.message, item.arrived), item.message)
        gone = {id(i) for i in back}
        self._prepared = [i for i in self._prepared if id(i) not in gone]

    # -- batch lines --------------------------------------------------------------------------------------------
    def await_room_for_lines(self) -> int:
        """Wait until the consumer has room for batch lines; how many more it may hold (0 once it stops)."""
        with self._lock:
            room = self._room_for_lines()
            while not room and not self._stopping.is_set():
                self._to_take_lines.wait()
                room = self._room_for_lines()
        return room

    def _room_for_lines(self) -> int:
        """How many more batch lines the consumer may hold now (called holding the lock)."""
        waiting = [w for w, _ in self._waiting.values()]
        if any(not w.batch for w in waiting):
            return 0
        loading = sum(1 for m in self._loading if is_batch_line(m))
        return max(self._line_bound(time.time()) - len(waiting) - len(self._prepared_lines()) - loading, 0)

    def _prepared_lines(self) -> list[BatchItem]:
        """The batch lines of the prepared batch (called holding the lock)."""
        return [i for i in self._prepared if i.message is not None and is_batch_line(i.message)]

    def _line_bound(self, now: float) -> int:
        """Lines in a batch: `line_batch` while interactive requests come (an interactive request that arrives
        waits at most for the batch on the device, so its lines are few), a full batch while none has come for
        `interactive_quiet_s` (the device is the lines' alone: as many as it takes)."""
        recent = self._interactive_at is not None and now - self._interactive_at < self.interactive_quiet_s
        return self.line_batch if recent else self.policy.max_batch_size

    # -- the device ---------------------------------------------------------------------------------------------
    def take_batch(self, cancelled: Callable[[Sequence[str]], set[str]]) -> Taken | None:
        """Wait for a prepared batch and its start time; take it (None once the consumer stops). The idle gap counts
        only if work waited; a job `cancelled` while it waited for the device, or whose deadline passed, is left
        out."""
        with self._lock:
            while not self._stopping.is_set():
                now = time.time()
                at = start_at([i.arrived for i in self._prepared], now, self.policy)
                if at is not None and at <= now:
                    break
                self._to_run.wait(None if at is None else at - now)
            else:
                return None
            size = self.policy.max_batch_size
            prepared, self._prepared = self._prepared[:size], self._prepared[size:]
            # At the last moment, in memory: a job cancelled while it waited for the device never reaches it.
            gone = cancelled([i.job_id for i in prepared])
            dropped = [i for i in prepared if i.job_id in gone]
            wanted = [i for i in prepared if i not in dropped]
            items = [i for i in wanted if not i.pending.deadline or i.pending.deadline > now]
            self._running = items
            gap = now - self._last_end if self._last_end is not None and self._work_at_end else None
            self._wake(self._to_collect, self._to_take_lines)  # room to prepare the next one
        late = [i for i in wanted if i not in items]  # their deadline passed while they waited for the device
        return Taken(items, late, dropped, now, gap)

    def ran(self, going_on: list[BatchItem]) -> None:
        """The batch on the device returned; answers under way (`going_on`) go first in the next batch, beside the
        requests that waited."""
        with self._lock:
            self._last_end = time.time()
            if going_on:
                self._lines_make_way()
                self._prepared = going_on + self._prepared
            self._work_at_end = bool(self._waiting or self._loading or self._prepared)
            if going_on:  # the prepared batch and the waiting lines changed
                self._wake(self._to_collect, self._to_take_lines)

    def off_device(self) -> None:
        """The batch that ran is handed to the writer."""
        with self._lock:
            self._running = []

    def writing(self, items: list[BatchItem]) -> None:
        """The batch the writer is writing (none: written)."""
        with self._lock:
            self._written = items

    def interactive_waiting(self) -> int:
        """Interactive requests waiting for the device (arrived, loading or prepared): what a running call may
        stop for, between its decoding steps."""
        with self._lock:
            waiting = sum(1 for w, _ in self._waiting.values() if not w.batch)
            loading = sum(1 for m in self._loading if not is_batch_line(m))
            return waiting + loading + len(self._prepared) - len(self._prepared_lines())

    def holding(self) -> bool:
        """Whether the consumer holds any request."""
        with self._lock:
            return bool(self._waiting or self._loading or self._prepared or self._running or self._written)

    def empty(self) -> tuple[list[Message], list[Message]]:
        """The consumer stops (its `stopping` is set): the messages of the batches on the device and being written,
        and every other it holds; what waits or is prepared is forgotten, and every waiting thread woken."""
        with self._lock:
            running = [i.message for i in self._running + self._written if i.message is not None]
            others = [r for _, r in self._waiting.values()] + [i.message for i in self._prepared if i.message]
            self._waiting.clear()
            self._unheld.clear()  # handed back: not to be named as held after the consumer leaves
            self._prepared = []
            self._wake(self._to_collect, self._to_run, self._to_take_lines)
        return running, others

    @staticmethod
    def _wake(*conditions: threading.Condition) -> None:
        """Wake every thread waiting on these conditions (called holding the lock)."""
        for condition in conditions:
            condition.notify_all()
