"""A chat-completions request into a stoker job: turns, inputs, parameters, and refusals."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import pytest

from api.chat_intake import accept_chat, on_input_error_header
from stoker.core.errors import (
    InvalidRequest,
    ModelNotFound,
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
    messages = [
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
    assert accept_chat(body, SETTINGS, on_input_error_header("FAIL"))[1].chat.on_input_error == "fail"
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
