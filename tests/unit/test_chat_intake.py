"""A chat-completions request into a stoker job: turns, inputs, parameters, and refusals."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import pytest

from api.chat_intake import accept_chat, on_input_error_header
from stoker.core.errors import (
    AnswerTooLarge,
    InvalidRequest,
    ModelNotFound,
    PromptTooLong,
    RecordTooLarge,
    StokerError,
    TooManyInputs,
    TooManyTokens,
    UnsupportedMediaType,
)
from stoker.core.model import GenerationParams
from stoker.settings import ApiSettings
from tests.media import speech_wav, text_image

SETTINGS = ApiSettings(max_tokens_cap=100)
MODEL = SETTINGS.public_model_name
PNG = text_image("HI")


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _accept(messages: list[dict[str, Any]], **fields: Any) -> Any:
    return accept_chat(json.dumps({"model": MODEL, "messages": messages, **fields}).encode(), SETTINGS)


def test_turns_media_and_parameters_become_the_job() -> None:
    wav = base64.b64encode(speech_wav("hello")).decode()
    messages: list[dict[str, Any]] = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "See"}, {"type": "image_url", "image_url": {"url": _url(PNG)}}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Seen."}]},
        {
            "role": "user",
            "content": [
                {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
                {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}},
                {"type": "text", "text": "and hear"},
            ],
        },
    ]
    spec, accepted = _accept(messages, max_completion_tokens=100, temperature=0.7, top_p=0.5, stop="END", seed=3)
    assert [(t.role, t.text, t.inputs) for t in accepted.chat.turns] == [
        ("system", "Be brief.", []),
        ("user", "See", [0]),
        ("assistant", "Seen.", []),
        ("user", "and hear", [1, 2]),
    ]
    assert [(i.kind, i.format, i.url) for i in accepted.inputs] == [
        ("image", "PNG", None),
        ("audio", "WAV", None),
        ("video", "", "https://example.com/clip.mp4"),
    ]
    assert accepted.prompt == "and hear"
    assert accepted.chat.params == GenerationParams(max_tokens=100, temperature=0.7, top_p=0.5, stop=("END",), seed=3)
    _, asked = _accept(messages[-1:], n=2, logprobs=True, top_logprobs=5)
    assert (asked.chat.params.n, asked.chat.params.logprobs, asked.chat.params.top_logprobs) == (2, True, 5)
    assert accepted.chat.stream is False
    assert spec.stream is False


def test_unknown_fields_are_logged_once_each_then_dropped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="api.chat_intake")
    spec, accepted = _accept([{"role": "user", "content": "hi"}], logit_bias={"1": 2}, guided_json={}, n=1)
    assert [r.getMessage() for r in caplog.records] == [
        "chat request: unknown field 'logit_bias' ignored",
        "chat request: unknown field 'guided_json' ignored",
    ]
    assert not spec.model_extra
    assert {"logit_bias", "guided_json"}.isdisjoint(spec.model_dump())
    assert accepted.chat.params.greedy


def test_a_chat_without_max_tokens_may_answer_up_to_the_cap_and_one_over_it_is_refused() -> None:
    _, accepted = _accept([{"role": "user", "content": "hi"}])
    assert accepted.chat.params.max_tokens == SETTINGS.max_tokens_cap
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(TooManyTokens) as over:
            _accept([{"role": "user", "content": "hi"}], **{field: SETTINGS.max_tokens_cap + 1})
        assert (over.value.param, over.value.http_status) == (field, 400)
        assert str(SETTINGS.max_tokens_cap) in over.value.message


def test_the_input_error_choice_comes_from_the_body_or_else_the_header() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert _accept(messages)[1].chat.on_input_error == "degrade"
    assert _accept(messages, stoker_on_input_error="fail")[1].chat.on_input_error == "fail"
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    chat = accept_chat(body, SETTINGS, on_input_error_header("FAIL"))[1].chat
    assert chat is not None
    assert chat.on_input_error == "fail"
    with pytest.raises(InvalidRequest):
        on_input_error_header("maybe")
    with pytest.raises(InvalidRequest):
        _accept(messages, stoker_on_input_error="maybe")


@pytest.mark.parametrize(
    ("messages", "fields", "error", "param"),
    [
        ([{"role": "user", "content": "hi"}], {"n": 5}, InvalidRequest, "n"),
        ([{"role": "user", "content": "hi"}], {"n": 2, "stream": True}, InvalidRequest, "body"),
        ([{"role": "user", "content": "hi"}], {"top_logprobs": 2}, InvalidRequest, "body"),
        ([{"role": "user", "content": "hi"}], {"stop": ["a", "b", "c", "d", "e"]}, InvalidRequest, "stop"),
        ([{"role": "system", "content": "only rules"}], {}, InvalidRequest, "messages"),
        ([{"role": "tool", "content": "x"}], {}, InvalidRequest, "messages.0"),
        (
            [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": _url(PNG)}}]}],
            {},
            InvalidRequest,
            "messages.0.content.0",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}]}],
            {},
            InvalidRequest,
            "messages.0.content.0.image_url.url",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(b"not an image")}}]}],
            {},
            UnsupportedMediaType,
            None,
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(PNG)}}] * 5}],
            {},
            TooManyInputs,
            None,
        ),
    ],
)
def test_bad_chats_are_refused_with_their_error(
    messages: list[dict[str, Any]], fields: dict[str, Any], error: type[StokerError], param: str | None
) -> None:
    with pytest.raises(error) as refused:
        _accept(messages, **fields)
    assert type(refused.value) is error
    assert refused.value.param == param


def test_another_model_is_not_found() -> None:
    body = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).encode()
    with pytest.raises(ModelNotFound):
        accept_chat(body, SETTINGS)


@pytest.mark.parametrize("stop", ["x" * 257, ["ok", "y" * 1000], ["a", "b", "c", "d", "e"]])
def test_stop_sequences_are_few_and_short(stop: Any) -> None:
    with pytest.raises(StokerError) as refused:
        _accept([{"role": "user", "content": "Hi."}], stop=stop)
    assert refused.value.http_status == 422
    assert refused.value.param == "stop"


def test_the_core_refuses_long_stop_sequences_whoever_builds_the_parameters() -> None:
    assert GenerationParams(stop=("x" * 256,)).stop == ("x" * 256,)
    with pytest.raises(ValueError, match="256"):
        GenerationParams(stop=("x" * 257,))


def _call(arguments: str, call_id: str = "call_1", name: str = "lookup") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool(description: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function = {"name": "lookup", "description": description, "parameters": parameters or {"type": "object"}}
    return {"type": "function", "function": function}


MEGABYTE = 1 << 20
ASKED = {"role": "user", "content": "What is the weather?"}


@pytest.mark.parametrize(
    ("messages", "fields"),
    [
        # a call's arguments sent back with the chat, without any tools offered
        ([ASKED, {"role": "assistant", "content": None, "tool_calls": [_call("x" * MEGABYTE)]}], {}),
        # the id of the call a tool turn answers
        (
            [
                ASKED,
                {"role": "assistant", "tool_calls": [_call("{}", call_id="c" * MEGABYTE)]},
                {"role": "tool", "tool_call_id": "c" * MEGABYTE, "content": "sunny"},
            ],
            {},
        ),
        # the tools' descriptions and parameters
        ([ASKED], {"tools": [_tool("d" * 4 * MEGABYTE)]}),
        ([ASKED], {"tools": [_tool("", {"type": "object", "description": "p" * MEGABYTE})]}),
        # the answer's schema, which the grammar is compiled from
        (
            [ASKED],
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": {"title": "t" * MEGABYTE}},
                }
            },
        ),
    ],
    ids=["call_arguments", "tool_call_id", "tool_descriptions", "tool_parameters", "response_schema"],
)
def test_every_piece_of_prompt_material_counts_against_the_prompt_limit(
    messages: list[dict[str, Any]], fields: dict[str, Any]
) -> None:
    with pytest.raises(PromptTooLong) as refused:
        _accept(messages, **fields)
    assert (refused.value.code, refused.value.http_status, refused.value.param) == ("prompt_too_long", 422, "messages")
    assert str(SETTINGS.max_prompt_chars) in refused.value.message


def test_prompt_material_is_counted_to_the_character() -> None:
    settings = ApiSettings(max_prompt_chars=100)
    head = [{"role": "user", "content": "hi"}]  # 2 characters
    room = 100 - 2 - len("call_1") - len("lookup")

    def chat(arguments: str) -> bytes:
        turn = {"role": "assistant", "content": None, "tool_calls": [_call(arguments)]}
        return json.dumps({"model": MODEL, "messages": [*head, turn, *head]}).encode()

    _, accepted = accept_chat(chat("a" * (room - 2)), settings)  # the last user turn's 2 characters too
    assert accepted.chat is not None
    assert accepted.chat.turns[1].tool_calls[0]["function"]["arguments"] == "a" * (room - 2)
    with pytest.raises(PromptTooLong):
        accept_chat(chat("a" * (room - 1)), settings)


def test_a_record_too_large_is_refused_at_intake_before_any_prompt_is_built() -> None:
    settings = ApiSettings(max_prompt_chars=8 * MEGABYTE, max_record_bytes=64 * 1024)
    turn = {"role": "assistant", "content": None, "tool_calls": [_call("x" * 100_000)]}
    with pytest.raises(RecordTooLarge) as refused:
        accept_chat(json.dumps({"model": MODEL, "messages": [ASKED, turn, ASKED]}).encode(), settings)
    assert (refused.value.code, refused.value.http_status) == ("record_too_large", 413)


def test_answers_that_could_hold_too_many_token_entries_are_refused_at_intake() -> None:
    settings = ApiSettings(max_tokens_cap=512, max_answer_entries=8192)
    asked = json.dumps(
        {"model": MODEL, "messages": [ASKED], "n": 4, "logprobs": True, "top_logprobs": 20, "max_tokens": 128}
    )
    with pytest.raises(AnswerTooLarge) as refused:
        accept_chat(asked.encode(), settings)
    assert (refused.value.code, refused.value.http_status, refused.value.param) == (
        "answer_too_large",
        400,
        "top_logprobs",
    )
    assert "4 × 128 × 21 = 10752" in refused.value.message
    one = {"model": MODEL, "messages": [ASKED], "logprobs": True, "top_logprobs": 20, "max_tokens": 390}
    _, accepted = accept_chat(json.dumps(one).encode(), settings)  # 390 × 21 = 8190: within
    assert accepted.chat is not None
    assert (accepted.chat.params.top_logprobs, accepted.chat.params.max_tokens) == (20, 390)
    with pytest.raises(AnswerTooLarge) as uncapped:  # no max_tokens: the cap's 512 is what the answer may take
        accept_chat(json.dumps({**one, "max_tokens": None}).encode(), settings)
    assert "1 × 512 × 21" in uncapped.value.message
    many = {"model": MODEL, "messages": [ASKED], "n": 4, "max_tokens": 512}
    with pytest.raises(AnswerTooLarge) as plain:
        accept_chat(json.dumps(many).encode(), ApiSettings(max_tokens_cap=512, max_answer_entries=2047))
    assert plain.value.param == "n"
