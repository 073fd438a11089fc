"""Tools, structured outputs and token streaming through `/v1/chat/completions`, with the official `openai` client and
LangChain's `ChatOpenAI`, against the real workers and model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import httpx
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai.types.chat import (
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
    ChatCompletionNamedToolChoiceParam,
)
from pydantic import BaseModel, Field

from api.app import create_app
from stoker.settings import ApiSettings
from tests.integration.conftest import ROOMY_TOKENS
from tests.serving import serve

MODEL = ApiSettings().public_model_name
WEATHER: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
FORCED: ChatCompletionNamedToolChoiceParam = {"type": "function", "function": {"name": "get_weather"}}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base_url(workers: dict[str, Path]) -> Iterator[str]:
    """An API that lets a chat ask for answers as long as the workers allow (a whole call or JSON object)."""
    with serve(create_app(ApiSettings(max_tokens_cap=ROOMY_TOKENS, sse_keepalive_s=0.2))) as base:
        yield base


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as official:
        yield official


def test_a_json_schema_answer_parses_and_validates(client: openai.OpenAI) -> None:
    schema: dict[str, object] = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}},
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "stop"
    data = json.loads(choice.message.content or "")
    assert set(data) == {"city", "sunny"}
    assert isinstance(data["city"], str)
    assert len(data["city"]) <= 12
    assert isinstance(data["sunny"], bool)


def test_a_forced_call_comes_back_as_tool_calls_and_its_result_is_answered(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, max_tokens=48, tools=[WEATHER], tool_choice=FORCED
    )
    answer = raw.parse()
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"}
    job = httpx.get(f"{client.base_url}jobs/{raw.headers['x-stoker-job-id']}").json()
    assert job["result"]["tool_calls"][0]["function"]["name"] == "get_weather"

    # The call as the client received it, sent back as is: a dump of openai's tool call has its param's shape.
    called = cast(ChatCompletionMessageFunctionToolCallParam, call.model_dump())
    followed = client.chat.completions.create(
        model=MODEL,
        max_tokens=6,
        tools=[WEATHER],
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [called]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "clear"}'},
        ],
    )
    (after,) = followed.choices
    assert after.finish_reason in ("stop", "length", "tool_calls")
    assert (after.message.content or "").strip() or after.message.tool_calls
    assert followed.model_extra is not None
    assert followed.model_extra["stoker"]["status"] == "succeeded"


def test_a_required_call_streams_as_a_tool_call_delta(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=48, tools=[WEATHER], tool_choice="required", stream=True
        )
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    first, *fragments = deltas
    assert first.index == 0
    assert first.id
    assert first.function is not None
    assert first.function.name == "get_weather"
    assert fragments  # the arguments follow the name, in fragments as the model writes them
    assert all(d.index == 0 and d.id is None and d.function and d.function.name is None for d in fragments)
    arguments = "".join((d.function.arguments or "") for d in deltas if d.function)
    assert set(json.loads(arguments)) == {"city"}
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_a_schema_that_cannot_be_compiled_or_a_tool_that_is_not_offered_is_400(client: openai.OpenAI) -> None:
    bad: dict[str, object] = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(("}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": bad}},
        )
    assert refused.value.status_code == 400
    assert refused.value.code == "unsupported_schema"
    assert "response_format" in refused.value.message
    assert "unclosed group" in refused.value.message
    elsewhere: ChatCompletionNamedToolChoiceParam = {"type": "function", "function": {"name": "launch"}}
    with pytest.raises(openai.UnprocessableEntityError) as unknown:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=elsewhere)
    assert "launch" in unknown.value.message


def test_a_streamed_answer_arrives_in_pieces_before_its_job_ends(base_url: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about a dragon and a castle."}],
        "max_tokens": 48,
        "stream": True,
    }
    pieces: list[str] = []
    status_at_first_piece = ""
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as response:
        job_id = response.headers["x-stoker-job-id"]
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                piece = choice["delta"].get("content")
                if piece and not pieces:
                    status_at_first_piece = httpx.get(f"{base_url}/v1/jobs/{job_id}").json()["status"]
                if piece:
                    pieces.append(piece)
    assert status_at_first_piece == "inferring"
    assert len(pieces) >= 3
    job = httpx.get(f"{base_url}/v1/jobs/{job_id}").json()
    assert "".join(pieces) == job["result"]["text"]


def test_a_streamed_chat_offering_tools_sends_its_text_while_its_job_infers(base_url: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about a dragon and a castle."}],
        "max_tokens": 48,
        "tools": [WEATHER],
        "stream": True,
    }
    pieces: list[str] = []
    status_at_first_piece = ""
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as response:
        job_id = response.headers["x-stoker-job-id"]
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                assert not choice["delta"].get("tool_calls")
                piece = choice["delta"].get("content")
                if piece and not pieces:
                    status_at_first_piece = httpx.get(f"{base_url}/v1/jobs/{job_id}").json()["status"]
                if piece:
                    pieces.append(piece)
    assert status_at_first_piece == "inferring"
    assert len(pieces) >= 3
    job = httpx.get(f"{base_url}/v1/jobs/{job_id}").json()
    assert "".join(pieces) == job["result"]["text"]


def test_a_forced_call_cut_by_max_tokens_is_length_without_markup(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, tools=[WEATHER], tool_choice=FORCED
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None
    assert "<tool_call>" not in (choice.message.content or "")
    streamed = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=6, tools=[WEATHER], tool_choice=FORCED, stream=True
        )
    )
    assert not any("<tool_call>" in (c.choices[0].delta.content or "") for c in streamed if c.choices)
    finish = [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]


class Weather(BaseModel):
    """A city's weather."""

    city: str = Field(max_length=12)
    sunny: bool


