"""`/v1/responses` (OpenAI's Responses API) with the official `openai` client, over HTTP, against the real workers and
model: text, a picture, the streamed event sequence, forced calls and a tool loop, `previous_response_id`,
`text.format`, refusals, and stored responses kept per tenant."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from api.app import create_app
from stoker.adapters.store import Store
from stoker.core.tenancy import issue_key
from stoker.settings import ApiSettings
from tests.integration.conftest import ROOMY_TOKENS
from tests.media import text_image, truncated
from tests.serving import serve

MODEL = ApiSettings().public_model_name
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
FORCED: Any = {"type": "function", "name": "get_weather"}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def base_url(workers: dict[str, Path]) -> Iterator[str]:
    """The API (auth off, as `stoker up` runs locally), allowing answers long enough for a whole call."""
    with serve(create_app(ApiSettings(max_tokens_cap=ROOMY_TOKENS, sse_keepalive_s=0.2))) as base:
        yield base


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    """The official client, pointed at stoker; no retries, so a refusal surfaces as raised."""
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as official:
        yield official


def test_a_text_response_is_answered_stored_and_read_back(client: openai.OpenAI, base_url: str) -> None:
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="Say hello.", instructions="Answer briefly.", max_output_tokens=5, temperature=0
    )
    response = raw.parse()
    job_id = raw.headers["x-stoker-job-id"]
    assert (response.id, response.object, response.model) == (f"resp_{job_id}", "response", MODEL)
    assert response.status in ("completed", "incomplete")
    (message,) = response.output
    assert message.type == "message"
    assert [part.type for part in message.content] == ["output_text"]
    assert response.output_text == "".join(p.text for p in message.content if p.type == "output_text")
    assert response.output_text
    assert response.usage is not None
    assert 1 <= response.usage.output_tokens <= 5
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.metadata == {"stoker_job_id": job_id}
    job = httpx.get(f"{base_url}/v1/jobs/{job_id}").json()
    assert [t["role"] for t in job["chat"]["turns"]] == ["system", "user"]
    again = client.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()
    items = client.responses.input_items.list(response.id)
    assert [(i.type, i.role) for i in items.data if i.type == "message"] == [("message", "user")]
    assert len(items.data) == 1
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_a_response_cut_by_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Count from one to fifty in words.", max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.output_tokens == 2


def test_a_picture_is_read_and_answered(client: openai.OpenAI, base_url: str) -> None:
    picture = f"data:image/png;base64,{base64.b64encode(text_image('RECEIPT 5150')).decode()}"
    parts = [
        {"type": "input_text", "text": "What does the picture say?"},
        {"type": "input_image", "image_url": picture, "detail": "auto"},
    ]
    given: Any = [{"role": "user", "content": parts}]
    raw = client.responses.with_raw_response.create(model=MODEL, input=given, max_output_tokens=4)
    assert raw.parse().output_text
    assert "x-stoker-degraded" not in raw.headers
    job = httpx.get(f"{base_url}/v1/jobs/{raw.headers['x-stoker-job-id']}").json()
    (read,) = job["inputs"]
    assert (read["kind"], read["status"]) == ("image", "ok")
    assert "5150" in read["text"]
    assert job["chat"]["turns"] == [{"role": "user", "text": "What does the picture say?", "inputs": [0]}]


def test_an_unreadable_picture_degrades_the_response_in_its_metadata(client: openai.OpenAI) -> None:
    torn = truncated(text_image("RESPONSE TORN", fmt="JPEG"))
    broken = f"data:image/jpeg;base64,{base64.b64encode(torn).decode()}"
    parts: Any = [{"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": broken}]
    raw = client.responses.with_raw_response.create(
        model=MODEL, input=[{"role": "user", "content": parts}], max_output_tokens=3
    )
    response = raw.parse()
    assert raw.headers["x-stoker-degraded"] == "image_corrupt"
    assert response.metadata is not None
    assert response.metadata["stoker_degraded"] == "image_corrupt"  # for frameworks that show no headers
    assert response.output_text


def test_a_stream_sends_the_responses_events_in_order(client: openai.OpenAI) -> None:
    events: list[Any] = list(client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if events[-1].response.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "".join(deltas)
    assert final.usage is not None
    assert 1 <= final.usage.output_tokens <= 6
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_streamed_forced_call_then_its_output_is_a_tool_loop(client: openai.OpenAI) -> None:
    events: list[Any] = list(
        client.responses.create(
            model=MODEL, input=ASK, tools=[WEATHER], tool_choice=FORCED, max_output_tokens=48, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" not in kinds  # a forced call's answer is the call alone
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2].item.arguments == ""
    (call,) = events[-1].response.output
    assert (call.type, call.name) == ("function_call", "get_weather")
    assert events[4].arguments == call.arguments
    assert set(json.loads(call.arguments)) == {"city"}
    assert call.call_id
    loop: Any = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'},
    ]
    raw = client.responses.with_raw_response.create(
        model=MODEL, input=loop, tools=[WEATHER], tool_choice="none", max_output_tokens=6
    )
    answered = raw.parse()
    assert answered.output_text
    assert [item.type for item in answered.output] == ["message"]
    job = httpx.get(f"{client.base_url}jobs/{raw.headers['x-stoker-job-id']}").json()
    turns = job["chat"]["turns"]
    assert [t["role"] for t in turns] == ["user", "assistant", "tool"]
    assert turns[1]["tool_calls"][0]["id"] == call.call_id
    assert turns[2]["tool_call_id"] == call.call_id


def test_previous_response_id_carries_the_conversation_on(client: openai.OpenAI, base_url: str) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.", max_output_tokens=4)
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=4
    )
    assert raw.parse().previous_response_id == first.id
    job = httpx.get(f"{base_url}/v1/jobs/{raw.headers['x-stoker-job-id']}").json()
    turns = job["chat"]["turns"]
    assert [(t["role"], t["text"]) for t in turns] == [  # the first one's instructions are not carried on
        ("user", "My name is Ada."),
        ("assistant", first.output_text),
        ("user", "What is my name?"),
    ]
    unstored = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=unstored.id)
    assert missing.value.code == "response_not_found"


def test_text_format_json_schema_is_followed(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL,
        input=ASK,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}},
    )
    assert response.status == "completed"
    data = json.loads(response.output_text)
    assert set(data) == {"city", "sunny"}
    assert isinstance(data["sunny"], bool)
    assert response.text is not None
    assert response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_an_unsupported_input_type_is_400_naming_it(client: openai.OpenAI) -> None:
    pdf: Any = {"type": "input_file", "filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0="}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [pdf]}])
    assert refused.value.code == "unsupported_parameter"
    assert "application/pdf" in refused.value.message
    with pytest.raises(openai.BadRequestError) as searched:
        client.responses.create(model=MODEL, input="Hi.", tools=[{"type": "web_search"}])
    assert "web_search" in searched.value.message


def test_another_tenant_never_reads_a_stored_response(
    workers: dict[str, Path], store_redis: redis.Redis[bytes]
) -> None:
    store = Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600)
    tokens = []
    for name in ("owner", "other"):
        issued = issue_key(f"responses-{name}-{uuid.uuid4().hex[:8]}", time.time())
        store.tenants.put_api_key(issued.record)
        tokens.append(issued.token)
    with serve(create_app(ApiSettings(auth=True))) as base:
        owner = openai.OpenAI(base_url=f"{base}/v1", api_key=tokens[0], max_retries=0, timeout=120)
        other = openai.OpenAI(base_url=f"{base}/v1", api_key=tokens[1], max_retries=0, timeout=120)
        with owner, other:
            made = owner.responses.create(model=MODEL, input="Say yes.", max_output_tokens=2)
            assert owner.responses.retrieve(made.id).id == made.id
            for attempt in (
                lambda: other.responses.retrieve(made.id),
                lambda: other.responses.delete(made.id),
                lambda: other.responses.input_items.list(made.id),
                lambda: other.responses.create(model=MODEL, input="And?", previous_response_id=made.id),
            ):
                with pytest.raises(openai.NotFoundError):
                    attempt()
            assert owner.responses.retrieve(made.id).output_text == made.output_text


def test_a_response_cancelled_while_it_streams_ends_cancelled(client: openai.OpenAI) -> None:
    asked = "Count from one to one hundred in words, one number per line."
    with client.responses.create(model=MODEL, input=asked, max_output_tokens=ROOMY_TOKENS, stream=True) as stream:
        events: list[Any] = []
        for event in stream:
            events.append(event)
            if event.type == "response.created":  # its id known: cancel it from elsewhere while it runs
                assert client.responses.cancel(event.response.id).status == "cancelled"
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "cancelled"
    assert client.responses.retrieve(events[0].response.id).status == "cancelled"
