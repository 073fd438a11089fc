"""`/v1/completions` with the official `openai` client, over HTTP, against the real workers and model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from api.app import create_app
from stoker.settings import ApiSettings
from tests.serving import serve

MODEL = ApiSettings().public_model_name


@pytest.fixture(scope="module")
def base_url(workers: dict[str, Path]) -> Iterator[str]:
    """The API (auth off, as `stoker up` runs locally), served over HTTP."""
    with serve(create_app(ApiSettings(sse_keepalive_s=0.2))) as base:
        yield base


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    """The official client, pointed at stoker; no retries, so a refusal surfaces as raised."""
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as official:
        yield official


def test_a_completion_continues_its_prompt_without_the_chat_template(client: openai.OpenAI, base_url: str) -> None:
    prompt = "The capital of France is"
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    answer = raw.parse()
    job_id = raw.headers["x-stoker-job-id"]
    assert (answer.id, answer.object, answer.model) == (f"cmpl-{job_id}", "text_completion", MODEL)
    (choice,) = answer.choices
    assert choice.text
    assert choice.finish_reason in ("stop", "length")
    assert answer.usage is not None
    assert 1 <= answer.usage.completion_tokens <= 4
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1)
    assert chat.usage is not None
    assert answer.usage.prompt_tokens < chat.usage.prompt_tokens  # no template's turn markers around it
    job = httpx.get(f"{base_url}/v1/jobs/{job_id}").json()
    assert [t["role"] for t in job["chat"]["turns"]] == ["prompt"]


def test_a_streamed_completion_comes_in_text_completion_chunks(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert 1 <= chunks[-1].usage.completion_tokens <= 6


def test_n_completions_with_logprobs(client: openai.OpenAI) -> None:
    answer = client.completions.create(
        model=MODEL, prompt="My favourite colour is", max_tokens=3, n=2, temperature=1.0, logprobs=2, seed=1
    )
    assert [c.index for c in answer.choices] == [0, 1]
    counted = 0
    for choice in answer.choices:
        logprobs = choice.logprobs
        assert logprobs is not None
        tokens = logprobs.tokens or []
        assert 1 <= len(tokens) <= 3
        # the answer's text is its tokens', the model's whitespace kept
        assert "".join(tokens) == choice.text
        assert all(lp <= 0 for lp in logprobs.token_logprobs or [])
        assert all(
            token in top and len(top) >= 2 for token, top in zip(tokens, logprobs.top_logprobs or [], strict=True)
        )
        assert logprobs.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        counted += len(tokens)
    assert answer.usage is not None
    assert answer.usage.completion_tokens == counted


def test_what_is_not_served_is_refused_400(client: openai.OpenAI) -> None:
    for fields in ({"echo": True}, {"suffix": "the end"}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1, **fields)
        assert (refused.value.code, refused.value.param) == ("unsupported_parameter", next(iter(fields)))
    with pytest.raises(openai.BadRequestError) as several:
        client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=1)
    assert several.value.param == "prompt"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt="hi", max_tokens=1)
    assert unknown.value.code == "model_not_found"
