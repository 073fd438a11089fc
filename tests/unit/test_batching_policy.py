"""The batching policy at chosen instants (size, token budget, wait, deadlines, a busy device), and per-item
isolation when a batch fails."""

from __future__ import annotations

from collections.abc import Sequence

from stoker.core.batching import BatchPolicy, Waiting, plan_batch
from stoker.core.model import ModelRequest, Prediction
from tasks.inference import predict_isolated

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
