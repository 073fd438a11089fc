"""A chat through stoker to an OpenAI-compatible server (the fake one, on loopback): client → stoker → server."""

from __future__ import annotations

import base64
import copy
import io
from collections.abc import Iterator
from typing import Any, cast

import openai
import pytest
from openai.types.chat import (
    ChatCompletionContentPartParam,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
    ChatCompletionNamedToolChoiceParam,
)
from openai.types.shared_params import ResponseFormatJSONSchema
from PIL import Image

from api.app import create_app
from stoker.core.media import content_hash
from stoker.settings import ApiSettings
from tests.fakeopenai import FakeServer
from tests.fleet import Fleet
from tests.media import speech_wav, text_image
from tests.serving import serve

MODEL = ApiSettings().public_model_name


@pytest.fixture(scope="module")
def chain(vlm_fleet: tuple[FakeServer, Fleet]) -> Iterator[tuple[FakeServer, openai.OpenAI]]:
    """The fake server behind the fleet serving the tiny VLM (`vlm_fleet`), and stoker's API over HTTP with the
    official client in front."""
    fake, fleet = vlm_fleet
    with serve(create_app(_settings(fleet))) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        with client:
            yield fake, client


def _settings(fleet: Fleet) -> ApiSettings:
    env = fleet.env
    return ApiSettings(
        broker_url=env["STOKER_BROKER_URL"],
        result_url=env["STOKER_RESULT_URL"],
        cache_url=env["STOKER_CACHE_URL"],
        auth=False,
    )


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _sent(fake: FakeServer, marker: str) -> dict[str, Any]:
    """The body the fake received whose last turn mentions marker."""
    return next(b for b in fake.bodies if marker in str(b["messages"]))


def test_the_server_gets_the_whole_chat_a_resized_picture_and_the_parameters(
    chain: tuple[FakeServer, openai.OpenAI],
) -> None:
    fake, client = chain
    upload = text_image("TOTAL 99", size=(1600, 400))
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You read documents."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Keep this page (marker-one)."},
                {"type": "image_url", "image_url": {"url": _data_url(upload)}},
            ],
        },
        {"role": "assistant", "content": "Kept."},
        {"role": "user", "content": "What is the total?"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=7, temperature=0.3, top_p=0.9, stop=["END"], seed=11
    )
    assert answer.choices[0].message.content == "fake saw 0 image(s)"  # the last turn has no picture
    body = _sent(fake, "marker-one")
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["stop"], body["seed"]) == (
        7,
        0.3,
        0.9,
        ["END"],
        11,
    )
    system, first, assistant, last = body["messages"]
    assert system == {"role": "system", "content": "You read documents."}  # as sent, nothing added
    assert first["role"] == "user"
    text, picture = first["content"]
    assert text["text"] == "Keep this page (marker-one)."  # a model that sees reads the page itself: no OCR text
    png = base64.b64decode(picture["image_url"]["url"].split(",", 1)[1])
    # At the served model's own size (its processor's longest edge, 1024), not a thumbnail of the 1600×400 upload;
    # named by the upload's content hash.
    assert Image.open(io.BytesIO(png)).size == (1024, 256)
    assert picture["uuid"] == content_hash(upload)
    assert assistant == {"role": "assistant", "content": "Kept."}
    assert last["role"] == "user"
    assert last["content"].endswith("What is the total?")


def test_a_transcript_reaches_the_server(chain: tuple[FakeServer, openai.OpenAI]) -> None:
    fake, client = chain
    audio = base64.b64encode(speech_wav()).decode()
    content: list[ChatCompletionContentPartParam] = [
        {"type": "text", "text": "Who gets the report (marker-two)?"},
        {"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}},
    ]
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
    user = _sent(fake, "marker-two")["messages"][-1]["content"]
    assert "quarterly report" in user.lower()
    assert "Transcript" in user


def test_a_streamed_answer_is_passed_on_piece_by_piece(chain: tuple[FakeServer, openai.OpenAI]) -> None:
    fake, client = chain
    fake.pieces = ["Zwei ", "Stücke ", "und ", "noch ", "eins."]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream it (marker-three)."}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert pieces == fake.pieces
    assert _sent(fake, "marker-three")["stream"] is True
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]  # the server's own finish reason
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 5


