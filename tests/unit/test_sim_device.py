"""The simulated device in steps (`STOKER_SIM_STEPS`): a call stops between steps for waiting requests or for its
done answers, as the local model's calls do, and an unfinished answer comes back `Continued` with its steps."""

from __future__ import annotations

from dataclasses import replace

from stoker.adapters.backends.sim import SimPredictor
from stoker.core.model import Continued, ModelRequest, Prediction, run_predictor

STEPS = 10


def _device(waiting: int | None, max_rows: int = 4) -> SimPredictor:
    device = SimPredictor(base_ms=5, per_item_ms=1, steps=STEPS, yield_steps=2)
    if waiting is not None:
        device.yield_to(lambda: waiting, max_rows)
    return device


def _requests(count: int) -> list[ModelRequest]:
    return [ModelRequest(list(range(n + 3))) for n in range(count)]


def test_without_a_consumer_to_yield_to_a_call_runs_every_step() -> None:
    outcomes = run_predictor(_device(waiting=None), _requests(2))
    assert [type(o) for o in outcomes] == [Prediction, Prediction]
    assert [(o.prompt_tokens, o.completion_tokens) for o in outcomes if isinstance(o, Prediction)] == [(3, 10), (4, 10)]


def test_a_waiting_request_stops_the_call_at_its_next_yield_point() -> None:
    outcomes = run_predictor(_device(waiting=1), _requests(2))
    assert outcomes == [Continued((0, 0)), Continued((0, 0))]  # two steps each, then room for the waiting one


def test_answers_under_way_finish_beside_a_new_one_and_leave_the_call() -> None:
    going = [replace(r, generated=(0,) * 8) for r in _requests(2)]
    # nobody waits, yet the done answers leave at the first yield point after their end: their clients do not wait
    # for the longest answer of the call (the unfinished one goes on in the next call)
    outcomes = run_predictor(_device(waiting=0), [*going, *_requests(1)])
    assert [type(o) for o in outcomes] == [Prediction, Prediction, Continued]
    assert outcomes[2] == Continued((0, 0))  # it had two steps when the others were done


def test_a_full_call_and_a_batch_line_run_to_their_end() -> None:
    full = run_predictor(_device(waiting=3, max_rows=2), _requests(2))  # no room for what waits
    assert [type(o) for o in full] == [Prediction, Prediction]
    lines = [replace(r, background=True) for r in _requests(2)]
    assert [type(o) for o in run_predictor(_device(waiting=3), lines)] == [Prediction, Prediction]
