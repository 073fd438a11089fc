"""What one request may cost before it is refused: all of a chat's prompt material counts against the prompt limit
and the record's size before any prompt is built from it, only a short prompt is built on the API's event loop, and
a job's answers are bounded where they are asked for and where they are stored. Over HTTP with the official
`openai` client, against the real workers and model."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
)

import api.prompts
from api.app import create_app
from api.context import ApiContext
from stoker.adapters.store import Store
from stoker.adapters.store.jobs import Ending, NewJob
from stoker.adapters.store.keys import job_key
from stoker.core.deadlines import deadline_for
from stoker.core.jobs import ChoiceInfo, ResultInfo
from stoker.core.prompting import BuiltPrompt, build_prompt
from stoker.settings import ApiSettings
from tests.serving import serve
from workers.procs import wait_for

MODEL = ApiSettings().public_model_name
MEGABYTE = 1 << 20
#: The thread names the API's own tokenizing threads have (`api.prompts.PromptBuilder`).
TOKENIZING_THREAD = "stoker-tokenize"


class Builds:
    """The prompts the API builds, each with the name of the thread it was built on: a wrapper of the real
    `build_prompt` (the seam `api.prompts` calls), which it still calls."""

    def __init__(self, real: Callable[..., BuiltPrompt]) -> None:
        self.real = real
        self.threads: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> BuiltPrompt:
        self.threads.append(threading.current_thread().name)
        return self.real(*args, **kwargs)


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Builds:
    """Every prompt the API builds from now on, and where."""
    recorder = Builds(build_prompt)  # the function `api.prompts` imported
    monkeypatch.setattr(api.prompts, "build_prompt", recorder)
    return recorder


@contextmanager
def serving(**settings: Any) -> Iterator[openai.OpenAI]:
    """An API with these settings (auth off), once it can build prompts itself: its tokenizer loaded and the
    workers' pipeline published. The official client pointed at it, without retries."""
    app = create_app(ApiSettings(**settings))
    with serve(app) as base:
        wait_for(lambda: _ready(app), 60, "the API's tokenizer and the workers' pipeline", [])
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield client


def _ready(app: FastAPI) -> bool:
    context: ApiContext = app.state.context
    return context.prompts.loaded and context.cache.context() is not None


@pytest.fixture(scope="module")
def roomy(workers: dict[str, Path]) -> Iterator[openai.OpenAI]:
    """An API whose prompt limit a deployment raised far past its record's (8M characters; 1 MiB records)."""
    with serving(max_prompt_chars=8 * MEGABYTE) as client:
        yield client


@pytest.fixture(scope="module")
def plain(workers: dict[str, Path]) -> Iterator[openai.OpenAI]:
    """An API with the default limits, but for a cap on new tokens (the tests' 8) that takes the issue's 128."""
    with serving(max_tokens_cap=128) as client:
        yield client


def _call(arguments: str) -> ChatCompletionMessageFunctionToolCallParam:
    return {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}


def _history(arguments: str) -> list[ChatCompletionMessageParam]:
    """A chat whose assistant turn called a function with these arguments (no tools are offered now)."""
    return [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": None, "tool_calls": [_call(arguments)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "found"},
        {"role": "user", "content": "Say done."},
    ]


def _tool(description: str) -> ChatCompletionFunctionToolParam:
    return {"type": "function", "function": {"name": "lookup", "description": description, "parameters": {}}}


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": _history("x" * MEGABYTE)},
        {"messages": _history("{}"), "tools": [_tool("d" * 4 * MEGABYTE)]},
    ],
    ids=["a_megabyte_of_call_arguments", "four_megabytes_of_tool_descriptions"],
)
def test_prompt_material_over_the_limit_is_refused_before_any_prompt_is_built(
    plain: openai.OpenAI, builds: Builds, fields: dict[str, Any]
) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        plain.chat.completions.create(model=MODEL, max_tokens=2, **fields)
    assert (refused.value.code, refused.value.param) == ("prompt_too_long", "messages")
    assert "more than the 32000" in refused.value.message
    assert builds.threads == []  # refused before any of it was rendered or tokenized


def test_a_record_too_large_is_refused_before_any_prompt_is_built(roomy: openai.OpenAI, builds: Builds) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        roomy.chat.completions.create(model=MODEL, max_tokens=2, messages=_history("x" * 4 * MEGABYTE))
    assert (refused.value.status_code, refused.value.code) == (413, "record_too_large")
    assert builds.threads == []


