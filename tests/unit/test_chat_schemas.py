"""Unknown chat-request fields: inside the request's parts dropped by the parser (never built into Python objects);
at the top level kept only for their names to be logged, at a cost bounded by the values a body may hold."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from api.chat_intake import accept_chat
from api.chat_schemas import ChatCompletionCreate
from stoker.core.errors import InvalidRequest
from stoker.settings import ApiSettings

BASE = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache": {"a": 1}}]}]}


def test_unknown_fields_inside_the_parts_are_dropped_at_parse_and_top_level_ones_are_named() -> None:
    body = {**BASE, "logit_bias": {"1": 2}, "user": "u", "metadata": {"k": "v"}}
    body["messages"][0]["name"] = "someone"  # type: ignore[index]
    spec = ChatCompletionCreate.model_validate_json(json.dumps(body))
    message = spec.messages[0]
    assert set(spec.model_extra or {}) == {"logit_bias", "user", "metadata"}
    assert message.model_extra is None
    assert not isinstance(message.content, str)
    assert message.content is not None
    assert message.content[0].model_extra is None
    dumped = spec.model_dump()
    assert set(dumped["messages"][0]) == {"role", "content", "tool_calls", "tool_call_id"}
    assert set(dumped["messages"][0]["content"][0]) == {"type", "text"}


def test_a_top_level_unknown_field_at_the_value_limit_costs_little() -> None:
    """The most values a body may hold (`max_json_values`; more is 413 before parsing), all in an unknown field."""
    head = json.dumps(BASE)[:-1].encode()
    values = ApiSettings().max_json_values
    body = head + b',"junk":[' + b",".join([b"[]"] * values) + b"]}"
    tracemalloc.start()
    try:
        spec = ChatCompletionCreate.model_validate_json(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert set(spec.model_extra or {}) == {"junk"}
    assert peak < 4 << 20, peak


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64, 10**40])
def test_a_seed_outside_a_signed_64_bit_integer_is_refused_at_intake(seed: int) -> None:
    body = json.dumps({**BASE, "model": ApiSettings().public_model_name, "seed": seed}).encode()
    with pytest.raises(InvalidRequest) as refused:
        accept_chat(body, ApiSettings())
    assert (refused.value.param, refused.value.http_status, refused.value.code) == ("seed", 422, "invalid_request")


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0])
def test_a_seed_within_a_signed_64_bit_integer_is_taken(seed: int) -> None:
    body = json.dumps({**BASE, "model": ApiSettings().public_model_name, "seed": seed}).encode()
    chat = accept_chat(body, ApiSettings())[1].chat
    assert chat is not None
    assert chat.params.seed == seed
