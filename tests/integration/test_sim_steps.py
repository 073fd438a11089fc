"""On a device whose calls stop between decoding steps (the simulated one with `STOKER_SIM_STEPS`, as the local
model's with `STOKER_YIELD_TOKENS`), a request that arrives while an answer is under way joins it at the next step
instead of waiting for the call's end."""

from __future__ import annotations

from tests.fleet import Fleet, own_fleet
from tests.integration.test_consumer import _on_device, _submit
from tests.integration.test_pipeline import _wait

#: A call of one request takes 2 s, in 20 steps of 0.1 s; it may stop after any step.
DEVICE = {
    "STOKER_BACKEND": "sim",
    "STOKER_SIM_BASE_MS": "2000",
    "STOKER_SIM_PER_ITEM_MS": "0",
    "STOKER_SIM_STEPS": "20",
    "STOKER_YIELD_TOKENS": "1",
    "STOKER_CACHE_ENABLED": "false",
}


def _stamp(fleet: Fleet, job_id: str, name: str) -> float:
    stamp = fleet.store().hget(f"stoker:job:{job_id}", f"ts:{name}")
    assert stamp is not None, f"no ts:{name} on {job_id}"
    return float(stamp)


def test_a_request_joins_an_answer_under_way_at_the_next_step() -> None:
    with own_fleet(DEVICE) as fleet:
        first = _submit(fleet, "First.")
        _on_device(fleet, first)
        second = _submit(fleet, "Second.")
        ended = [_wait(fleet.client, job_id) for job_id in (first, second)]
        assert [job["status"] for job in ended] == ["succeeded", "succeeded"]
        # The second started on the device while the first's answer was under way, not after its call ended.
        assert _stamp(fleet, second, "infer_start") < _stamp(fleet, first, "infer_end")
        assert [job["result"]["completion_tokens"] for job in ended] == [20, 20]  # every step, each
