"""Batch input files line by line, outcome lines, and how much room batch feeding takes: pure values."""

from __future__ import annotations

import json

from stoker.core.batching import BatchPolicy, Waiting, top_up
from stoker.core.openai_batches import (
    LineError,
    OpenAIBatch,
    OpenAIBatchLine,
    Room,
    Validation,
    index_entry,
    indexed_names,
    line_job_id,
    line_room,
    parse_line,
    split_lines,
    tenant_turns,
    unrun_line,
)

ENDPOINT = "/v1/chat/completions"
MARKS = Room(infer_high=64, infer_low=32, cpu_limit=500)


def raw(custom_id: str = "a", method: str = "POST", model: str = "m", url: str = ENDPOINT) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body}).encode()


def test_a_line_is_parsed_or_refused_with_its_number() -> None:
    parsed = parse_line(raw(), 3, ENDPOINT)
    assert isinstance(parsed, OpenAIBatchLine)
    assert (parsed.number, parsed.custom_id, json.loads(parsed.body)["model"]) == (3, "a", "m")
    refused = [parse_line(b, 7, ENDPOINT) for b in (b"{nope", b"[1]", raw(method="GET"), raw(url="/v1/embeddings"))]
    assert all(isinstance(r, LineError) and r.line == 7 for r in refused)
    codes = [r.code for r in refused if isinstance(r, LineError)]
    assert codes == ["invalid_json_line", "invalid_json_line", "invalid_method", "mismatched_endpoint"]


def test_validation_finds_duplicates_and_mixed_models_by_line() -> None:
    check = Validation(ENDPOINT, max_lines=10)
    for line in (raw("a"), b"", raw("a"), raw("b", model="other")):
        check.add(line)
    assert [(e.code, e.line) for e in check.finish()] == [("duplicate_custom_id", 3), ("mismatched_model", 4)]
    assert check.requests == 2


def test_validation_refuses_an_empty_file_and_too_many_requests() -> None:
    assert [e.code for e in Validation(ENDPOINT, 5).finish()] == ["empty_file"]
    check = Validation(ENDPOINT, max_lines=2)
    for n in range(3):
        check.add(raw(str(n)))
    assert [e.code for e in check.finish()] == ["too_many_requests"]


def test_lines_split_across_chunks_keep_their_offsets() -> None:
    chunks = [b'{"a"', b":1}\n{", b'"b":2}\n', b"tail"]
    assert list(split_lines(chunks)) == [(b'{"a":1}', 8), (b'{"b":2}', 16), (b"tail", 20)]


def test_a_lines_job_id_is_the_same_every_time_it_is_fed() -> None:
    assert line_job_id("batch_1", 5) == line_job_id("batch_1", 5)
    assert len({line_job_id("batch_1", 5), line_job_id("batch_1", 6), line_job_id("batch_2", 5)}) == 3
    assert len(line_job_id("batch_1", 5)) == 32


def test_batch_lines_are_fed_only_into_room_under_the_watermarks() -> None:
    assert line_room({"infer": 10, "decode": 0}, 20, max_in_flight=64, room=MARKS, holding=False) == 22
    assert line_room({"infer": 0}, 50, max_in_flight=64, room=MARKS, holding=False) == 14
    assert line_room({"infer": 70}, 0, max_in_flight=64, room=MARKS, holding=False) == 0  # over the high mark
    assert line_room({"infer": 40}, 0, max_in_flight=64, room=MARKS, holding=True) == 0  # not back at the low one
    assert line_room({"infer": 0, "ocr": 250}, 0, max_in_flight=64, room=MARKS, holding=False) == 0
    assert line_room({"infer": 0}, 64, max_in_flight=64, room=MARKS, holding=False) == 0


def test_interactive_requests_go_before_older_batch_lines_in_a_batch_of_their_own() -> None:
    policy = BatchPolicy(max_batch_size=2, max_batch_tokens=1000, max_wait_s=0)
    waiting = [Waiting("line1", 5, 1.0, batch=True), Waiting("line2", 5, 2.0, batch=True), Waiting("chat", 5, 3.0)]
    plan = top_up(waiting, 0, 0, 4.0, policy)
    assert [w.key for w in plan.run] == ["chat"]
    assert [w.key for w in plan.keep] == ["line1", "line2"]


