"""The frameworks whose defaults speak the Responses API, unchanged, against `/v1/responses` on the real workers and
model: openai-agents' default `Agent` (a forced tool, a structured `output_type`, a streamed run) and pydantic-ai's
`OpenAIResponsesModel`. The model is tiny: a call is forced where a test needs one, and the assertions are on the
protocol (what ran, in what shape), not on what the model knows."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider as AgentsProvider
from openai import AsyncOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from api.app import create_app
from stoker.settings import ApiSettings
from tests.integration.conftest import ROOMY_TOKENS
from tests.serving import serve

MODEL = ApiSettings().public_model_name


@pytest.fixture(scope="module")
def base_url(workers: dict[str, Path]) -> Iterator[str]:
    """The API (auth off), allowing answers long enough for a whole call or JSON object."""
    with serve(create_app(ApiSettings(max_tokens_cap=ROOMY_TOKENS, sse_keepalive_s=0.2))) as base:
        yield f"{base}/v1"


def _client(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def _run_config(client: AsyncOpenAI) -> RunConfig:
    """openai-agents' own provider over the official async client, pointed at stoker; tracing off (it would send
    the traces to OpenAI)."""
    return RunConfig(model_provider=AgentsProvider(openai_client=client), tracing_disabled=True)


async def _run(base_url: str, agent: Agent[None], ask: str) -> Any:
    """The agent's run, its client closed after it."""
    async with _client(base_url) as client:
        return await Runner.run(agent, ask, run_config=_run_config(client))


def test_an_agent_calls_its_forced_tool(base_url: str) -> None:
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    agent = Agent(
        name="weather",
        instructions="Answer questions about the weather.",
        model=MODEL,
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=48),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(_run(base_url, agent, "What is the weather in Paris?"))
    (city,) = called
    assert result.final_output == f"sunny in {city}"
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item"]


class Weather(BaseModel):
    city: str = Field(max_length=12)
    sunny: bool


def test_an_agent_answers_in_its_output_type(base_url: str) -> None:
    agent = Agent(name="weather", model=MODEL, output_type=Weather, model_settings=ModelSettings(max_tokens=40))
    result = asyncio.run(_run(base_url, agent, "Is it sunny in Paris?"))
    assert isinstance(result.final_output, Weather)
    assert len(result.final_output.city) <= 12


def test_an_agent_streams_its_run(base_url: str) -> None:
    # room to end on its own: openai-agents takes a stream that ends `response.incomplete` for an error
    agent = Agent(name="greeter", model=MODEL, model_settings=ModelSettings(max_tokens=ROOMY_TOKENS))

    async def run() -> tuple[list[str], str]:
        async with _client(base_url) as client:
            streamed = Runner.run_streamed(agent, "Say hello in one word.", run_config=_run_config(client))
            events = [event async for event in streamed.stream_events()]
        kinds: list[str] = [event.data.type for event in events if event.type == "raw_response_event"]
        return kinds, str(streamed.final_output)

    kinds, final = asyncio.run(run())
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds
    assert kinds[-1] == "response.completed"
    assert final


def test_pydantic_ai_answers_through_its_responses_model(base_url: str) -> None:
    async def run() -> Any:
        async with _client(base_url) as client:
            model = OpenAIResponsesModel(MODEL, provider=OpenAIProvider(openai_client=client))
            agent = PydanticAgent(model, instructions="Answer briefly.")
            return await agent.run("Say hello.", model_settings={"max_tokens": 6})

    result = asyncio.run(run())
    assert isinstance(result.output, str)
    assert result.output
    assert 1 <= result.usage.output_tokens <= 6
