"""Streamed answers read for tool calls, strict schemas closed, cut calls dropped, subtitles, unread part types."""

from __future__ import annotations

import json
from typing import Any

import pytest

from api.chat_intake import accept_chat
from stoker.core.errors import UnsupportedParameter
from stoker.core.jobs import Segment
from stoker.core.subtitles import srt, vtt
from stoker.core.tool_stream import ToolCallStream
from stoker.core.tools import (
    FunctionSpec,
    JsonSchemaFormat,
    ResponseFormat,
    ToolSpec,
    closed_schema,
    drop_unclosed_call,
    strict_format,
    strict_tool,
)
from stoker.settings import ApiSettings

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": {"from": 1}}}\n</tool_call>'


def _run(answer: str, size: int, names: tuple[str, ...] = ("get_weather",)) -> list[dict[str, Any]]:
    stream = ToolCallStream(names)
    deltas: list[dict[str, Any]] = []
    for start in range(0, len(answer), size):
        deltas += stream.feed(answer[start : start + size])
    return deltas + stream.close()


def _content(deltas: list[dict[str, Any]]) -> str:
    return "".join(d.get("content", "") for d in deltas)


def _calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls the deltas make, joined as a client joins them (by index)."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or entry.get("id")
            call["name"] = call["name"] or entry["function"].get("name")
            call["arguments"] += entry["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_text_then_a_call_streams_as_content_then_name_then_argument_fragments(size: int) -> None:
    deltas = _run(f"Let me look.\n{CALL}", size)
    assert _content(deltas) == "Let me look."
    (call,) = _calls(deltas)
    assert call["name"] == "get_weather"
    assert call["id"].startswith("call_")
    assert json.loads(call["arguments"]) == {"city": "Paris", "days": {"from": 1}}
    assert "<tool_call>" not in _content(deltas)
    first = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert deltas[first]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    if size < 10:  # small pieces: the arguments come in several fragments, each as it is written
        assert len([d for d in deltas if "tool_calls" in d]) > 3


def test_text_streams_before_the_answer_ends_and_a_partial_tag_is_held() -> None:
    stream = ToolCallStream(["get_weather"])
    assert stream.feed("Hello there") == [{"content": "Hello there"}]
    assert stream.feed(" <tool") == []  # "<tool" may open a call, and the space may end the text: held
    assert stream.feed("box>") == [{"content": " <toolbox>"}]
    assert stream.close() == []


def test_two_calls_have_their_own_indexes() -> None:
    second = CALL.replace("Paris", "Rome")
    (first, then) = _calls(_run(f"{CALL}\n{second}", 5))
    assert json.loads(first["arguments"])["city"] == "Paris"
    assert json.loads(then["arguments"])["city"] == "Rome"
    assert first["id"] != then["id"]


def test_a_call_of_a_tool_not_offered_is_text_and_arguments_first_come_whole() -> None:
    other = _run(CALL.replace("get_weather", "launch"), 4)
    assert _calls(other) == []
    assert "launch" in _content(other)
    reordered = '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>'
    (call,) = _calls(_run(reordered, 3))
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Oslo"})


def test_a_call_cut_before_its_name_is_dropped_and_after_it_is_left_as_sent() -> None:
    cut = _run('Sure.\n<tool_call>\n{"na', 2)
    assert _content(cut) == "Sure."
    assert _calls(cut) == []
    stream = ToolCallStream(["get_weather"])
    deltas = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    deltas += stream.close()
    (call,) = _calls(deltas)
    assert call["arguments"] == '{"city": "Pa'
    assert stream.called


def test_drop_unclosed_call() -> None:
    assert drop_unclosed_call('Here:\n<tool_call>\n{"name": "get_') == "Here:"
    assert drop_unclosed_call(CALL) == CALL
    assert drop_unclosed_call("plain text") == "plain text"


def test_strict_closes_every_object_it_says_nothing_of() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "string"}}},
            "list": {"type": "array", "items": {"type": "object", "properties": {"b": {"type": "integer"}}}},
            "either": {"anyOf": [{"type": "object", "properties": {}}, {"type": "null"}]},
            "open": {"type": "object", "additionalProperties": True},
            "ref": {"$ref": "#/$defs/thing"},
        },
        "$defs": {"thing": {"type": "object", "properties": {"c": {"const": {"type": "object"}}}}},
    }
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert set(props) == {"properties", "list", "either", "open", "ref"}  # a property named `properties` stays one
    assert props["properties"]["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["either"]["anyOf"][1]
    assert props["open"]["additionalProperties"] is True
    assert closed["$defs"]["thing"]["additionalProperties"] is False
    assert closed["$defs"]["thing"]["properties"]["c"]["const"] == {"type": "object"}  # a value, not a schema
    assert "additionalProperties" not in schema  # the client's schema is left as it came


def test_strict_tools_and_formats_only_when_strict() -> None:
    params = {"type": "object", "properties": {"x": {"type": "string"}}}
    loose = ToolSpec(function=FunctionSpec(name="f", parameters=params))
    assert strict_tool(loose) is loose
    strict = strict_tool(ToolSpec(function=FunctionSpec(name="f", parameters=params, strict=True)))
    assert strict.function.parameters["additionalProperties"] is False
    answer = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=params, strict=True))
    closed = strict_format(answer)
    assert closed is not None
    assert closed.json_schema is not None
    assert closed.json_schema.json_schema["additionalProperties"] is False


def test_a_file_part_on_chat_is_400_naming_its_type() -> None:
    settings = ApiSettings()
    body = {
        "model": settings.public_model_name,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "file", "file": {}}]}],
    }
    with pytest.raises(UnsupportedParameter) as refused:
        accept_chat(json.dumps(body).encode(), settings)
    assert refused.value.http_status == 400
    assert refused.value.param == "messages.0.content.1"
    assert "`file`" in refused.value.message


def test_subtitles() -> None:
    segments = [Segment(start=0.0, end=2.5, text="Hello there."), Segment(start=3661.25, end=3662.0, text="Bye.")]
    assert srt(segments) == (
        "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n2\n01:01:01,250 --> 01:01:02,000\nBye.\n"
    )
    assert vtt(segments) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n01:01:01.250 --> 01:01:02.000\nBye.\n"
    )