def test_langchain_binds_tools_runs_a_tool_loop_and_gets_structured_output(base_url: str) -> None:
    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"Sunny in {city}, 21 C"

    chat = ChatOpenAI(model=MODEL, base_url=f"{base_url}/v1", api_key="unused", max_tokens=48, max_retries=0)
    question = HumanMessage("What is the weather in Paris?")
    asked = chat.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    (call,) = asked.tool_calls
    assert call["name"] == "get_weather"
    assert isinstance(call["args"]["city"], str)
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answered = chat.bind_tools([get_weather]).invoke([question, asked, result])
    assert answered.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    assert answered.content or answered.tool_calls

    weather = chat.with_structured_output(Weather, method="json_schema").invoke("Weather in Rome?")
    assert isinstance(weather, Weather)
    assert len(weather.city) <= 12


#: litellm, as an application runs it: in a process of its own (it leaves an event loop of its own unclosed, which
#: this test process would otherwise report as a ResourceWarning in a later test).
LITELLM_CALL = """
import json, sys
import litellm

request = json.loads(sys.argv[1])
response = litellm.completion(**request, num_retries=0)
choice = response.choices[0]
calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []]
print(json.dumps({"finish_reason": choice.finish_reason, "calls": calls}))
"""


def test_litellm_gets_the_forced_call(base_url: str) -> None:
    request = {
        "model": f"openai/{MODEL}",
        "api_base": f"{base_url}/v1",
        "api_key": "unused",
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": FORCED,
        "max_tokens": 48,
    }
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # its price list from the package, not the network
    ran = subprocess.run(
        [sys.executable, "-c", LITELLM_CALL, json.dumps(request)], env=env, capture_output=True, text=True, timeout=180
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    answer = json.loads(ran.stdout.strip().splitlines()[-1])
    assert answer["finish_reason"] == "tool_calls"
    (call,) = answer["calls"]
    assert call["name"] == "get_weather"
    assert set(json.loads(call["arguments"])) == {"city"}


def test_a_short_chat_is_answered_while_a_long_answer_is_still_generating(base_url: str, client: openai.OpenAI) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about a dragon and a castle."}],
        "max_tokens": ROOMY_TOKENS,
        "stream": True,
    }
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as response:
        long_job = response.headers["x-stoker-job-id"]
        lines = response.iter_lines()
        next(line for line in lines if '"content":"' in line and '"content":""' not in line)  # it generates
        short = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=2
        )
        long_then = httpx.get(f"{base_url}/v1/jobs/{long_job}").json()
        for _ in lines:  # the long answer to its end
            pass
    assert short.parse().choices[0].message.content
    assert long_then["status"] == "inferring"  # the short chat did not wait for the long answer's batch to end
    long_done = httpx.get(f"{base_url}/v1/jobs/{long_job}").json()
    assert long_done["status"] == "succeeded"
    assert long_done["result"]["completion_tokens"] > 32


def test_answers_keep_the_models_whitespace(client: openai.OpenAI) -> None:
    # a continued sentence's next word comes with its space, which a stripped answer would lose
    answer = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, logprobs=0)
    (choice,) = answer.choices
    assert choice.logprobs is not None
    assert choice.logprobs.tokens is not None
    assert choice.text == "".join(choice.logprobs.tokens)
    assert choice.text.startswith(" ")
    assert choice.text.strip()