def test_batch_lines_join_only_a_batch_of_lines() -> None:
    policy = BatchPolicy(max_batch_size=4, max_batch_tokens=1000, max_wait_s=0)
    lines = [Waiting("line1", 5, 1.0, batch=True), Waiting("line2", 5, 2.0, batch=True)]
    assert [w.key for w in top_up(lines, 1, 5, 4.0, policy).run] == ["line1", "line2"]
    assert top_up(lines, 1, 5, 4.0, policy, interactive_in_batch=True).run == []
    assert [w.key for w in top_up(lines, 1, 5, 4.0, policy, line_room=1).run] == ["line1"]


def test_a_line_that_never_ran_says_why() -> None:
    row = unrun_line("c1", "abc", "batch_expired", "too late")
    assert row == {
        "id": "batch_req_abc",
        "custom_id": "c1",
        "response": None,
        "error": {"code": "batch_expired", "message": "too late"},
    }


def test_any_line_that_cannot_be_read_is_its_own_error_never_the_readers() -> None:
    deep = b'{"custom_id": "x", "body": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for bad in (deep, b"\xff\xfe{"):
        refused = parse_line(bad, 4, ENDPOINT)
        assert isinstance(refused, LineError)
        assert (refused.code, refused.line) == ("invalid_json_line", 4)
    check = Validation(ENDPOINT, max_lines=10)
    assert check.add(deep) is None
    assert check.add(raw("ok")) == "ok"
    assert [(e.code, e.line) for e in check.finish()] == [("invalid_json_line", 1)]


def test_a_line_over_a_requests_limits_is_refused_by_number_before_it_is_parsed() -> None:
    picture = raw("big").replace(b'"hi"', b'"' + b"A" * 5000 + b'"')
    many = raw("many").replace(b'"hi"', b"[" + b"1," * 400 + b"1]")
    check = Validation(ENDPOINT, max_lines=10, max_line_bytes=2048, max_line_values=256)
    for line in (raw("a"), picture, many, raw("b")):
        check.add(line)
    errors = check.finish()
    assert [(e.code, e.line) for e in errors] == [("line_too_large", 2), ("line_too_large", 3)]
    assert "2048 bytes" in errors[0].message
    assert "256 JSON values" in errors[1].message
    assert check.requests == 2


def test_a_long_line_is_cut_while_it_is_split_never_held_whole() -> None:
    chunks = [b"ab", b"cdefgh" * 1000, b"ij\nshort\n", b"x" * 50]
    assert list(split_lines(chunks, max_line_bytes=4)) == [(b"abcde", 6005), (b"short", 6011), (b"xxxxx", 6061)]
    assert list(split_lines(chunks)) == list(split_lines(chunks, max_line_bytes=0))
    assert [len(line) for line, _ in split_lines(chunks)] == [6004, 5, 50]


def test_a_line_index_names_each_request_past_the_cursor() -> None:
    index = index_entry("a") + index_entry(None) + index_entry('quote "b"\n') + index_entry("c")
    assert list(indexed_names(split_lines([index]), 0)) == [(1, "a"), (3, 'quote "b"\n'), (4, "c")]
    assert list(indexed_names(split_lines([index]), 3)) == [(4, "c")]


def _record(tenant: str, created_at: int) -> OpenAIBatch:
    return OpenAIBatch(
        id=f"batch_{tenant}{created_at}",
        endpoint=ENDPOINT,
        input_file_id="file-x",
        completion_window="24h",
        status="in_progress",
        created_at=created_at,
        tenant=tenant,
    )


def test_tenants_are_fed_in_turn_each_one_first_in_its_round() -> None:
    batches = [_record("alpha", 1), _record("alpha", 2), _record("beta", 3), _record("gamma", 0)]
    first = tenant_turns(batches, 0)
    assert [[r.id for r in tenant] for tenant in first] == [
        ["batch_alpha1", "batch_alpha2"],
        ["batch_beta3"],
        ["batch_gamma0"],
    ]
    leaders = [tenant_turns(batches, turn)[0][0].tenant for turn in range(4)]
    assert leaders == ["alpha", "beta", "gamma", "alpha"]
    assert not tenant_turns([], 5)