def _stoker(completion: ChatCompletion) -> dict[str, Any]:
    """The `stoker` object stoker adds to a chat completion (an extra field to openai's client)."""
    assert completion.model_extra is not None, completion
    stoker: dict[str, Any] = completion.model_extra["stoker"]
    return stoker


def test_only_a_short_prompt_is_built_on_the_event_loop(roomy: openai.OpenAI, builds: Builds) -> None:
    short = roomy.chat.completions.create(model=MODEL, max_tokens=2, messages=_history("{}"))
    assert _stoker(short)["status"] == "succeeded"
    assert len(builds.threads) == 1
    assert not builds.threads[0].startswith(TOKENIZING_THREAD)  # a short prompt: built on the loop itself
    # a short text, but 3,000 characters of the arguments an earlier call was given (within the model's context)
    long = roomy.chat.completions.create(model=MODEL, max_tokens=2, messages=_history("y " * 1500))
    assert _stoker(long)["status"] == "succeeded"
    assert len(builds.threads) == 2
    assert builds.threads[1].startswith(TOKENIZING_THREAD)


@pytest.mark.parametrize("body", ["form", "json"])
def test_a_jobs_prompt_over_the_limit_is_prompt_too_long_as_a_chats_is(client: TestClient, body: str) -> None:
    limit = ApiSettings().max_prompt_chars
    prompt = "x" * (limit + 1)
    if body == "form":
        response = client.post("/v1/jobs", data={"prompt": prompt})
    else:
        response = client.post("/v1/jobs", json={"prompt": prompt})
    assert response.status_code == 422, response.text
    assert response.json()["error"] == {
        "message": f"the prompt is {limit + 1} characters, more than the {limit} this server takes",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "prompt_too_long",
    }


def test_answers_are_bounded_where_they_are_asked_for_and_stored(
    plain: openai.OpenAI, store_redis: redis.Redis[bytes]
) -> None:
    asked: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Count to ten."}]
    with pytest.raises(openai.BadRequestError) as refused:
        plain.chat.completions.create(model=MODEL, messages=asked, logprobs=True, n=4, top_logprobs=20, max_tokens=128)
    assert (refused.value.code, refused.value.param) == ("answer_too_large", "top_logprobs")
    assert "4 × 128 × 21 = 10752 token entries" in refused.value.message
    answer = plain.chat.completions.with_raw_response.create(
        model=MODEL, messages=asked, logprobs=True, top_logprobs=20, max_tokens=16
    )
    choice = answer.parse().choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.content
    assert all(len(token.top_logprobs) == 20 for token in choice.logprobs.content)
    stored = store_redis.hget(job_key(answer.headers["x-stoker-job-id"]), "result")
    assert stored is not None
    assert len(stored) <= ApiSettings().max_result_bytes


def _job(store: Store) -> str:
    job_id, now = uuid.uuid4().hex, time.time()
    store.jobs.create(job_id, NewJob("Hi.", [], now, deadline_for(now, 60_000, 5_000), 60_000, tenant="t"))
    return job_id


def _answer(logprobs: int) -> ResultInfo:
    """An answer whose two choices carry this many logprob entries each."""
    entries = [{"token": "tok", "logprob": -0.5, "bytes": [116, 111, 107], "top_logprobs": []}] * logprobs
    more = [ChoiceInfo(text="two", logprobs=entries)]
    return ResultInfo(text="one", model="m", prompt_tokens=3, completion_tokens=2, logprobs=entries, more=more)


def test_a_result_over_its_size_limit_is_not_stored_and_its_job_fails(store_redis: redis.Redis[bytes]) -> None:
    store = Store.over(store_redis, blob_ttl_s=60, job_ttl_s=60, max_result_bytes=64 * 1024)
    small, large, alone = _job(store), _job(store), _job(store)
    endings = [
        Ending(small, "t", "succeeded", result=_answer(10)),
        Ending(large, "t", "succeeded", result=_answer(600)),
    ]
    assert store.jobs.finish_many(endings) == [True, True]
    assert store.jobs.finish(alone, "succeeded", result=_answer(600))
    kept = store.jobs.load_job(small)
    assert kept is not None
    assert (kept.status, kept.result) == ("succeeded", _answer(10))
    for job_id in (large, alone):
        failed = store.jobs.load_job(job_id)
        assert failed is not None
        assert (failed.status, failed.result) == ("failed", None)
        assert failed.error is not None
        assert (failed.error.code, failed.error.stage) == ("result_too_large", "infer")
        assert "more than the 65536" in failed.error.message
        assert store_redis.hget(job_key(job_id), "result") is None
