"""The pipeline's inference consumer: work-conserving and double-buffered, so the device never waits on Redis.

On a Redis broker the **intake** thread takes interactive requests straight from their queue, as many as the
consumer has room for (the prefetch) per round trip (`stoker.adapters.redis_intake.RedisIntake`); on RabbitMQ
celery-batches hands each message over the moment it arrives (`tasks.inference.Feed`, flush_every=1: no polling
tick). Three threads do the rest:

- the **collector** takes what waits into the next batch (arrival order; size and token budget; deadlines dropped)
  and loads its requests, one pipelined round trip per top-up, while the device runs the batch before;
- the **device** thread starts the prepared batch the moment the previous one returns (with `STOKER_MAX_WAIT_MS`,
  once its first request has waited that long, or it is full) and does nothing but run the model;
- the **writer** writes each finished batch (results, stamps, counters, pipelined), ends its spans, logs its jobs
  and acks its messages; a batch that broke outside the model fails its jobs at once (never silently acked). A
  batch still running `STAMP_AFTER_S` after it started has its jobs' start stamped meanwhile (the errands thread);
  a shorter one's start is written with its results.

At most one batch is prepared ahead and one written behind: memory stays bounded by the prefetch. The consumer
beats while it lives and names the jobs it holds as they come and go, so when it dies the reaper sends them again
within seconds: the collector names the jobs that arrived in the round trip that loads their batch, or on their own
while no batch can take them (the device busy, the next batch full).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from queue import Empty, Queue

from stoker.core.batching import BatchPolicy, Plan, Waiting, start_at, top_up
from stoker.core.pacing import Pace
from stoker.runtime.batches import (
    BatchItem,
    RanBatch,
    expire,
    fail_batch,
    load_batch,
    run_batch,
    settle,
    write_batch,
)
from stoker.runtime.context import WorkerContext
from stoker.runtime.seams import Intake, LineSource, Message
from stoker.runtime.watchdog import BatchWatchdog

log = logging.getLogger(__name__)


#: How soon an empty batch-line queue is looked at again while lines come (it backs off while none do).
LINE_POLL_S = 0.02
#: How long after the last interactive request batch lines still run in small batches (`Feeder._line_bound`).
INTERACTIVE_QUIET_S = 2.0
#: How long a batch runs before its jobs' `infer_start` stamps are written on their own (a shorter one's are written
#: with its results: one round trip less per batch on a fast device).
STAMP_AFTER_S = 0.05
#: How long the intake waits for a message before it looks again (and writes the acks gathered meanwhile).
INTAKE_BLOCK_S = 1.0
#: Cancelled job ids kept in memory before the oldest are forgotten, and for how long at least.
CANCELLED_KEPT = 4096
CANCELLED_TTL_S = 600.0


class Feeder:
    """Collects arriving inference messages into batches and keeps the device running them back to back."""

    def __init__(
        self,
        ctx: WorkerContext,
        policy: BatchPolicy,
        watchdog: BatchWatchdog,
        beat_s: float = 1.0,
        lines: LineSource | None = None,
        interactive_quiet_s: float = INTERACTIVE_QUIET_S,
        intake: Intake | None = None,
    ) -> None:
        self.ctx = ctx
        self.policy = policy
        self.watchdog = watchdog
        self.beat_s = beat_s
        #: Where batch lines are taken from (their own queue), into room interactive requests leave.
        self.lines = lines
        #: Where interactive requests are taken from, up to `prefetch` held at once (None: handed over by Celery).
        self.intake = intake
        self.prefetch = ctx.settings.infer_prefetch
        self.line_batch = min(ctx.settings.line_batch_size, policy.max_batch_size)
        self._interactive_at: float | None = None  # when the last interactive request arrived
        self.interactive_quiet_s = interactive_quiet_s
        #: How often an empty line queue is looked at: soon while lines come, slower and slower while none do.
        self.line_pace = Pace(LINE_POLL_S, ctx.settings.idle_max_wait_s)
        #: The heartbeat's pace: every `beat_s` while the consumer holds jobs, slower while it holds none.
        self.pace = Pace(beat_s, ctx.settings.idle_max_wait_s)
        self._beat_now = threading.Event()
        self._arrived = False  # messages came since the last beat
        self.consumer = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        # One lock over the state below, and a condition per thread that waits on it, so that each change wakes
        # only the threads it concerns: an arrival (once per message) wakes the collector, not the device and
        # line threads as well. A wake-up costs a futex call and a GIL hand-off to a thread that finds nothing to
        # do; with a condition shared by all, arrivals' wake-ups were the inference worker's largest own cost.
        self._lock = threading.RLock()
        self._to_collect = threading.Condition(self._lock)  # arrivals, room in the prepared batch
        self._to_run = threading.Condition(self._lock)  # a prepared batch for the device
        self._to_take_lines = threading.Condition(self._lock)  # room for batch lines
        self._waiting: dict[str, tuple[Waiting, Message]] = {}
        #: Jobs that arrived and are not yet named as held: the collector names them (`_collect`).
        self._unheld: list[str] = []
        self._loading: list[Message] = []
        self._prepared: list[BatchItem] = []
        self._running: list[BatchItem] = []
        self._writing: Queue[tuple[RanBatch | None, list[BatchItem], BaseException | None]] = Queue(maxsize=1)
        #: Small writes the device thread must not wait for (`_run_errands`), under a lock of their own: the batch on
        #: the device (its items, when it started, its turn), whose start is stamped if it runs long; jobs that
        #: expired or were cancelled before it started (to end or let go of, when it started).
        self._errand = threading.Condition()
        self._on_device: tuple[list[BatchItem], float, DeviceTurn] | None = None
        self._unready: list[tuple[list[BatchItem], list[BatchItem], float]] = []
        #: The errands thread sleeps with nothing to wake for: the next batch wakes it (no other does).
        self._errands_idle = False
        #: Jobs cancelled anywhere lately (id → when heard), from the store's announcements.
        self._cancelled: dict[str, float] = {}
        self._written: list[BatchItem] = []
        self._last_end: float | None = None
        self._work_at_end = False
        self._stopping = threading.Event()

    # -- arrivals (celery's consumer thread) ------------------------------------------------------------------
    def add(self, requests: Sequence[Message]) -> None:
        """Messages that just arrived: they wait for the collector, which names them as held at once (with their
        batch's load when it can take them now: no round trip of their own on this thread)."""
        self._arrived = True
        try:
            if self.pace.slowed:  # its last beat promised life for longer than a death may go unnoticed now
                self._beat_at_pace(active=True)
                self._beat_now.set()
        except Exception as exc:  # the store is away: the heartbeat's next round tries again
            log.warning("could not beat: %s", exc)
        now = time.time()
        with self._lock:
            if self._stopping.is_set():  # handed back below: `give_back` has emptied what waits already
                _hand_back_messages(requests)
                return
            for request in requests:
                self._waiting[request.id] = (as_waiting(request, now), request)
                self._unheld.append(_job_of(request))
            if not all(_is_batch_line(r) for r in requests):
                self._interactive_at = now
            # Neither the device's batch nor the room for lines grows with an arrival: the collector alone.
            self._to_collect.notify()

    def start(self) -> None:
        """Start the collector, device, writer and heartbeat threads (and the batch lines' taker, with lines)."""
        loops = [
            ("collector", self._collect),
            ("device", self._run),
            ("writer", self._write),
            ("errands", self._run_errands),
            ("heartbeat", self._beat),
            ("cancellations", self._hear_cancellations),
        ]
        if self.lines is not None:
            loops.append(("lines", self._take_lines))
        if self.intake is not None:
            loops.append(("intake", self._take_arrivals))
        yield_to = getattr(self.ctx.predictor, "yield_to", None)
        if callable(yield_to):  # a backend whose calls can stop between decoding steps for waiting requests
            yield_to(self._interactive_waiting, self.policy.max_batch_size)
        for name, loop in loops:
            threading.Thread(target=_forever(loop, self._stopping), name=f"infer-{name}", daemon=True).start()

    def give_back(self, wedged: bool = False) -> None:
        """Before this process goes: every message it holds goes back to the queue (a job whose batch finishes
        meanwhile is skipped when it comes back). `wedged`: the batch on the device is acked instead, since the
        watchdog already ended its jobs."""
        self._stopping.set()
        self._beat_now.set()
        with self._errand:
            self._errand.notify()
        with self._lock:
            running = [i.message for i in self._running + self._written if i.message is not None]
            others = [r for _, r in self._waiting.values()] + [i.message for i in self._prepared if i.message]
            self._waiting.clear()
            self._unheld.clear()  # handed back below: not to be named as held after the consumer leaves
            self._prepared = []
            self._wake(self._to_collect, self._to_run, self._to_take_lines)
        for message in running:
            if wedged:
                message.acknowledge()
            else:
                message.reject(requeue=True)
        for message in others:
            message.reject(requeue=True)
        if self.lines is not None:
            self.lines.close()
        if self.intake is not None:
            self.intake.close()
        self.ctx.store.consumers.leave(self.consumer)

    # -- the collector ------------------------------------------------------------------------------------------
    def _collect(self) -> None:
        with self._lock:
            plan = self._plan_top_up()
            # Until something fits (not full, within the token budget) or arrivals are to be named as held
            while plan is None and not self._unheld:
                if self._stopping.is_set():
                    return
                self._to_collect.wait()
                plan = self._plan_top_up()
            take = [self._waiting.pop(w.key)[1] for w in plan.run] if plan else []
            expired = [self._waiting.pop(w.key)[1] for w in plan.expired] if plan else []
            self._loading = take
            gone = {_job_of(m) for m in expired}
            unheld, self._unheld = [j for j in self._unheld if j not in gone], []
        if plan is None:  # no batch can take them now: named as held on their own, loaded later
            self._hold(unheld)
            return
        for message in expired:
            expire(self.ctx, _job_of(message), time.time())
            self._done_with(message)
        arrived = {w.key: w.arrived for w in plan.run}
        items = [replace(item, arrived=arrived[item.message.id]) for item in self._load(take, unheld) if item.message]
        with self._lock:
            self._prepared.extend(items)
            self._loading = []
            self._wake(self._to_run, self._to_take_lines)

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

    def _load(self, messages: list[Message], unheld: list[str]) -> list[BatchItem]:
        """The messages' jobs, loaded in one round trip that also names `unheld` as held; messages with nothing
        left to do are done with."""
        by_job = {_job_of(m): m for m in messages}
        consumers = self.ctx.store.consumers
        also = [partial(consumers.queue_hold, consumer=self.consumer, job_ids=unheld)] if unheld else []
        try:
            loaded = {item.job_id: item for item in load_batch(self.ctx, list(by_job), also)}
        except Exception:
            log.exception("could not load %d inference requests; handing them back", len(messages))
            for message in messages:
                message.reject(requeue=True)
            with self._lock:  # the ones still waiting are named by the next round
                self._unheld.extend(j for j in unheld if j not in by_job)
            time.sleep(1.0)  # the store is away: do not spin on it
            return []
        for message in messages:
            if by_job.get(_job_of(message)) is not message or _job_of(message) not in loaded:
                self._done_with(message)  # a duplicate, or a job that ended or expired
        return [replace(item, message=by_job[job_id]) for job_id, item in loaded.items()]

    # -- the intake -------------------------------------------------------------------------------------------------
    def _take_arrivals(self) -> None:
        """Interactive requests, as many as wait and the prefetch has room for, in one round trip; while none
        waits, the first to come (within INTAKE_BLOCK_S, then again)."""
        assert self.intake is not None
        held = self.intake.wait_below(self.prefetch, INTAKE_BLOCK_S)
        if held >= self.prefetch or self._stopping.is_set():
            return
        intake = self.intake
        self._bring_in("inference requests", lambda: intake.take(self.prefetch - held, INTAKE_BLOCK_S))

    def _bring_in(self, what: str, take: Callable[[], Sequence[Message]]) -> Sequence[Message]:
        """What `take` brings from the broker, handed over as arrivals; nothing while the broker is away (after a
        pause, so that a thread does not spin on it)."""
        try:
            taken = take()
        except Exception as exc:  # the broker is away: look again shortly
            log.warning("cannot take %s: %s", what, exc)
            self._stopping.wait(1.0)
            return []
        if taken:
            self.add(taken)
        return taken

    # -- batch lines --------------------------------------------------------------------------------------------
    def _take_lines(self) -> None:
        """Batch lines are taken from their own queue only into room interactive requests leave: none while an
        interactive request waits, and never more than a batch of them (`_line_bound`) held before the device
        takes them. So the prefetch an interactive request reaches the consumer through is never full of lines,
        and the device always has a batch of lines ready when no interactive request waits."""
        assert self.lines is not None
        with self._lock:
            room = self._room_for_lines()
            while not room and not self._stopping.is_set():
                self._to_take_lines.wait()
                room = self._room_for_lines()
        if self._stopping.is_set():
            return
        lines = self.lines
        taken = self._bring_in("batch lines", lambda: _take(lines, room))
        self._stopping.wait(self.line_pace.next_wait(active=bool(taken)) if len(taken) < room else 0)

    def _room_for_lines(self) -> int:
        """How many more batch lines the consumer may hold now (called holding the lock)."""
        waiting = [w for w, _ in self._waiting.values()]
        if any(not w.batch for w in waiting):
            return 0
        loading = sum(1 for m in self._loading if _is_batch_line(m))
        return max(self._line_bound(time.time()) - len(waiting) - len(self._prepared_lines()) - loading, 0)

    def _prepared_lines(self) -> list[BatchItem]:
        """The batch lines of the prepared batch (called holding the lock)."""
        return [i for i in self._prepared if i.message is not None and _is_batch_line(i.message)]

    def _line_bound(self, now: float) -> int:
        """Lines in a batch: `line_batch` while interactive requests come (an interactive request that arrives
        waits at most for the batch on the device, so its lines are few), a full batch while none has come for
        `interactive_quiet_s` (the device is the lines' alone: as many as it takes)."""
        recent = self._interactive_at is not None and now - self._interactive_at < self.interactive_quiet_s
        return self.line_batch if recent else self.policy.max_batch_size

    # -- the device ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        items, gap, turn = self._next_batch()
        if not items:
            return
        going_on: list[BatchItem] = []
        try:
            ran: RanBatch | None
            ran, going_on = settle(run_batch(self.ctx, items, self.watchdog, gap))
            failure: BaseException | None = None
        except Exception as exc:  # not the model's per-item failures (those are outcomes): a broken batch
            ran, failure = None, exc
        turn.end()
        with self._lock:
            self._last_end = time.time()
            if going_on:  # answers under way go first in the next batch, beside the requests that waited
                self._lines_make_way()
                self._prepared = going_on + self._prepared
            self._work_at_end = bool(self._waiting or self._loading or self._prepared)
            if going_on:  # the prepared batch and the waiting lines changed
                self._wake(self._to_collect, self._to_take_lines)
        if ran is None or ran.items:
            written = ran.items if ran is not None else items
            self._writing.put((ran, written, failure))  # waits only while the batch before is still being written
        with self._lock:
            self._running = []

    def _next_batch(self) -> tuple[list[BatchItem], float | None, DeviceTurn]:
        """Wait for a prepared batch and its start time; take it. The idle gap counts only if work waited."""
        with self._lock:
            while not self._stopping.is_set():
                now = time.time()
                at = start_at([i.arrived for i in self._prepared], now, self.policy)
                if at is not None and at <= now:
                    break
                self._to_run.wait(None if at is None else at - now)
            else:
                return [], None, DeviceTurn()
            size = self.policy.max_batch_size
            prepared, self._prepared = self._prepared[:size], self._prepared[size:]
            # At the last moment, in memory: a job cancelled while it waited for the device never reaches it.
            dropped = [i for i in prepared if i.job_id in self._cancelled]
            wanted = [i for i in prepared if i not in dropped]
            items = [i for i in wanted if not i.pending.deadline or i.pending.deadline > now]
            self._running = items
            gap = now - self._last_end if self._last_end is not None and self._work_at_end else None
            self._wake(self._to_collect, self._to_take_lines)  # room to prepare the next one
        late = [i for i in wanted if i not in items]  # their deadline passed while they waited for the device
        turn = DeviceTurn()
        with self._errand:
            self._on_device = (items, now, turn) if items else None
            if late or dropped:
                self._unready.append((late, dropped, now))
            if late or dropped or (items and self._errands_idle):
                self._errand.notify()
        return items, gap, turn

    # -- the writer ---------------------------------------------------------------------------------------------
    def _write(self) -> None:
        ran, items, failure = self._writing.get()
        with self._lock:
            self._written = items
        try:
            if ran is not None:
                write_batch(self.ctx, ran, self.consumer)  # lets go of the batch's jobs as it writes them
            else:
                fail_batch(self.ctx, items, failure or RuntimeError("unknown"))
        except Exception:
            log.exception("batch of %d could not be written; its messages go back to the queue", len(items))
            _hand_back(items)
        else:
            for item in items:
                if item.message is not None:
                    item.message.acknowledge()
            if ran is None:
                self._release([i.job_id for i in items])
        with self._lock:
            self._written = []

    # -- errands ----------------------------------------------------------------------------------------------
    def _run_errands(self) -> None:
        """End the jobs whose deadline passed before the device was free (never computed), and mark those whose
        batch is still running STAMP_AFTER_S after it started (`ts:infer_start`: the reaper leaves a job on the
        device alone, and readers count the device busy). A batch that ends sooner is stamped with its results.

        Woken by a batch only when it sleeps with nothing to wake for, or for jobs to end: while batches follow
        each other, it wakes when the one on the device is due a stamp, at most every STAMP_AFTER_S, not once
        per batch (a wake-up per batch cost a fast device's consumer two thread switches per job)."""
        with self._errand:
            while True:
                if self._stopping.is_set():
                    return
                unready, self._unready = self._unready, []
                due = self._stamp_due(time.time())
                if unready or due is not None:
                    break
                on_device = self._on_device
                self._errands_idle = on_device is None
                self._errand.wait(None if on_device is None else on_device[1] + STAMP_AFTER_S - time.time())
                self._errands_idle = False
        for late, dropped, at in unready:
            for item in late:
                expire(self.ctx, item.job_id, at)
                if item.message is not None:
                    self._done_with(item.message)
            for item in dropped:  # cancelled: already ended, nothing to write
                if item.message is not None:
                    self._done_with(item.message)
        if due is not None:
            self._stamp_start(*due)

    def _stamp_due(self, now: float) -> tuple[list[BatchItem], float, DeviceTurn] | None:
        """The batch on the device, once it is due its start stamp (called holding the errands' lock): taken, so
        it is stamped once. One that ended is forgotten: its results carry its stamps."""
        on_device = self._on_device
        if on_device is not None and on_device[2].ended.is_set():
            self._on_device = on_device = None
        if on_device is None or on_device[1] + STAMP_AFTER_S > now:
            return None
        self._on_device = None
        return on_device

    def _stamp_start(self, started: list[BatchItem], at: float, turn: DeviceTurn) -> None:
        """The start of a batch still on the device, in one round trip (unless it ended meanwhile: then its results
        carry the stamps)."""
        with turn.writing:
            if turn.ended.is_set():
                return
            store = self.ctx.store
            first = [i.job_id for i in started if not i.request.generated]  # an answer that goes on started before
            device_started = partial(store.stats.queue_device_started, at=at)
            store.jobs.stamp_many(first, "infer_start", at, also=[device_started])

    # -- cancellations -----------------------------------------------------------------------------------------
    def _hear_cancellations(self) -> None:
        """Hear every cancelled job as it is announced, so the device thread can drop one it holds without asking
        the store (no round trip before a batch). A message missed while the store is away costs only compute:
        the batch runs and its answer is not written."""
        try:
            with self.ctx.store.jobs.cancellations() as feed:
                while not self._stopping.is_set():
                    message = feed.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None:
                        self._heard(message["data"].decode(), time.time())
        except Exception as exc:  # the store is away: listen again shortly
            log.warning("cannot hear cancellations: %s", exc)
            self._stopping.wait(1.0)

    def _heard(self, job_id: str, now: float) -> None:
        with self._lock:
            self._cancelled[job_id] = now
            if len(self._cancelled) > CANCELLED_KEPT:  # forget those heard long ago: long gone from any batch
                self._cancelled = {j: t for j, t in self._cancelled.items() if now - t < CANCELLED_TTL_S}

    # -- the heartbeat ------------------------------------------------------------------------------------------
    def _beat(self) -> None:
        """Every `beat_s` while jobs come, slower and slower while none comes: this consumer lives (the jobs
        it holds are written as they come and go). Each beat lasts three of its waits, so it never lapses while the
        consumer lives; the first jobs after a quiet spell beat at once (`add`), back at `beat_s`."""
        try:
            arrived, self._arrived = self._arrived, False
            wait = self._beat_at_pace(active=arrived or self._holding())
        except Exception as exc:  # the store is away: the next beat tries again
            log.warning("heartbeat failed: %s", exc)
            wait = self.beat_s
        self._beat_now.wait(wait)
        self._beat_now.clear()

    def _beat_at_pace(self, active: bool) -> float:
        """Beat for three of the next waits; the next wait."""
        wait = self.pace.next_wait(active)
        self.ctx.store.consumers.beat(self.consumer, ttl_s=wait * 3)
        return wait

    def _interactive_waiting(self) -> int:
        """Interactive requests waiting for the device (arrived, loading or prepared): what a running call may
        stop for, between its decoding steps."""
        with self._lock:
            waiting = sum(1 for w, _ in self._waiting.values() if not w.batch)
            loading = sum(1 for m in self._loading if not _is_batch_line(m))
            return waiting + loading + len(self._prepared) - len(self._prepared_lines())

    @staticmethod
    def _wake(*conditions: threading.Condition) -> None:
        """Wake every thread waiting on these conditions (called holding the lock)."""
        for condition in conditions:
            condition.notify_all()

    def _holding(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._loading or self._prepared or self._running or self._written)

    def _hold(self, job_ids: list[str]) -> None:
        try:
            self.ctx.store.consumers.hold(self.consumer, job_ids)
        except Exception as exc:  # the store is away: the broker's own redelivery still covers these
            log.warning("could not record held jobs: %s", exc)

    def _release(self, job_ids: list[str]) -> None:
        try:
            self.ctx.store.consumers.release(self.consumer, job_ids)
        except Exception as exc:  # a stale entry only makes the reaper look at an ended job, and forget it
            log.warning("could not release held jobs: %s", exc)

    def _done_with(self, message: Message) -> None:
        """A message with nothing left to do: counted as drained, acked, no longer held."""
        try:
            self.ctx.store.stats.count_drained("infer")
        finally:
            message.acknowledge()
            self._release([_job_of(message)])


class DeviceTurn:
    """One batch's time on the device, as the errands thread sees it: whether it has ended, and the lock its start
    stamps are written under. The device thread ends the turn under that lock, so a stamp begun before the end is
    written before the batch goes to the writer (whose results would otherwise be overtaken by it)."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.writing = threading.Lock()

    def end(self) -> None:
        """The batch is off the device (waits for a start stamp being written)."""
        with self.writing:
            self.ended.set()


def _forever(step: Callable[[], None], stopping: threading.Event) -> Callable[[], None]:
    """A thread's body: the step again and again until the feeder stops."""

    def loop() -> None:
        while not stopping.is_set():
            try:
                step()
            except Exception:  # a thread of the consumer must outlive any one failure
                log.exception("inference consumer: %s failed", threading.current_thread().name)
                time.sleep(0.5)

    return loop


def _take(lines: LineSource, limit: int) -> list[Message]:
    """Up to `limit` batch lines waiting in their queue."""
    taken: list[Message] = []
    while len(taken) < limit:
        message = lines.take()
        if message is None:
            break
        taken.append(message)
    return taken


def take_arrived(buffer: Queue[Message], limit: int) -> list[Message]:
    """Up to `limit` messages a receiver has buffered, without waiting."""
    items: list[Message] = []
    while len(items) < limit:
        try:
            items.append(buffer.get_nowait())
        except Empty:
            break
    return items


def as_waiting(request: Message, now: float) -> Waiting:
    """What the policy needs to know of a request: its size and deadline travel in the message."""
    kwargs = request.kwargs or {}
    tokens, deadline = kwargs.get("prompt_tokens"), kwargs.get("deadline")
    return Waiting(request.id, int(tokens or 0), now, float(deadline) if deadline else None, _is_batch_line(request))


def _is_batch_line(request: Message) -> bool:
    return (request.kwargs or {}).get("job_class") == "batch"


def _job_of(request: Message) -> str:
    return str((request.kwargs or {}).get("job_id"))


def _hand_back(items: Sequence[BatchItem]) -> None:
    _hand_back_messages([item.message for item in items if item.message is not None])


def _hand_back_messages(messages: Sequence[Message]) -> None:
    for message in messages:
        message.reject(requeue=True)
