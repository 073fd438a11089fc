"""A legacy completion (`/v1/completions`): its request as the chat job it runs as, its raw prompt without the chat
template, and its answer's logprobs in the completions shape."""

from __future__ import annotations

import json
import os

import pytest

from api.completion_schemas import completion_chunk, completion_logprobs
from api.completions import accept_completion
from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.backends.tokenizer import load_prompt_tokenizer
from stoker.core.errors import InvalidRequest, ModelUnavailable, UnsupportedParameter
from stoker.core.jobs import ChatTurn
from stoker.core.prompting import build_prompt
from stoker.settings import ApiSettings, CommonSettings

SETTINGS = ApiSettings()
MODEL = SETTINGS.public_model_name


def _body(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Once upon a time", **fields}).encode()


def test_a_completion_is_a_job_of_one_raw_prompt_with_its_parameters() -> None:
    chat, accepted = accept_completion(
        _body(max_tokens=5, temperature=0.5, top_p=0.9, n=2, stop=["\n"], seed=7, logprobs=3, user="u1"), SETTINGS
    )
    assert chat.model == MODEL
    assert accepted.prompt == "Once upon a time"
    assert accepted.chat is not None
    assert [(t.role, t.text) for t in accepted.chat.turns] == [("prompt", "Once upon a time")]
    params = accepted.chat.params
    assert (params.max_tokens, params.temperature, params.top_p, params.n) == (5, 0.5, 0.9, 2)
    assert (params.stop, params.seed, params.logprobs, params.top_logprobs) == (("\n",), 7, True, 3)


def test_a_list_of_one_prompt_is_that_prompt() -> None:
    _, accepted = accept_completion(_body(prompt=["Hello there"]), SETTINGS)
    assert accepted.prompt == "Hello there"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": [[1, 2]]}, "prompt"),
        ({"echo": True}, "echo"),
        ({"suffix": "the end"}, "suffix"),
    ],
)
def test_what_is_not_served_is_refused_400(fields: dict[str, object], param: str) -> None:
    with pytest.raises(UnsupportedParameter) as refused:
        accept_completion(_body(**fields), SETTINGS)
    assert (refused.value.http_status, refused.value.param) == (400, param)


def test_a_streamed_completion_with_logprobs_is_refused_as_a_chat_is() -> None:
    with pytest.raises(InvalidRequest):
        accept_completion(_body(stream=True, logprobs=1), SETTINGS)


def test_logprobs_in_the_completions_shape() -> None:
    entries = [
        {
            "token": "He",
            "logprob": -0.5,
            "top_logprobs": [{"token": "He", "logprob": -0.5}, {"token": "A", "logprob": -1.0}],
        },
        {"token": "llo", "logprob": -0.1, "top_logprobs": []},
    ]
    shaped = completion_logprobs(entries)
    assert shaped.tokens == ["He", "llo"]
    assert shaped.token_logprobs == [-0.5, -0.1]
    assert shaped.top_logprobs == [{"He": -0.5, "A": -1.0}, {"llo": -0.1}]
    assert shaped.text_offset == [0, 2]


def test_a_chunk_is_a_text_completion() -> None:
    body = completion_chunk("cmpl-1", 5, MODEL, "piece")
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "piece", "logprobs": None, "finish_reason": None}]


def test_a_raw_prompt_reaches_the_model_without_the_chat_template() -> None:
    settings = CommonSettings()
    try:
        path = resolve_model(settings.model, settings.model_cache, fetch=False)
    except ModelUnavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    tokenizer = load_prompt_tokenizer(str(path))
    text = "The capital of France is"
    raw = build_prompt(tokenizer, text, [], 1000, [ChatTurn(role="prompt", text=text)])
    assert raw.ids == tokenizer.encode_text(text)
    chat = build_prompt(tokenizer, text, [], 1000, [ChatTurn(role="user", text=text)])
    assert len(chat.ids) > len(raw.ids)
    cut = build_prompt(tokenizer, text, [], 2, [ChatTurn(role="prompt", text=text)], trim=True)
    assert cut.ids == raw.ids[-2:]
