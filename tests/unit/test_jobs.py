"""Job timings and status, and the record's round trip through its Redis fields."""

from __future__ import annotations

from stoker.adapters.store.jobs import job_from_fields
from stoker.core.jobs import InputRecord, compute_timings, final_status


def test_timings_appear_as_both_ends_are_known() -> None:
    stamps = {"accepted": 10.0, "started": 10.1, "preprocessed": 10.5}
    assert compute_timings(stamps) == {"queued": 100.0, "preprocess": 500.0}
    stamps |= {"infer_start": 10.6, "infer_end": 11.0, "done": 11.01}
    timings = compute_timings(stamps)
    assert timings["infer_wait"] == 100.0
    assert timings["infer"] == 400.0
    assert timings["total"] == 1010.0


def test_a_failed_input_degrades_the_job() -> None:
    ok = InputRecord(index=0, kind="image", content_hash="a", size_bytes=1, status="ok")
    bad = ok.model_copy(update={"index": 1, "status": "failed"})
    assert final_status([ok]) == "succeeded"
    assert final_status([ok, bad]) == "degraded"
    assert final_status([]) == "succeeded"


def test_job_is_assembled_from_its_fields() -> None:
    record = InputRecord(index=1, kind="image", content_hash="h", size_bytes=3, status="ok", text="T")
    first = record.model_copy(update={"index": 0, "text": "S"})
    fields = {
        b"prompt": b"hi",
        b"status": b"succeeded",
        b"ts:accepted": b"1.0",
        b"ts:done": b"2.0",
        b"input:1": record.model_dump_json().encode(),
        b"input:0": first.model_dump_json().encode(),
        b"result": b'{"text": "yo", "model": "m", "prompt_tokens": 3, "completion_tokens": 1}',
    }
    job = job_from_fields("j1", fields)
    assert [i.text for i in job.inputs] == ["S", "T"]
    assert job.result is not None
    assert job.result.text == "yo"
    assert job.timings_ms == {"total": 1000.0}
    assert job.terminal
