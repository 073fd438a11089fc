"""The Responses API as plain values: a request made the chat it runs as, a job's answer made a `response`, and a
streamed response's events in order."""

from __future__ import annotations

import json
from typing import Any

import pytest

from api.responses import accept_response
from stoker.core.errors import UnsupportedParameter
from stoker.core.jobs import ErrorInfo, InputRecord, Job, ResultInfo
from stoker.core.response_events import ResponseEvents
from stoker.core.responses import ResponseCreate, answered, as_history, finished, input_messages, response_object
from stoker.settings import ApiSettings

MODEL = ApiSettings().public_model_name
PICTURE = "data:image/png;base64,iVBORw0KGgo="
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _request(**fields: Any) -> ResponseCreate:
    return ResponseCreate.model_validate({"model": MODEL, "input": "Hi.", **fields})


def _result(text: str = "Hello", finish: str = "stop", calls: list[dict[str, Any]] | None = None) -> ResultInfo:
    return ResultInfo(
        text=text, model=MODEL, prompt_tokens=7, completion_tokens=3, finish_reason=finish, tool_calls=calls
    )


def test_a_string_input_is_one_user_turn_after_the_instructions() -> None:
    chat = _request(instructions="Be brief.", max_output_tokens=9, temperature=0.5, top_p=0.9).as_chat([])
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"]) == (9, 0.5, 0.9)
    assert "tools" not in chat
    assert "response_format" not in chat


def test_items_become_turns_with_their_media_and_calls() -> None:
    given: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Look."}, {"type": "input_image", "image_url": PICTURE}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    messages = input_messages(given)
    assert messages[0] == {
        "role": "user",
        "content": [{"type": "text", "text": "Look."}, {"type": "image_url", "image_url": {"url": PICTURE}}],
    }
    assistant = messages[1]
    assert assistant["content"] == [{"type": "text", "text": "Let me check."}]
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_1", "call_2"]
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]


def test_a_readable_file_is_its_medium_and_an_audio_part_passes_on() -> None:
    wav = {"type": "input_file", "filename": "a.wav", "file_data": "data:audio/wav;base64,UklGRg=="}
    by_url = {"type": "input_file", "file_url": "https://example.com/clip.mp4"}
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    (message,) = input_messages([{"role": "user", "content": [wav, by_url, audio]}])
    assert [part["type"] for part in message["content"]] == ["audio_url", "video_url", "input_audio"]


@pytest.mark.parametrize(
    ("item", "named"),
    [
        (
            {"role": "user", "content": [{"type": "input_file", "file_data": "data:application/pdf;base64,JVBE"}]},
            "application/pdf",
        ),
        ({"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}, "`input_image` by `file_id`"),
        ({"type": "item_reference", "id": "msg_1"}, "`item_reference`"),
        ({"type": "reasoning", "summary": []}, "`reasoning`"),
    ],
)
def test_what_the_pipeline_cannot_read_is_refused_naming_its_type(item: dict[str, Any], named: str) -> None:
    with pytest.raises(UnsupportedParameter) as refused:
        input_messages([item])
    assert named in refused.value.message
    assert refused.value.http_status == 400


def test_tools_choice_and_text_format_take_the_chats_shapes() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    text = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    chat = _request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, text=text).as_chat([])
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {k: WEATHER[k] for k in ("name", "description", "parameters", "strict")},
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }
    assert _request(text={"format": {"type": "json_object"}}).as_chat([])["response_format"] == {"type": "json_object"}
    with pytest.raises(UnsupportedParameter, match="web_search"):
        _request(tools=[{"type": "web_search"}]).as_chat([])
    with pytest.raises(UnsupportedParameter, match="background"):
        _request(background=True).as_chat([])


def test_the_chat_a_response_runs_as_is_the_chats_job() -> None:
    parsed = _request(input=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], tool_choice="required")
    history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    chat, accepted = accept_response(parsed, history, ApiSettings(), None)
    assert accepted.chat is not None
    assert [t.role for t in accepted.chat.turns] == ["user", "assistant", "user"]
    assert accepted.chat.params.tool_choice == "required"
    assert chat.tools is not None
    assert chat.tools[0].function.name == "get_weather"


