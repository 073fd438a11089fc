"""The inference consumer over an in-memory store, a fake predictor and fake messages: no Redis, no Celery.

What is real is the feeder itself (its collector, device, writer and errand threads), the batching policy, and how
batches are loaded, run and written; the fakes stand at stoker's own seams (the store's repositories, the
`Predictor` hook contract, the `Message` a receiver hands over, the `Outbox`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from stoker.adapters.store.jobs import Pending
from stoker.core.batching import BatchPolicy
from stoker.core.jobs import Job
from stoker.core.model import Continued, ModelRequest, Prediction
from stoker.runtime.batches import BatchItem
from stoker.runtime.context import WorkerContext
from stoker.runtime.feeder import STAMP_AFTER_S, Feeder
from stoker.runtime.watchdog import BatchWatchdog
from stoker.settings import WorkerSettings
from tests.fakes.outbox import NoOutbox
from tests.fakes.store import MemoryStore
from workers.procs import wait_for

WAIT_S = 10.0


class GatedPredictor:
    """A predictor that answers each prompt with its own text; with `gated`, each call waits until let through, so
    a test decides how long a batch stays on the device. A prompt of "bad" breaks any call it is in."""

    name = "fake"
    mixes_sampling = True

    def __init__(self, gated: bool = False, stepped: bool = False) -> None:
        self.gated = gated
        self.calls: list[list[str]] = []
        self.on_device = threading.Event()
        self.gate = threading.Event()
        #: With `stepped`, each batch waits for a step of its own (`release`), so a test runs them one at a time.
        self.stepped = stepped
        self._steps = threading.Semaphore(0)

    def release(self, batches: int = 1) -> None:
        """Let that many more batches through (stepped)."""
        self._steps.release(batches)

    def setup(self, device: str) -> None:
        pass

    def batch(self, requests: Sequence[ModelRequest]) -> list[str]:
        return [r.messages[0]["content"] for r in requests]

    def predict(self, batch: list[str]) -> list[str]:
        self.calls.append(batch)
        self.on_device.set()
        if self.gated and not self.gate.wait(WAIT_S):
            raise TimeoutError("the test never let the batch through")
        if self.stepped and not self._steps.acquire(timeout=WAIT_S):
            raise TimeoutError("the test never let the batch through")
        if "bad" in batch:
            raise RuntimeError("the model broke on this batch")
        return batch

    def unbatch(self, output: list[str]) -> list[Prediction]:
        return [Prediction(text=f"answer to {text}", prompt_tokens=1, completion_tokens=1) for text in output]


class YieldingPredictor(GatedPredictor):
    """A predictor whose calls yield after every token, as the local model's do for a waiting request: a prompt
    `name:n` needs n calls; until then each call gives it one more token and it comes back `Continued`."""

    def __init__(self) -> None:
        super().__init__(stepped=True)
        self.waiting: Any = None
        self.seen_waiting: list[int] = []
        self.cancelled: Any = None
        #: Per call: the jobs its requests are of, and those of them the consumer said were cancelled once it ran.
        self.jobs: list[list[str]] = []
        self.seen_cancelled: list[list[str]] = []

    def yield_to(self, waiting: Any, max_rows: int, cancelled: Any = None) -> None:
        self.waiting, self.cancelled = waiting, cancelled

    def batch(self, requests: Sequence[ModelRequest]) -> list[Any]:
        self.jobs.append([r.job_id for r in requests])
        return [(r.messages[0]["content"], r.generated) for r in requests]

    def predict(self, batch: list[Any]) -> list[Any]:
        self.calls.append([name for name, _ in batch])
        self.on_device.set()
        if not self._steps.acquire(timeout=WAIT_S):
            raise TimeoutError("the test never let the batch through")
        self.seen_waiting.append(self.waiting())
        self.seen_cancelled.append([job for job in self.jobs[-1] if self.cancelled(job)])
        return batch

    # A yielding call's outcomes may go on (`Continued`); a gated one's never do.
    def unbatch(self, output: list[Any]) -> list[Prediction | Continued]:  # type: ignore[override]
        outcomes: list[Prediction | Continued] = []
        for name, generated in output:
            tokens = (*generated, len(generated))
            needed = int(name.split(":")[1])
            done = len(tokens) == needed
            text = f"{name} in {len(tokens)} tokens"
            outcomes.append(Prediction(text, 1, len(tokens)) if done else Continued(tokens, sent=text))
        return outcomes


class FakeMessage:
    """A broker message as Celery's request behaves: the first ack or reject settles it, later ones do nothing."""

    def __init__(self, job_id: str, deadline: float | None = None) -> None:
        self.id = f"task-{job_id}"
        self.kwargs = {"job_id": job_id, "prompt_tokens": 1, "deadline": deadline}
        self.settled: str | None = None
        self.times_settled = 0

    def acknowledge(self) -> None:
        self._settle("acked")

    def reject(self, requeue: bool = False) -> None:
        self._settle("requeued" if requeue else "rejected")

    def _settle(self, how: str) -> None:
        self.times_settled += 1
        if self.settled is None:
            self.settled = how


