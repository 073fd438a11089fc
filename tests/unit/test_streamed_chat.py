"""The `openai` backend's streamed chat answer (`StreamedChat`): what it hands on piece by piece, read by the API's
`ToolCallStream` as the local model's pieces are, and the whole answer it makes at the end."""

from __future__ import annotations

import json
from typing import Any

from stoker.adapters.backends.chat_answers import StreamedChat
from stoker.core.tool_stream import ToolCallStream


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _call(index: int, *, name: str | None = None, arguments: str = "", id_: str | None = None) -> dict[str, Any]:
    """One `tool_calls` delta as vLLM and OpenAI stream it: the first with the call's id, type and name."""
    function: dict[str, Any] = {"arguments": arguments}
    entry: dict[str, Any] = {"index": index, "function": function}
    if name is not None:
        function["name"] = name
        entry.update(id=id_ or f"call_{index}", type="function")
    return {"tool_calls": [entry]}


def _relay(chunks: list[dict[str, Any]], tools: list[str]) -> tuple[StreamedChat, list[list[dict[str, Any]]]]:
    """The chunks through the backend's reassembly and the API's reading: the deltas each server chunk made."""
    answer, reader, made = StreamedChat(), ToolCallStream(tools), []
    for chunk in chunks:
        made.append(reader.feed(answer.add(chunk)))
    made.append(reader.feed(answer.rest()) + reader.close())
    return answer, made


def test_text_of_a_tool_offering_answer_streams_piece_by_piece() -> None:
    pieces = ["It is ", "sunny ", "in Oslo."]
    chunks = [_chunk({"role": "assistant"}), *(_chunk({"content": p}) for p in pieces), _chunk({}, "stop")]
    answer, made = _relay(chunks, ["get_weather"])
    sent = [d["content"] for deltas in made for d in deltas]
    assert "".join(sent) == "It is sunny in Oslo."
    assert len(sent) >= 2  # not whole at the end: the first piece went out with its chunk
    assert made[1] == [{"content": "It is"}]
    prediction = answer.prediction()
    assert (prediction.text, prediction.finish_reason, prediction.tool_calls) == ("It is sunny in Oslo.", "stop", None)


def test_calls_stream_as_a_name_then_argument_fragments_and_the_answer_has_them_whole() -> None:
    fragments = ['{"city"', ': "Os', 'lo"}']
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk(_call(0, name="get_weather", id_="call_a")),
        *(_chunk(_call(0, arguments=f)) for f in fragments),
        _chunk(_call(1, name="get_time", arguments='{"zone": "CET"}', id_="call_b")),
        _chunk({}, "tool_calls"),
        {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 9}},
    ]
    answer, made = _relay(chunks, ["get_weather", "get_time"])
    opened = made[1]
    assert len(opened) == 1
    (entry,) = opened[0]["tool_calls"]
    assert (entry["index"], entry["type"]) == (0, "function")
    assert entry["function"] == {"name": "get_weather", "arguments": ""}
    deltas = [d["tool_calls"][0] for deltas in made for d in deltas]
    assert not any("content" in d for deltas in made for d in deltas)
    first = "".join(d["function"]["arguments"] for d in deltas if d["index"] == 0)
    assert json.loads(first) == {"city": "Oslo"}
    assert first == "".join(fragments)
    assert len([d for d in deltas if d["index"] == 0 and d["function"]["arguments"]]) >= 2  # in fragments
    second = [d for d in deltas if d["index"] == 1]
    assert second[0]["function"]["name"] == "get_time"
    assert "".join(d["function"]["arguments"] for d in second) == '{"zone": "CET"}'

    prediction = answer.prediction()
    assert prediction.finish_reason == "tool_calls"
    assert prediction.tool_calls == [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
    ]
    assert (prediction.text, prediction.prompt_tokens, prediction.completion_tokens) == ("", 12, 9)


def test_a_call_cut_by_the_limit_is_no_call() -> None:
    chunks = [_chunk(_call(0, name="get_weather")), _chunk(_call(0, arguments='{"ci')), _chunk({}, "length")]
    answer, made = _relay(chunks, ["get_weather"])
    assert not any("content" in d for deltas in made for d in deltas)  # no raw markup reaches the client
    prediction = answer.prediction()
    assert (prediction.finish_reason, prediction.tool_calls, prediction.text) == ("length", None, "")