def test_an_answer_is_a_response_with_its_items_usage_and_notes() -> None:
    request = _request(metadata={"mine": "1"})
    body = answered("resp_x", 1.0, request, _result("Sure.", "tool_calls", [CALL]), {"stoker_job_id": "x"})
    assert body["status"] == "completed"
    message, call = body["output"]
    assert message["content"][0]["text"] == "Sure."
    assert (call["type"], call["call_id"], call["name"]) == ("function_call", "call_1", "get_weather")
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert body["usage"]["total_tokens"] == 10
    assert body["metadata"] == {"mine": "1", "stoker_job_id": "x"}
    cut = answered("resp_x", 1.0, request, _result("Hel", "length"), {})
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert [item["type"] for item in answered("r", 1.0, request, _result("", "tool_calls", [CALL]), {})["output"]] == [
        "function_call"
    ]


def test_a_degraded_or_failed_job_says_so_in_its_response() -> None:
    broken = InputRecord(
        index=0,
        kind="image",
        content_hash="h",
        size_bytes=1,
        status="failed",
        error=ErrorInfo(code="image_corrupt", message="cut short"),
    )
    job = Job(id="j1", status="degraded", prompt="", inputs=[broken], result=_result())
    assert finished("resp_j1", 1.0, _request(), job)["metadata"] == {
        "stoker_job_id": "j1",
        "stoker_degraded": "image_corrupt",
    }
    failed = Job(id="j2", status="failed", prompt="", inputs=[], error=ErrorInfo(code="boom", message="it broke"))
    body = finished("resp_j2", 1.0, _request(), failed)
    assert (body["status"], body["error"], body["output"]) == ("failed", {"code": "boom", "message": "it broke"}, [])
    cancelled = Job(id="j3", status="cancelled", prompt="", inputs=[])
    assert finished("resp_j3", 1.0, _request(), cancelled)["status"] == "cancelled"


def test_a_response_followed_carries_its_output_on_as_turns() -> None:
    output = answered("r", 1.0, _request(), _result("Hi there", "tool_calls", [CALL]), {})["output"]
    history = as_history([{"role": "user", "content": "Hi."}], output)
    assert history[0] == {"role": "user", "content": "Hi."}
    assert history[1]["role"] == "assistant"
    assert history[1]["content"] == [{"type": "text", "text": "Hi there"}]
    assert history[1]["tool_calls"][0]["id"] == "call_1"


def _events(gated: bool, pieces: list[str], result: ResultInfo) -> list[dict[str, Any]]:
    request = _request()
    events = ResponseEvents(response_object("resp_x", 1.0, request, "in_progress", []), gated=gated)
    sent = events.opening()
    for piece in pieces:
        sent.extend(events.text(piece))
    sent.extend(events.finish(answered("resp_x", 1.0, request, result, {})))
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    return sent


def test_a_streamed_text_opens_its_message_then_sends_deltas_and_ends() -> None:
    sent = _events(False, ["Hel", "lo"], _result("Hello"))
    assert [e["type"] for e in sent] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["delta"] for e in sent if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    assert sent[-1]["response"]["output"][0]["content"][0]["text"] == "Hello"


def test_with_tools_a_calls_markup_is_never_sent_as_text() -> None:
    pieces = ["Let me see. <tool", '_call>\n{"name": "get_weather"', "}\n</tool_call>"]
    sent = _events(True, pieces, _result("Let me see.", "tool_calls", [CALL]))
    deltas = "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta")
    assert "<" not in deltas
    assert deltas.rstrip() == "Let me see."  # the space before the call: sent before the answer was parsed
    kinds = [e["type"] for e in sent]
    assert kinds[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert sent[-5]["item"]["arguments"] == ""
    assert json.loads(sent[-3]["arguments"]) == {"city": "Paris"}


def test_an_answer_not_streamed_is_sent_whole_at_its_end_and_a_cut_one_is_incomplete() -> None:
    sent = _events(True, [], _result("Hel", "length"))
    assert [e["delta"] for e in sent if e["type"] == "response.output_text.delta"] == ["Hel"]
    assert sent[-1]["type"] == "response.incomplete"


def test_with_tools_whitespace_before_a_call_opens_no_message() -> None:
    sent = _events(True, ["\n", '<tool_call>\n{"name": "get_weather"}'], _result("", "tool_calls", [CALL]))
    assert [e["type"] for e in sent][2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert sent[2]["item"]["type"] == "function_call"
