"""The batching policy at chosen instants (size, token budget, wait, deadlines, a busy device), and per-item
isolation when a batch fails."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from stoker.core.batching import BatchPolicy, Waiting, idle_gap_summary, plan_batch, start_at, top_up
from stoker.core.model import GenerationParams, ModelRequest, Prediction, sampling_groups
from stoker.core.pressure import DrainMeter, QueueState, Refusal, drain_rate, queue_refusal
from stoker.runtime.batches import predict_grouped, predict_isolated

POLICY = BatchPolicy(max_batch_size=4, max_batch_tokens=100, max_wait_s=0.05)


def _items(*tokens: int, start: float = 0.0, deadline: float | None = None) -> list[Waiting]:
    return [Waiting(f"j{i}", t, start + i * 0.001, deadline) for i, t in enumerate(tokens)]


def test_a_full_batch_runs_at_once() -> None:
    plan = plan_batch(_items(10, 10, 10, 10, 10), now=0.01, policy=POLICY)
    assert [w.key for w in plan.run] == ["j0", "j1", "j2", "j3"]
    assert [w.key for w in plan.keep] == ["j4"]
    assert plan.next_at == 0.004 + 0.05  # the leftover's own wait starts from its arrival


def test_a_partial_batch_waits_for_its_first_item_then_runs() -> None:
    waiting = _items(10, 10)
    early = plan_batch(waiting, now=0.049, policy=POLICY)
    assert early.run == []
    assert early.next_at == 0.05
    late = plan_batch(waiting, now=0.05, policy=POLICY)
    assert [w.key for w in late.run] == ["j0", "j1"]
    assert late.next_at is None


def test_the_token_budget_closes_a_batch_before_its_size() -> None:
    plan = plan_batch(_items(60, 30, 20, 5), now=0.0, policy=POLICY)
    assert [w.key for w in plan.run] == ["j0", "j1"]  # 60 + 30 = 90; + 20 would pass 100
    assert [w.key for w in plan.keep] == ["j2", "j3"]


def test_one_item_over_the_token_budget_still_runs_alone() -> None:
    plan = plan_batch(_items(500, 10), now=0.0, policy=POLICY)
    assert [w.key for w in plan.run] == ["j0"]


def test_items_past_their_deadline_are_dropped_before_the_batch() -> None:
    waiting = _items(10, 10, deadline=1.0) + _items(10, start=0.002)
    plan = plan_batch(waiting, now=1.0, policy=POLICY)
    assert [w.key for w in plan.expired] == ["j0", "j1"]
    assert [w.key for w in plan.run] == ["j0"]  # the one without a deadline, waited long enough
    assert plan.run[0].deadline is None


def test_nothing_runs_while_the_device_is_busy_but_expired_items_still_go() -> None:
    waiting = [*_items(10, 10, 10, 10, deadline=5.0), Waiting("late", 10, 0.0, 0.5)]
    plan = plan_batch(waiting, now=1.0, policy=POLICY, device_free=False)
    assert plan.run == []
    assert [w.key for w in plan.expired] == ["late"]
    assert len(plan.keep) == 4


def test_requests_are_served_in_arrival_order() -> None:
    waiting = [Waiting("b", 10, 2.0), Waiting("a", 10, 1.0)]
    plan = plan_batch(waiting, now=5.0, policy=POLICY)
    assert [w.key for w in plan.run] == ["a", "b"]


class _Picky:
    """A predictor that fails any batch holding a request with no prompt tokens."""

    name = "picky"
    mixes_sampling = True

    def __init__(self) -> None:
        self.batches: list[int] = []

    def setup(self, device: str) -> None:
        """Nothing to load."""

    def batch(self, requests: Sequence[ModelRequest]) -> list[int]:
        self.batches.append(len(requests))
        return [len(r.prompt_ids) for r in requests]

    def predict(self, batch: list[int]) -> list[int]:
        if 0 in batch:
            raise RuntimeError("cannot run an empty prompt")
        return batch

    def unbatch(self, output: list[int]) -> list[Prediction]:
        return [Prediction(text=f"{n} tokens", prompt_tokens=n, completion_tokens=1) for n in output]


def test_one_bad_request_fails_alone_after_the_batch_is_retried_item_by_item() -> None:
    picky = _Picky()
    requests = [ModelRequest([1, 2]), ModelRequest([]), ModelRequest([3])]
    outcomes = predict_isolated(picky, requests)
    assert picky.batches == [3, 1, 1, 1]
    assert [type(o).__name__ for o in outcomes] == ["Prediction", "InferenceFailed", "Prediction"]
    assert outcomes[0].text == "2 tokens"  # type: ignore[union-attr]


class _Short(_Picky):
    """A backend breaking its contract: one answer fewer than the requests it was given."""

    def unbatch(self, output: list[int]) -> list[Prediction]:
        return super().unbatch(output)[:-1]


def test_a_backend_answering_too_few_requests_fails_them_instead_of_dropping_one() -> None:
    short = _Short()
    calls: list[int] = []
    outcomes = predict_isolated(short, [ModelRequest([1]), ModelRequest([2])], calls)
    assert calls == [2, 1, 1]  # the batch, then each request alone
    assert len(outcomes) == 2  # one outcome per request: none is silently lost
    assert {type(o).__name__ for o in outcomes} == {"InferenceFailed"}


def test_a_real_batch_is_one_backend_call() -> None:
    calls: list[int] = []
    outcomes = predict_isolated(_Picky(), [ModelRequest([1]), ModelRequest([2]), ModelRequest([3])], calls)
    assert calls == [3]
    assert [o.text for o in outcomes] == ["1 tokens", "1 tokens", "1 tokens"]  # type: ignore[union-attr]


# -- the work-conserving consumer: what joins the batch being prepared, and when a free device starts it --------

WORK_CONSERVING = BatchPolicy(max_batch_size=4, max_batch_tokens=100, max_wait_s=0.0)


def test_an_idle_device_takes_a_lone_request_at_once() -> None:
    plan = top_up(_items(10), have=0, have_tokens=0, now=0.0, policy=WORK_CONSERVING)
    assert [w.key for w in plan.run] == ["j0"]
    assert start_at([0.0], now=0.0, policy=WORK_CONSERVING) == 0.0  # no wait for company


def test_what_arrives_while_a_batch_runs_fills_the_next_one_up_to_its_size() -> None:
    first = top_up(_items(10, 10), have=0, have_tokens=0, now=0.0, policy=WORK_CONSERVING)
    assert len(first.run) == 2
    later = top_up(_items(10, 10, 10, 10), have=2, have_tokens=20, now=0.1, policy=WORK_CONSERVING)
    assert [w.key for w in later.run] == ["j0", "j1"]  # room for two more
    assert [w.key for w in later.keep] == ["j2", "j3"]  # they form the batch after
    assert top_up(_items(10), have=4, have_tokens=40, now=0.2, policy=WORK_CONSERVING).run == []


def test_the_token_budget_caps_a_top_up_and_an_oversized_request_goes_alone() -> None:
    plan = top_up(_items(30, 30), have=1, have_tokens=50, now=0.0, policy=WORK_CONSERVING)
    assert [w.key for w in plan.run] == ["j0"]  # 50 + 30 = 80; + 30 would pass 100
    assert top_up(_items(500), have=1, have_tokens=10, now=0.0, policy=WORK_CONSERVING).run == []
    alone = top_up(_items(500, 10), have=0, have_tokens=0, now=0.0, policy=WORK_CONSERVING)
    assert [w.key for w in alone.run] == ["j0"]


def test_a_top_up_drops_what_is_past_its_deadline() -> None:
    waiting = [*_items(10, deadline=1.0), Waiting("fresh", 10, 0.5)]
    plan = top_up(waiting, have=0, have_tokens=0, now=1.0, policy=WORK_CONSERVING)
    assert [w.key for w in plan.expired] == ["j0"]
    assert [w.key for w in plan.run] == ["fresh"]


def test_waiting_for_company_is_opt_in_and_ends_when_the_batch_is_full() -> None:
    patient = BatchPolicy(max_batch_size=4, max_batch_tokens=100, max_wait_s=0.05)
    assert start_at([1.0, 1.01], now=1.02, policy=patient) == 1.05  # the first one's wait runs out at 1.05
    assert start_at([1.0, 1.01, 1.02, 1.03], now=1.03, policy=patient) == 1.03  # full: at once
    assert start_at([], now=1.0, policy=patient) is None


def test_the_idle_gap_summary_is_in_milliseconds_by_nearest_rank() -> None:
    gaps = [0.001] * 98 + [0.002, 0.050]
    assert idle_gap_summary(gaps) == {"samples": 100, "p50_ms": 1.0, "p99_ms": 2.0}
    assert idle_gap_summary([]) == {"samples": 0}


# -- drain rates of a queue that drains in bursts (the synchronous baseline) ---------------------------------------


def test_a_queue_draining_in_bursts_wider_than_the_window_still_has_a_rate() -> None:
    meter = DrainMeter(window_s=10.0, horizon_s=60.0)
    drained = 0
    for second in range(0, 50):  # sampled every second; 8 messages every 12 s, as one thread finishes a batch
        if second and second % 12 == 0:
            drained += 8
        meter.add(float(second), {"sync": drained})
    # The last burst was 1 s ago... then 11 s pass with none: the 10 s window alone would say "not draining".
    for second in range(50, 59):
        meter.add(float(second), {"sync": drained})
    assert meter.rate("sync") == 32 / 58  # over the horizon: 32 messages since t=0
    meter.add(59.0, {"sync": drained + 8})
    assert meter.rate("sync") == 8 / 10  # a burst inside the window: the window's own rate


def test_a_queue_that_never_drained_has_no_rate() -> None:
    meter = DrainMeter(window_s=10.0)
    for second in range(30):
        meter.add(float(second), {"sync": 0})
    assert meter.rate("sync") == 0.0


# -- Retry-After: drain meter and admission maths, with a fake clock -------------------------------------------------


def _steady(meter: DrainMeter, per_s: dict[str, float], seconds: int, every_s: float = 0.5) -> None:
    """Feed the meter counters that grow at a steady rate per queue, sampled every `every_s` of fake time."""
    for step in range(int(seconds / every_s) + 1):
        now = step * every_s
        meter.add(now, {queue: int(rate * now) for queue, rate in per_s.items()})


@pytest.mark.parametrize(("rate", "depth"), [(4.0, 60), (2.0, 90), (10.0, 300), (0.5, 45)])
def test_a_steady_drain_predicts_the_time_back_to_the_resume_level(rate: float, depth: int) -> None:
    meter = DrainMeter(window_s=10.0)
    _steady(meter, {"decode": rate}, seconds=30)
    assert meter.rate("decode") == pytest.approx(rate, rel=0.02)
    limit, ratio = 40, 0.8  # resumes at 32
    refusal = queue_refusal([QueueState("decode", depth, limit, meter.rate("decode"))], ratio)
    assert refusal is not None
    expected = (depth - 32) / rate  # (d - resume) / r
    assert expected <= refusal.retry_after_s <= expected + 1  # whole seconds, rounded up


def test_a_burst_after_a_quiet_spell_is_measured_at_the_speed_it_is_served() -> None:
    meter = DrainMeter(window_s=10.0)
    for step in range(41):  # 20 s with the queue empty, nothing drained
        meter.add(step * 0.5, {"infer": 0}, {"infer": 0})
    for step in range(1, 9):  # then 4 s of a burst: 50 waiting, 5 drained per second
        meter.add(20 + step * 0.5, {"infer": int(5 * step * 0.5)}, {"infer": 50})
    assert meter.rate("infer") == pytest.approx(5.0, rel=0.15)  # not 20 drained / 10 s = 2
    without_depths = DrainMeter(window_s=10.0)  # what it reads when depths are unknown: the whole window
    for step in range(49):
        without_depths.add(step * 0.5, {"infer": int(5 * max(step * 0.5 - 20, 0))})
    assert without_depths.rate("infer") == pytest.approx(2.0, rel=0.15)


def test_the_queue_needing_longest_decides_and_nothing_draining_is_the_longest_wait() -> None:
    states = [QueueState("decode", 50, 40, 5.0), QueueState("ocr", 45, 40, 0.5), QueueState("infer", 3, 20, 9.0)]
    refusal = queue_refusal(states, 0.8)
    assert refusal == Refusal("ocr", 45, 40, 26)  # (45 - 32) / 0.5 = 26 s; decode needs only (50 - 32) / 5
    stuck = queue_refusal([QueueState("asr", 41, 40, 0.0)], 0.8)
    assert stuck is not None
    assert stuck.retry_after_s == 120
    assert queue_refusal([QueueState("decode", 39, 40, 0.0)], 0.8) is None  # under its limit: admitted


def test_an_ocr_bottleneck_is_not_hidden_by_fast_inference() -> None:
    # OCR drains 1/s while text-only jobs race through inference at 20/s: the OCR queue's clients must be told
    # to wait for OCR, not for inference.
    meter = DrainMeter(window_s=10.0)
    _steady(meter, {"ocr": 1.0, "infer": 20.0}, seconds=30)
    rates = {queue: meter.rate(queue) for queue in ("ocr", "infer", "tokenize")}
    assert drain_rate("ocr", rates) == pytest.approx(1.0, rel=0.02)
    refusal = queue_refusal([QueueState("ocr", 52, 40, drain_rate("ocr", rates))], 0.8)
    assert refusal is not None
    assert 19 <= refusal.retry_after_s <= 21  # (52 - 32) / 1, not (52 - 32) / 20 = 1


def test_a_tokenize_queue_held_by_the_watermarks_drains_as_inference_does() -> None:
    assert drain_rate("tokenize", {"tokenize": 0.0, "infer": 3.0}) == 3.0  # held: nothing of its own counted yet
    assert drain_rate("tokenize", {"tokenize": 2.0, "infer": 3.0}) == 2.0  # measured: its own
    assert drain_rate("decode", {"decode": 0.0, "infer": 3.0}) == 0.0  # not held by inference: no borrowing


class _Recording:
    """A backend that cannot mix sampling in one call: records each call's temperatures, answers in order."""

    name = "recording"
    mixes_sampling = False

    def __init__(self) -> None:
        self.calls: list[list[float]] = []

    def setup(self, device: str) -> None:
        """Nothing to load."""

    def batch(self, requests: Sequence[ModelRequest]) -> list[ModelRequest]:
        return list(requests)

    def predict(self, batch: list[ModelRequest]) -> list[ModelRequest]:
        self.calls.append([r.params.temperature for r in batch])
        return batch

    def unbatch(self, output: list[ModelRequest]) -> list[Prediction]:
        return [Prediction(text=str(r.prompt_ids[0]), prompt_tokens=1, completion_tokens=0) for r in output]


def test_a_batch_is_split_into_one_call_per_sampling_group_and_answers_keep_their_order() -> None:
    temperatures = [0.0, 0.7, 0.0, 0.7, 1.0]
    requests = [ModelRequest([i], params=GenerationParams(temperature=t)) for i, t in enumerate(temperatures)]
    backend = _Recording()
    calls: list[int] = []
    groups = sampling_groups(requests, backend.mixes_sampling)
    outcomes = predict_grouped(backend, requests, groups, calls)
    assert backend.calls == [[0.0, 0.0], [0.7, 0.7], [1.0]]
    assert calls == [2, 2, 1]
    assert [o.text for o in outcomes] == ["0", "1", "2", "3", "4"]  # type: ignore[union-attr]