class MemoryLines:
    """Batch lines waiting in their queue: taken one at a time, and how many were taken."""

    def __init__(self) -> None:
        self.waiting: list[FakeMessage] = []
        self.messages: list[FakeMessage] = []
        self.closed = False
        self._lock = threading.Lock()

    def put(self, *job_ids: str) -> None:
        """Lines published to the queue."""
        published = [_line(job_id) for job_id in job_ids]
        with self._lock:
            self.waiting += published
            self.messages += published

    def take(self) -> FakeMessage | None:
        with self._lock:
            return self.waiting.pop(0) if self.waiting else None

    @property
    def taken(self) -> int:
        with self._lock:
            return len(self.messages) - len(self.waiting)

    def close(self) -> None:
        self.closed = True


class MemoryIntake:
    """Interactive requests waiting in their queue, taken as many at once as asked for: how many were held (taken
    and not settled) after each take, and whether the consumer closed it."""

    def __init__(self) -> None:
        self.waiting: list[FakeMessage] = []
        self.taken: list[FakeMessage] = []
        self.held_after_takes: list[int] = []
        self.closed = False
        self._changed = threading.Condition()

    def put(self, *messages: FakeMessage) -> None:
        with self._changed:
            self.waiting += messages
            self._changed.notify_all()

    def held(self) -> int:
        return sum(1 for m in self.taken if m.settled is None)

    def wait_below(self, most: int, timeout_s: float) -> int:
        with self._changed:
            self._changed.wait_for(lambda: self.held() < most, timeout_s)
            return self.held()

    def take(self, most: int, block_s: float) -> list[FakeMessage]:
        with self._changed:
            self._changed.wait_for(lambda: bool(self.waiting), block_s)
            taken, self.waiting = self.waiting[:most], self.waiting[most:]
            self.taken += taken
            self.held_after_takes.append(self.held())
            return taken

    def settled(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        self.closed = True


class IntakeMessage(FakeMessage):
    """A message the intake hands over: settling it makes room in the intake."""

    def __init__(self, intake: MemoryIntake, job_id: str) -> None:
        super().__init__(job_id)
        self.intake = intake

    def _settle(self, how: str) -> None:
        super()._settle(how)
        self.intake.settled()


def _line(job_id: str) -> FakeMessage:
    message = FakeMessage(job_id)
    message.kwargs["job_class"] = "batch"
    return message


class Consumer:
    """A started feeder over the in-memory store, and what it was built from."""

    def __init__(
        self,
        predictor: GatedPredictor,
        max_batch_size: int,
        lines: MemoryLines | None = None,
        line_batch: int = 4,
        intake: MemoryIntake | None = None,
    ) -> None:
        self.store = MemoryStore.empty()
        self.predictor = predictor
        self.lines = lines
        settings = WorkerSettings(line_batch_size=line_batch, max_batch_size=max_batch_size, prefetch_batches=2)
        ctx = WorkerContext(settings, NoOutbox(), store=self.store, predictor=predictor)
        policy = BatchPolicy(max_batch_size=max_batch_size, max_batch_tokens=10_000, max_wait_s=0.0)
        watchdog = BatchWatchdog(60.0, 60.0, on_overdue=lambda _: None, on_wedged=lambda _: None)
        self.feeder = Feeder(ctx, policy, watchdog, lines=lines, interactive_quiet_s=60.0, intake=intake)
        self.feeder.start()

    def arrive(self, *job_ids: str, deadline: float | None = None) -> list[FakeMessage]:
        """Jobs handed over by preprocessing, and their messages arriving at the consumer."""
        for job_id in job_ids:
            self.store.jobs.pending[job_id] = _pending(job_id, deadline)
        messages = [FakeMessage(job_id, deadline) for job_id in job_ids]
        self.feeder.add(messages)
        return messages

    def until(self, check: Any, what: str) -> None:
        wait_for(check, WAIT_S, what, [])


def _pending(job_id: str, deadline: float | None) -> Pending:
    job = Job(id=job_id, status="inferring", prompt=job_id, inputs=[])
    request = ModelRequest(prompt_ids=[1], messages=[{"role": "user", "content": job_id}])
    return Pending(job=job, request=request, preprocessed=time.time(), deadline=deadline, trace=None)


@pytest.fixture
def consumers() -> Iterator[list[Consumer]]:
    """Consumers a test starts; each is stopped afterwards the way a worker stops it."""
    started: list[Consumer] = []
    yield started
    for consumer in started:
        consumer.predictor.gate.set()
        consumer.predictor.release(100)
        consumer.feeder.give_back()


def _consumer(
    consumers: list[Consumer],
    predictor: GatedPredictor,
    max_batch_size: int,
    lines: MemoryLines | None = None,
    line_batch: int = 4,
    intake: MemoryIntake | None = None,
) -> Consumer:
    consumer = Consumer(predictor, max_batch_size, lines, line_batch, intake)
    consumers.append(consumer)
    return consumer


def test_the_next_batch_is_loaded_while_one_runs(consumers: list[Consumer]) -> None:
    c = _consumer(consumers, GatedPredictor(gated=True), max_batch_size=2)
    first = c.arrive("a", "b")
    c.until(c.predictor.on_device.is_set, "the first batch on the device")
    second = c.arrive("c", "d")
    c.until(lambda: ["c", "d"] in c.store.jobs.loads, "the second batch loaded")
    assert c.predictor.calls == [["a", "b"]]  # loaded while the first batch is still on the device
    assert not c.store.jobs.ended
    c.predictor.gate.set()
    c.until(lambda: len(c.store.jobs.ended) == 4, "every job ended")
    assert c.predictor.calls == [["a", "b"], ["c", "d"]]
    assert {j: e.result.text for j, e in c.store.jobs.ended.items() if e.result} == {
        j: f"answer to {j}" for j in "abcd"
    }
    assert [m.settled for m in first + second] == ["acked"] * 4
    c.until(lambda: not c.store.consumers.held, "every job released")


def test_arrivals_are_named_held_in_their_batch_s_load_or_alone_while_no_batch_can_take_them(
    consumers: list[Consumer],
) -> None:
    c = _consumer(consumers, GatedPredictor(gated=True), max_batch_size=1)
    c.arrive("a")
    c.until(c.predictor.on_device.is_set, "the first batch on the device")
    c.arrive("b")
    c.until(lambda: ["b"] in c.store.jobs.loads, "the next batch loaded")
    c.arrive("c")  # the device busy with a, b prepared: nothing can take c yet
    c.until(lambda: "c" in c.store.consumers.held, "c named as held")
    assert ["c"] not in c.store.jobs.loads
    assert c.store.consumers.hold_writes == [(["a"], True), (["b"], True), (["c"], False)]
    c.predictor.gate.set()
    c.until(lambda: len(c.store.jobs.ended) == 3, "every job ended")
    c.until(lambda: not c.store.consumers.held, "every job released")


def test_a_batch_s_start_is_stamped_while_it_runs_only_once_it_has_run_a_while(consumers: list[Consumer]) -> None:
    c = _consumer(consumers, GatedPredictor(gated=True), max_batch_size=1)
    c.arrive("long")
    c.until(lambda: "long" in c.store.jobs.started, "the running batch's start stamped")
    assert c.store.jobs.stamped_at["long"] - c.store.jobs.started["long"] >= STAMP_AFTER_S  # once it ran that long
    assert "long" not in c.store.jobs.ended
    c.predictor.gate.set()  # from now on every batch returns at once
    c.arrive("short")
    c.until(lambda: "short" in c.store.jobs.ended, "the short batch written")
    assert "short" not in c.store.jobs.started  # its start came with its results
    assert c.store.jobs.ended["short"].stamps["infer_start"] <= c.store.jobs.ended["short"].stamps["infer_end"]


def test_jobs_whose_deadline_passed_never_reach_the_model(consumers: list[Consumer]) -> None:
    c = _consumer(consumers, GatedPredictor(gated=True), max_batch_size=1)
    running = c.arrive("running")
    c.until(c.predictor.on_device.is_set, "a batch on the device")
    late_on_arrival = c.arrive("late", deadline=time.time() - 1)
    soon = time.time() + 0.5
    waits_for_device = c.arrive("soon", deadline=soon)
    c.until(lambda: ["soon"] in c.store.jobs.loads, "the next batch loaded before its deadline")
    c.until(lambda: time.time() > soon, "its deadline passed while the device was busy")
    c.predictor.gate.set()
    c.until(lambda: len(c.store.jobs.ended) == 3, "every job ended")
    assert c.predictor.calls == [["running"]]
    for job_id in ("late", "soon"):
        error = c.store.jobs.ended[job_id].error
        assert error is not None
        assert (error.code, error.stage) == ("deadline_exceeded", "infer_queue")
    assert c.store.jobs.ended["running"].status == "succeeded"
    assert [m.settled for m in running + late_on_arrival + waits_for_device] == ["acked"] * 3
    assert c.store.stats.drained() == {"infer": 2}  # the two dropped messages are done with, as drained


def test_a_failing_batch_is_retried_one_by_one_so_only_the_bad_item_fails(consumers: list[Consumer]) -> None:
    c = _consumer(consumers, GatedPredictor(gated=True), max_batch_size=3)
    c.arrive("first")
    c.until(c.predictor.on_device.is_set, "a batch on the device")
    messages = c.arrive("good", "bad", "fine")  # they wait together for the device
    c.until(lambda: ["good", "bad", "fine"] in c.store.jobs.loads, "the batch loaded")
    c.predictor.gate.set()
    c.until(lambda: len(c.store.jobs.ended) == 4, "every job ended")
    assert c.predictor.calls[1:] == [["good", "bad", "fine"], ["good"], ["bad"], ["fine"]]
    ended = c.store.jobs.ended
    assert {j: ended[j].status for j in ("good", "bad", "fine")} == {
        "good": "succeeded",
        "bad": "failed",
        "fine": "succeeded",
    }
    error = ended["bad"].error
    assert error is not None
    assert error.code == "inference_failed"
    assert c.store.stats.batches[1] == (3, 4)  # one batch, four backend calls
    assert [m.settled for m in messages] == ["acked"] * 3


@pytest.mark.parametrize(("wedged", "running_settles"), [(False, "requeued"), (True, "acked")])
def test_stopping_with_a_batch_on_the_device_hands_every_message_back(
    consumers: list[Consumer], wedged: bool, running_settles: str
) -> None:
    c = _consumer(consumers, GatedPredictor(gated=True), max_batch_size=1)
    running = c.arrive("running")
    c.until(c.predictor.on_device.is_set, "a batch on the device")
    prepared = c.arrive("prepared")
    c.until(lambda: ["prepared"] in c.store.jobs.loads, "the next batch prepared")
    waiting = c.arrive("waiting")  # behind the prepared batch: nothing has room for it yet
    c.feeder.give_back(wedged=wedged)
    assert running[0].settled == running_settles
    assert [m.settled for m in prepared + waiting] == ["requeued", "requeued"]
    assert c.store.consumers.left
    c.predictor.gate.set()  # the batch comes back after the stop: nothing more is done with its message
    c.until(lambda: "running" in c.store.jobs.ended, "the running batch written")
    assert c.predictor.calls == [["running"]]
    assert "prepared" not in c.store.jobs.ended
    assert "waiting" not in c.store.jobs.ended


def test_the_intake_holds_at_most_the_prefetch_and_takes_into_the_room_each_written_batch_frees(
    consumers: list[Consumer],
) -> None:
    intake = MemoryIntake()
    c = _consumer(consumers, GatedPredictor(gated=True), max_batch_size=2, intake=intake)
    job_ids = [f"j{n}" for n in range(10)]
    for job_id in job_ids:
        c.store.jobs.pending[job_id] = _pending(job_id, None)
    intake.put(*(IntakeMessage(intake, job_id) for job_id in job_ids))
    c.until(lambda: ["j2", "j3"] in c.store.jobs.loads, "a batch on the device and the next prepared")
    assert [m.kwargs["job_id"] for m in intake.taken] == job_ids[:4]  # the prefetch: two batches of two
    assert c.predictor.calls == [["j0", "j1"]]
    c.predictor.gate.set()
    c.until(lambda: len(c.store.jobs.ended) == 10, "every job ended")
    assert [m.settled for m in intake.taken] == ["acked"] * 10
    assert max(intake.held_after_takes) == 4
    assert [m.kwargs["job_id"] for m in intake.taken] == job_ids
    assert sorted(job for call in c.predictor.calls for job in call) == sorted(job_ids)


def test_what_arrives_after_the_consumer_stopped_goes_straight_back(consumers: list[Consumer]) -> None:
    intake = MemoryIntake()
    c = _consumer(consumers, GatedPredictor(gated=True), max_batch_size=1, intake=intake)
    c.feeder.give_back()
    assert intake.closed
    late = c.arrive("late")  # a take that was under way when the consumer stopped
    assert [m.settled for m in late] == ["requeued"]
    assert c.store.jobs.loads == []


def test_a_context_refuses_a_member_it_does_not_have() -> None:
    with pytest.raises(TypeError, match="predictr"):
        WorkerContext(WorkerSettings(), NoOutbox(), predictr=GatedPredictor())  # type: ignore[call-arg]


def test_a_given_member_is_used_and_no_other_is_built() -> None:
    store = MemoryStore.empty()
    ctx = WorkerContext(WorkerSettings(), NoOutbox(), store=store)
    assert ctx.store is store
    assert "predictor" not in vars(ctx)  # built only when asked for: only the inference worker loads a model


def test_an_idle_consumer_beats_less_and_less_often_and_at_once_when_jobs_come() -> None:
    store = MemoryStore.empty()
    settings = WorkerSettings(idle_max_wait_s=4.0)
    ctx = WorkerContext(settings, NoOutbox(), store=store, predictor=GatedPredictor())
    watchdog = BatchWatchdog(60.0, 60.0, on_overdue=lambda _: None, on_wedged=lambda _: None)
    feeder = Feeder(ctx, BatchPolicy(max_batch_size=4, max_batch_tokens=100, max_wait_s=0.0), watchdog, beat_s=0.5)
    beat, held = feeder.heartbeat, feeder.held
    waits = [beat.beat_at_pace(active=held.holding()) for _ in range(5)]  # the heartbeat's rounds, not started
    assert waits == [1.0, 2.0, 4.0, 4.0, 4.0]  # nothing held: slower each round, up to idle_max_wait_s
    assert store.consumers.beats == [3.0, 6.0, 12.0, 12.0, 12.0]  # each beat outlives three of its waits
    feeder.add([FakeMessage("j1")])
    assert store.consumers.beats[-1] == 1.5  # a beat at once, for the pace of a consumer that holds jobs
    assert beat.beat_at_pace(active=held.holding()) == 0.5  # and it stays there while it holds them
    feeder.add([FakeMessage("j2")])
    assert len(store.consumers.beats) == 7  # already at its own pace: no extra beat per arrival
    with feeder.held._lock:
        feeder.held._waiting.clear()  # both jobs gone (as if answered) before the heartbeat's next round
    feeder.heartbeat.wake()  # the round's wait after its beat returns at once
    feeder.heartbeat.step()
    assert store.consumers.beats[-1] == 1.5  # jobs came since its last beat: still at its own pace


class CountingCondition(threading.Condition):
    """A condition that counts the times it was notified (`notify_all` notifies through `notify`)."""

    def __init__(self, lock: threading.RLock | None = None) -> None:
        super().__init__(lock)
        self.notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


def test_an_arrival_wakes_the_collector_alone() -> None:
    ctx = WorkerContext(WorkerSettings(), NoOutbox(), store=MemoryStore.empty(), predictor=GatedPredictor())
    watchdog = BatchWatchdog(60.0, 60.0, on_overdue=lambda _: None, on_wedged=lambda _: None)
    feeder = Feeder(ctx, BatchPolicy(max_batch_size=4, max_batch_tokens=100, max_wait_s=0.0), watchdog)
    conditions = {name: CountingCondition(feeder.held._lock) for name in ("_to_collect", "_to_run", "_to_take_lines")}
    for name, condition in conditions.items():
        setattr(feeder.held, name, condition)
    feeder.add([FakeMessage("a"), FakeMessage("b")])
    feeder.add([_line("c")])
    # Nothing the device or the line taker waits for changed: only the collector has work
    assert {name: c.notified for name, c in conditions.items()} == {"_to_collect": 2, "_to_run": 0, "_to_take_lines": 0}


def test_a_batch_wakes_the_errands_thread_only_when_it_sleeps_with_nothing_to_wake_for() -> None:
    """While batches follow each other, the errands thread sleeps until the one on the device is due its start
    stamp: a batch wakes it only from a sleep with no end (or with jobs to end), not once per batch."""
    ctx = WorkerContext(WorkerSettings(), NoOutbox(), store=MemoryStore.empty(), predictor=GatedPredictor())
    watchdog = BatchWatchdog(60.0, 60.0, on_overdue=lambda _: None, on_wedged=lambda _: None)
    feeder = Feeder(ctx, BatchPolicy(max_batch_size=1, max_batch_tokens=100, max_wait_s=0.0), watchdog)
    feeder.errands._errand = errand = CountingCondition()

    def next_batch(job_id: str, deadline: float | None = None) -> None:
        feeder.held._prepared.append(BatchItem(job_id, _pending(job_id, deadline), FakeMessage(job_id), time.time()))
        feeder.device.next_batch()

    feeder.errands._idle = True  # asleep with nothing on the device
    next_batch("a")
    assert errand.notified == 1
    feeder.errands._idle = False  # asleep until a's stamp is due: b's is later, the sleep ends in time
    next_batch("b")
    assert errand.notified == 1
    next_batch("late", deadline=time.time() - 1)
    assert errand.notified == 2  # a job to end: at once

    feeder.errands._on_device = None
    next_batch("c")
    assert feeder.errands._on_device is not None
    items, at, turn = feeder.errands._on_device
    assert feeder.errands.stamp_due(at + STAMP_AFTER_S / 2) is None  # not yet
    assert feeder.errands.stamp_due(at + STAMP_AFTER_S) == (items, at, turn)
    assert feeder.errands.stamp_due(at + 2 * STAMP_AFTER_S) is None  # stamped once
    next_batch("d")
    feeder.errands._on_device[2].end()
    assert feeder.errands.stamp_due(time.time() + STAMP_AFTER_S) is None  # ended first: its results carry its stamps


def test_an_interactive_request_goes_before_the_prepared_batch_lines_in_a_batch_of_its_own(
    consumers: list[Consumer],
) -> None:
    c = _consumer(consumers, GatedPredictor(gated=True), max_batch_size=2)
    c.arrive("a")
    c.until(c.predictor.on_device.is_set, "the first batch on the device")
    for job_id in ("l1", "l2"):
        c.store.jobs.pending[job_id] = _pending(job_id, None)
    c.feeder.add([_line("l1"), _line("l2")])
    c.until(lambda: ["l1", "l2"] in c.store.jobs.loads, "a batch of two batch lines prepared")
    c.arrive("x")
    c.until(lambda: ["x"] in c.store.jobs.loads, "the interactive request loaded")
    c.predictor.gate.set()
    c.until(lambda: len(c.store.jobs.ended) == 4, "every job ended")
    # It waited only for the batch on the device, and no line slowed its batch down.
    assert c.predictor.calls == [["a"], ["x"], ["l1", "l2"]]


def test_batch_lines_are_taken_only_into_room_and_step_aside_for_an_interactive_request(
    consumers: list[Consumer],
) -> None:
    lines = MemoryLines()
    predictor = GatedPredictor(stepped=True)
    c = _consumer(consumers, predictor, max_batch_size=4, lines=lines, line_batch=2)
    names = [f"l{n}" for n in range(1, 11)]
    for job_id in names:
        c.store.jobs.pending[job_id] = _pending(job_id, None)
    lines.put(*names)  # handed over by preprocessing, their messages published
    # No interactive request yet: the device is the lines', in full batches.
    c.until(lambda: predictor.calls == [["l1", "l2", "l3", "l4"]], "a full batch of lines on the device")
    c.until(lambda: ["l5", "l6", "l7", "l8"] in c.store.jobs.loads, "the next four lines prepared")
    assert lines.taken == 8  # one batch of lines on the device and one prepared: the rest stay in the broker
    c.arrive("x")
    c.until(lambda: ["x"] in c.store.jobs.loads, "the interactive request loaded")
    predictor.release(5)
    c.until(lambda: len(c.store.jobs.ended) == 11, "every job ended")
    # It waited only for the batch on the device; lines then ran two at a time while interactive requests came.
    assert predictor.calls == [["l1", "l2", "l3", "l4"], ["x"], ["l5", "l6"], ["l7", "l8"], ["l9", "l10"]]
    assert [m.settled for m in lines.messages] == ["acked"] * 10
    c.feeder.give_back()
    assert lines.closed


def test_an_answer_that_goes_on_runs_again_first_beside_the_request_that_waited(consumers: list[Consumer]) -> None:
    c = _consumer(consumers, YieldingPredictor(), max_batch_size=4)
    predictor = c.predictor
    assert isinstance(predictor, YieldingPredictor)
    (long,) = c.arrive("long:3")
    c.until(predictor.on_device.is_set, "the long answer on the device")
    c.until(lambda: "long:3" in c.store.jobs.started, "the long answer's start stamped while it runs")
    (short,) = c.arrive("short:1")
    c.until(lambda: ["short:1"] in c.store.jobs.loads, "the short request loaded while the long one runs")
    predictor.release(3)
    c.until(lambda: len(c.store.jobs.ended) == 2, "both answered")
    assert predictor.calls == [["long:3"], ["long:3", "short:1"], ["long:3"]]
    assert predictor.seen_waiting[0] == 1  # the call on the device saw the short request wait
    ended = c.store.jobs.ended
    assert list(ended) == ["short:1", "long:3"]  # the short one did not wait for the long answer to end
    assert [e.result.text for e in ended.values() if e.result] == ["short:1 in 1 tokens", "long:3 in 3 tokens"]
    assert (long.times_settled, short.times_settled) == (1, 1)
    assert long.settled == short.settled == "acked"
    # the long answer's time on the device counts from its first call, before the short one's
    assert ended["long:3"].stamps["infer_start"] < ended["short:1"].stamps["infer_start"]
    c.until(lambda: not c.store.consumers.held, "every job released")


def test_a_call_on_the_device_is_told_of_a_job_cancelled_while_it_runs(consumers: list[Consumer]) -> None:
    c = _consumer(consumers, YieldingPredictor(), max_batch_size=4)
    predictor = c.predictor
    assert isinstance(predictor, YieldingPredictor)
    c.arrive("long:3", "other:3")
    c.until(predictor.on_device.is_set, "the call on the device")
    c.store.jobs.cancelled.put("long:3")  # announced while the call runs
    c.until(lambda: predictor.cancelled("long:3"), "the cancellation heard")
    predictor.release(1)
    c.until(lambda: len(predictor.seen_cancelled) == 1, "the call asked")
    assert predictor.jobs[0] == ["long:3", "other:3"]  # each request carries its job's id
    assert predictor.seen_cancelled == [["long:3"]]  # the running call learns it, by the job's id, before it ends
