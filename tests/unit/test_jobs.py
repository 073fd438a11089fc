"""Job timings and status, and the record's round trip through its Redis fields."""

from __future__ import annotations

import pytest

from stoker.adapters.store.jobs import job_from_fields
from stoker.core.callbacks import backoff_s, sign, verify
from stoker.core.errors import InvalidRequest
from stoker.core.idempotency import Remembered, check_key, key_digest, request_fingerprint
from stoker.core.jobs import Cursor, InputRecord, compute_timings, final_status


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


# -- the job list's cursors, idempotency keys, callback signatures -------------------------------------------------


def test_a_cursor_round_trips_and_orders_newest_first() -> None:
    cursor = Cursor(1_796_000_000.123456, "a" * 32)
    assert Cursor.decode(cursor.encode()) == cursor
    assert Cursor(1_796_000_000.0, "f" * 32).after(cursor)  # older
    assert Cursor(1_796_000_000.123456, "0" * 32).after(cursor)  # same time, lower id
    assert not Cursor(1_796_000_001.0, "0" * 32).after(cursor)  # newer


@pytest.mark.parametrize("text", ["", "not-a-cursor", "bmFuOmFiYw", Cursor(1.0, "../etc").encode()])
def test_a_cursor_not_given_out_by_the_api_is_refused(text: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        Cursor.decode(text)
    assert info.value.param == "cursor"


def test_idempotency_keys_and_request_fingerprints() -> None:
    assert check_key("4f1c-retry_1") == "4f1c-retry_1"
    for bad in ("", "has space", "x" * 256, "naïve"):
        with pytest.raises(InvalidRequest):
            check_key(bad)
    assert key_digest("acme", "k") != key_digest("globex", "k")  # per tenant
    one = request_fingerprint("hi", [("image", "abc", None)], 60_000)
    assert one == request_fingerprint("hi", [("image", "abc", None)], 60_000)
    assert one != request_fingerprint("hi", [("image", "abd", None)], 60_000)
    assert one != request_fingerprint("hi", [("image", "abc", None)], 30_000)
    assert one != request_fingerprint("hi", [("image", "abc", None)], 60_000, callback_url="https://a.example/h")
    remembered = Remembered("b" * 32, one)
    assert Remembered.load(remembered.dump()) == remembered


def test_a_callback_signature_verifies_only_unchanged_and_recent() -> None:
    body, now = b'{"id": "x", "status": "succeeded"}', 1_796_000_000
    signature = sign("whsec_test", now, body)
    assert signature.startswith("v1=")
    assert verify("whsec_test", str(now), body, signature, now + 10)
    assert not verify("whsec_test", str(now), body + b" ", signature, now + 10)  # altered body
    assert not verify("whsec_other", str(now), body, signature, now + 10)  # another tenant's secret
    assert not verify("whsec_test", str(now), body, signature, now + 301)  # an old delivery replayed
    assert not verify("whsec_test", "soon", body, signature, now)
    assert [backoff_s(n, 2.0) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
    assert backoff_s(20, 2.0) == 600.0
