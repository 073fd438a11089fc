"""Unknown chat-request fields are dropped by the parser: never kept, never built into Python objects."""

from __future__ import annotations

import json
import tracemalloc

from api.chat_schemas import ChatCompletionCreate

BASE = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache": {"a": 1}}]}]}


def test_unknown_fields_are_dropped_at_parse_at_every_level() -> None:
    body = {**BASE, "tools": [{"type": "function"}], "logit_bias": {"1": 2}, "user": "u"}
    body["messages"][0]["name"] = "someone"  # type: ignore[index]
    spec = ChatCompletionCreate.model_validate_json(json.dumps(body))
    message = spec.messages[0]
    assert spec.model_extra is None
    assert message.model_extra is None
    assert not isinstance(message.content, str)
    assert message.content is not None
    assert message.content[0].model_extra is None
    dumped = spec.model_dump()
    assert {"tools", "logit_bias", "user"}.isdisjoint(dumped)
    assert set(dumped["messages"][0]) == {"role", "content"}
    assert set(dumped["messages"][0]["content"][0]) == {"type", "text"}


def test_a_big_unknown_field_is_never_materialised() -> None:
    """A million empty lists under an unknown key: kept, they would take tens of bytes of Python objects each."""
    head = json.dumps(BASE)[:-1].encode()
    body = head + b',"junk":[' + b",".join([b"[]"] * 1_000_000) + b"]}"
    tracemalloc.start()
    try:
        spec = ChatCompletionCreate.model_validate_json(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert spec.model_extra is None
    assert peak < len(body) / 20, (peak, len(body))