WEATHER: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_a_tool_offering_stream_streams_its_text_and_its_call(chain: tuple[FakeServer, openai.OpenAI]) -> None:
    fake, client = chain
    fake.pieces = ["Es ", "ist ", "sonnig ", "in ", "Oslo."]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather, in words (marker-tool-text)?"}],
        tools=[WEATHER],
        stream=True,
    )
    chunks = list(stream)
    assert _sent(fake, "marker-tool-text")["stream"] is True  # asked of the server as a stream, not whole
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == "Es ist sonnig in Oslo."
    assert len(pieces) >= 3  # piece by piece, as the server sent them

    forced: ChatCompletionNamedToolChoiceParam = {"type": "function", "function": {"name": "get_weather"}}
    called = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather (marker-tool-call)?"}],
            tools=[WEATHER],
            tool_choice=forced,
            stream=True,
        )
    )
    deltas = [call for c in called if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert [c.choices[0].finish_reason for c in called if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in called if c.choices)  # no markup as text
    assert _sent(fake, "marker-tool-call")["stream"] is True
    first = deltas[0]
    assert first.function is not None
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    fragments = [d.function.arguments for d in deltas if d.function is not None and d.function.arguments]
    assert "".join(fragments) == '{"city": "Oslo"}'
    assert len(fragments) >= 2  # the arguments in fragments, as they came


def test_n_and_logprobs_reach_the_server_and_every_choice_comes_back(chain: tuple[FakeServer, openai.OpenAI]) -> None:
    fake, client = chain
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Two answers (marker-n)."}],
        n=2,
        logprobs=True,
        top_logprobs=3,
    )
    body = _sent(fake, "marker-n")
    assert (body["n"], body["logprobs"], body["top_logprobs"]) == (2, True, 3)
    assert [c.message.content for c in answer.choices] == [
        "fake saw 0 image(s)",
        "fake saw 0 image(s) (choice 1)",
    ]
    for choice in answer.choices:
        assert choice.logprobs is not None
        assert choice.logprobs.content is not None
        assert choice.message.content is not None
        assert [t.token for t in choice.logprobs.content] == choice.message.content.split()
        assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)


def test_tools_a_response_format_and_tool_turns_reach_the_server_as_the_client_sent_them(
    chain: tuple[FakeServer, openai.OpenAI],
) -> None:
    fake, client = chain
    weather: ChatCompletionFunctionToolParam = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            "strict": True,
        },
    }
    forced: ChatCompletionNamedToolChoiceParam = {"type": "function", "function": {"name": "get_weather"}}
    asked: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather (marker-tools)?"}]
    answer = client.chat.completions.create(model=MODEL, messages=asked, tools=[weather], tool_choice=forced)
    body = _sent(fake, "marker-tools")
    # strict: true closes the schema's objects (OpenAI's rule, applied once at intake), so the server is held to the
    # schema the client's strict tool means: additionalProperties false, the rest as sent.
    closed = copy.deepcopy(weather)
    closed["function"]["parameters"] = {**weather["function"]["parameters"], "additionalProperties": False}
    assert (body["tools"], body["tool_choice"]) == ([closed], forced)
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert isinstance(call, ChatCompletionMessageFunctionToolCall), call
    assert (call.id, call.function.name, call.function.arguments) == ("call_fake", "get_weather", '{"city": "Oslo"}')

    schema: dict[str, object] = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    answer_format: ResponseFormatJSONSchema = {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": schema, "strict": True},
    }
    # The call as the client received it, sent back as is: a dump of openai's tool call has its param's shape.
    called = cast(ChatCompletionMessageFunctionToolCallParam, call.model_dump())
    client.chat.completions.create(
        model=MODEL,
        response_format=answer_format,
        tools=[weather],
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [called]},
            {"role": "tool", "tool_call_id": "call_fake", "content": "sunny (marker-format)"},
        ],
    )
    body = _sent(fake, "marker-format")
    strict_schema = {**schema, "additionalProperties": False}
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {**answer_format["json_schema"], "schema": strict_schema},
    }
    assert "tool_choice" not in body
    assistant, result = body["messages"][-2:]
    assert assistant["tool_calls"] == [call.model_dump()]
    assert (result["role"], result["tool_call_id"], result["content"]) == ("tool", "call_fake", "sunny (marker-format)")
