"""`/v1/chat/completions` with the official `openai` client, over HTTP, against the real workers and model."""

from __future__ import annotations

import base64
import json
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai.types import CompletionUsage
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionContentPartParam,
    ChatCompletionMessageParam,
)
from pydantic import BaseModel

from api.app import create_app
from api.context import ApiContext
from stoker.adapters.store import Store
from stoker.core.tenancy import issue_key
from stoker.settings import ApiSettings
from tests.fleet import Fleet
from tests.integration.conftest import ROOMY_TOKENS
from tests.media import speech_wav, text_image, truncated
from tests.serving import serve
from workers.procs import wait_for

MODEL = ApiSettings().public_model_name


def data_url(data: bytes, mime: str = "image/png") -> str:
    """A base64 data URL."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _extra(model: BaseModel, name: str) -> Any:
    """A field stoker adds to one of openai's objects (an extra field to the client), in its JSON form."""
    assert model.model_extra is not None, model
    return model.model_extra[name]


def _usage(answer: ChatCompletion | ChatCompletionChunk) -> CompletionUsage:
    """An answer's usage, which stoker always gives (openai types it as optional)."""
    assert answer.usage is not None, answer
    return answer.usage


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


@dataclass
class Secured:
    """A maker of APIs served with auth on and the given settings (each yields its base URL), and a tenant's key."""

    token: str

    def __call__(self, **settings: Any) -> AbstractContextManager[str]:
        return serve(create_app(ApiSettings(auth=True, **settings)))


@pytest.fixture
def secured(workers: dict[str, Path], store_redis: redis.Redis[bytes]) -> Secured:
    """Serves APIs with auth on and the given settings; yields a maker of (base URL, key) pairs."""
    store = Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600)
    issued = issue_key(f"chat-{uuid.uuid4().hex[:8]}", time.time())
    store.tenants.put_api_key(issued.record)
    return Secured(issued.token)


def _ask(client: openai.OpenAI, content: Any, **kwargs: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kwargs
    )


def test_an_image_as_a_data_url_is_read_and_answered(client: openai.OpenAI, base_url: str) -> None:
    parts = [
        {"type": "text", "text": "What does the picture say?"},
        {"type": "image_url", "image_url": {"url": data_url(text_image("RECEIPT 5150")), "detail": "high"}},
    ]
    raw = _ask(client, parts, max_tokens=8)
    answer = raw.parse()
    job_id = raw.headers["x-stoker-job-id"]
    assert answer.id == f"chatcmpl-{job_id}"
    assert answer.object == "chat.completion"
    assert answer.model == MODEL
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")
    usage = answer.usage
    assert usage.completion_tokens <= 8
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    facts = answer.model_extra["stoker"]
    assert (facts["job_id"], facts["status"]) == (job_id, "succeeded")
    (image,) = facts["inputs"]
    assert (image["kind"], image["status"], image["error_code"]) == ("image", "ok", None)
    assert "5150" in image["text"]
    assert facts["timings_ms"]["total"] > 0
    job = httpx.get(f"{base_url}/v1/jobs/{job_id}").json()  # a job like any other
    assert job["status"] == "succeeded"
    assert job["chat"]["turns"] == [{"role": "user", "text": "What does the picture say?", "inputs": [0]}]
    assert job["chat"]["params"]["max_tokens"] == 8


def test_a_truncated_jpeg_still_gets_an_answer_and_says_it_degraded(client: openai.OpenAI, base_url: str) -> None:
    broken = truncated(text_image("CHAT TORN", fmt="JPEG"))
    parts = [{"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": data_url(broken)}}]
    raw = _ask(client, parts, max_tokens=4)
    assert raw.headers["x-stoker-degraded"] == "image_corrupt"  # for clients that drop the stoker object
    answer = raw.parse()
    facts = answer.model_extra["stoker"]
    assert facts["status"] == "degraded"
    assert facts["inputs"][0]["status"] == "failed"
    assert facts["inputs"][0]["error_code"] == "image_corrupt"
    assert answer.choices[0].message.content
    body = {"model": MODEL, "stream": True, "max_tokens": 2, "messages": [{"role": "user", "content": parts}]}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as streamed:
        assert streamed.headers["x-stoker-degraded"] == "image_corrupt"  # the stream starts once inputs are read
        assert [line for line in streamed.iter_lines() if line][-1] == "data: [DONE]"


def test_a_chat_may_ask_to_fail_on_an_unreadable_picture_instead(client: openai.OpenAI, base_url: str) -> None:
    broken = truncated(text_image("FAIL HARD", fmt="JPEG"))
    parts = [{"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": data_url(broken)}}]
    with pytest.raises(openai.UnprocessableEntityError) as failed:
        _ask(client, parts, max_tokens=4, extra_body={"stoker_on_input_error": "fail"})
    assert failed.value.code == "image_corrupt"
    headers = failed.value.response.headers
    assert (headers["x-stoker-degraded"], headers["x-should-retry"]) == ("image_corrupt", "false")
    job = httpx.get(f"{base_url}/v1/jobs/{headers['x-stoker-job-id']}").json()
    assert (job["status"], job["error"]["code"], job["result"], job["batch"]) == ("failed", "image_corrupt", None, None)
    # streamed, asked by header, its picture's failure now cached: refused before the stream starts
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": parts}]}
    fail = {"X-Stoker-On-Input-Error": "fail"}
    streamed = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=fail, timeout=120)
    assert streamed.status_code == 422
    assert streamed.json()["error"]["code"] == "image_corrupt"


def test_audio_is_transcribed_for_the_chat(client: openai.OpenAI) -> None:
    audio = base64.b64encode(speech_wav()).decode()
    parts = [
        {"type": "text", "text": "When is the report due?"},
        {"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}},
    ]
    facts = _ask(client, parts, max_tokens=4).parse().model_extra["stoker"]
    assert facts["status"] == "succeeded"
    assert "friday" in facts["inputs"][0]["text"].lower()


def test_an_image_in_an_earlier_turn_stays_with_its_turn(client: openai.OpenAI, base_url: str) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Answer in one word."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Remember this page."},
                {"type": "image_url", "image_url": {"url": data_url(text_image("PASSWORD SWORDFISH"))}},
            ],
        },
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "What was the password?"},
    ]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4)
    facts = _extra(raw.parse(), "stoker")
    assert facts["status"] == "succeeded"
    assert "SWORDFISH" in facts["inputs"][0]["text"]
    job = httpx.get(f"{base_url}/v1/jobs/{raw.headers['x-stoker-job-id']}").json()
    turns = job["chat"]["turns"]
    assert [(t["role"], t["inputs"]) for t in turns] == [("system", []), ("user", [0]), ("assistant", []), ("user", [])]
    assert job["prompt"] == "What was the password?"


def test_a_streamed_answer_comes_in_chunks_and_ends(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    assert chunks[-1].choices == []
    usage = _usage(chunks[-1])
    assert usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_stop_sequence_ends_a_streamed_answer_at_the_token_that_completes_it(workers: dict[str, Path]) -> None:
    """The answer ends where the stop is completed: no text past it is streamed, and usage counts the tokens up to
    and including the one that completed it (as vLLM counts them), not the `max_tokens` the answer would run to."""
    story: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Write a long story about a dragon and a castle."}
    ]
    with (
        serve(create_app(ApiSettings(max_tokens_cap=ROOMY_TOKENS, sse_keepalive_s=0.2))) as base,
        openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as roomy,
    ):
        whole = roomy.chat.completions.create(model=MODEL, messages=story, max_tokens=ROOMY_TOKENS, logprobs=True)
        choice = whole.choices[0]
        assert choice.logprobs is not None
        text, entries = choice.message.content, choice.logprobs.content
        assert text is not None
        assert entries is not None
        word = text.split()[2]
        through = next(k for k in range(1, len(entries) + 1) if word in "".join(e.token for e in entries[:k]))
        assert through < _usage(whole).completion_tokens // 2  # early in an answer that runs on
        stream = roomy.chat.completions.create(
            model=MODEL,
            messages=story,
            max_tokens=ROOMY_TOKENS,
            stop=[word],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text[: text.index(word)]  # up to the stop, its whitespace kept
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert _usage(chunks[-1]).completion_tokens == through


@pytest.mark.parametrize("api_tokenize", [False, True], ids=["tokenized by a worker", "tokenized by the API"])
def test_a_prompt_over_the_context_is_refused_400_never_cut(workers: dict[str, Path], api_tokenize: bool) -> None:
    """A prompt the model's context has no room for is refused as vLLM refuses it (400, "maximum context length",
    which LiteLLM and LangChain read as a context-window error), where it was cut to fit in silence: by the
    tokenize stage (its job fails, and the chat is answered 400) or by the API that tokenizes it (no job is made)."""
    prompt = "lorem ipsum dolor sit amet " * 1100 + "What was the first word?"  # 29.7k characters
    app = create_app(ApiSettings(api_tokenize=api_tokenize))
    context: ApiContext = app.state.context
    with serve(app) as base:
        if api_tokenize:  # its tokenizer loads, and it learns the workers' pipeline, once it serves
            ready = lambda: context.prompts.loaded and context.cache.context() is not None  # noqa: E731
            wait_for(ready, 60, "the API's tokenizer and the workers' pipeline", [])
            wait_for(lambda: context.monitor.fresh() is not None, 60, "the API's first queue sample", [])
        with (
            openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as official,
            pytest.raises(openai.BadRequestError) as refused,
        ):
            official.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4)
    error = refused.value
    assert (error.status_code, error.code, error.type) == (400, "context_length_exceeded", "invalid_request_error")
    assert "maximum context length" in error.message
    assert ("x-stoker-job-id" in error.response.headers) is not api_tokenize


def test_a_prompt_over_the_context_with_stoker_truncate_is_trimmed_and_says_so(
    client: openai.OpenAI, base_url: str
) -> None:
    prompt = "lorem ipsum dolor sit amet " * 1100 + "What was the first word?"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2, extra_body={"stoker_truncate": True}
    )
    answer = raw.parse()
    assert raw.headers["x-stoker-truncated"] == "true"
    assert answer.usage is not None
    job = httpx.get(f"{base_url}/v1/jobs/{raw.headers['x-stoker-job-id']}").json()
    assert job["chat"]["truncate"] is True
    assert job["result"]["truncated"] is True
    short = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"stoker_truncate": True}
    )
    assert "x-stoker-truncated" not in short.headers  # allowed, not needed


def test_a_stream_with_media_keeps_the_connection_alive_until_its_answer(one_at_a_time: Fleet) -> None:
    """The stream starts once the speech is read; the device (simulated: a second a batch) then takes longer to
    answer than the keep-alive interval, so comments keep the connection alive before the answer."""
    audio = base64.b64encode(speech_wav(f"Stream number {uuid.uuid4().int % 100000}.")).decode()
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 2,
        "messages": [
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}}]}
        ],
    }
    env = one_at_a_time.env
    settings = ApiSettings(
        broker_url=env["STOKER_BROKER_URL"],
        result_url=env["STOKER_RESULT_URL"],
        cache_url=env["STOKER_CACHE_URL"],
        sse_keepalive_s=0.2,
    )
    with (
        serve(create_app(settings)) as base_url,
        httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    data = [line for line in lines if line.startswith("data:")]
    first_content = next(i for i, line in enumerate(lines) if '"content":"' in line and '"content":""' not in line)
    assert any(line.startswith(":") for line in lines[:first_content])  # comments before the answer
    assert '"role":"assistant"' in data[0]
    assert data[-1] == "data: [DONE]"


def test_refusals_raise_the_clients_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as many:
        _ask(client, "hi", n=5)
    assert many.value.code == "invalid_request"
    assert isinstance(many.value.body, dict), many.value.body
    assert many.value.body["type"] == "invalid_request_error"
    assert many.value.response.headers["x-should-retry"] == "false"
    (card,) = client.models.list().data
    cap = _extra(card, "max_tokens_cap")
    with pytest.raises(openai.BadRequestError) as over:  # as vLLM: refused, not silently cut
        _ask(client, "hi", max_completion_tokens=cap + 1)
    assert (over.value.code, over.value.param) == ("max_tokens_over_cap", "max_completion_tokens")
    assert f"at most {cap} new tokens" in over.value.message
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.code == "model_not_found"
    not_an_image = [{"type": "image_url", "image_url": {"url": data_url(b"just some text, no picture")}}]
    with pytest.raises(openai.APIStatusError) as unsupported:
        _ask(client, not_an_image)
    assert (unsupported.value.status_code, unsupported.value.code) == (415, "unsupported_media_type")


def test_n_answers_with_logprobs(client: openai.OpenAI) -> None:
    answer = _ask(client, "Name a colour.", max_tokens=3, n=2, temperature=1.0, logprobs=True, top_logprobs=2).parse()
    assert [c.index for c in answer.choices] == [0, 1]
    counted = 0
    for choice in answer.choices:
        tokens = choice.logprobs.content
        assert 1 <= len(tokens) <= 3
        assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
        counted += len(tokens)
    assert answer.usage.completion_tokens == counted


def test_unknown_fields_are_ignored(client: openai.OpenAI) -> None:
    answer = _ask(client, "Say yes.", max_tokens=2, extra_body={"guided_json": {}, "logit_bias": {}}).parse()
    assert answer.model_extra["stoker"]["status"] == "succeeded"


def test_auth_size_and_rate_refusals(secured: Secured) -> None:
    token = secured.token
    with ExitStack() as stack:
        base = stack.enter_context(secured(max_body_bytes=4096, rate_limit_per_s=0.01, rate_limit_burst=1))
        keyless = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-not-a-stoker-key", max_retries=0)
        with keyless, pytest.raises(openai.AuthenticationError) as denied:
            keyless.models.list()
        assert denied.value.code == "unauthorized"
        keyed = openai.OpenAI(base_url=f"{base}/v1", api_key=token, max_retries=0)
        stack.enter_context(keyed)
        assert [m.id for m in keyed.models.list()] == [MODEL]  # the burst: one request
        big: list[ChatCompletionContentPartParam] = [
            {"type": "image_url", "image_url": {"url": data_url(text_image("BIG") * 4)}}
        ]
        with pytest.raises(openai.APIStatusError) as too_big:  # refused at the door, before any count
            keyed.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": big}])
        assert (too_big.value.status_code, too_big.value.code) == (413, "payload_too_large")
        with pytest.raises(openai.RateLimitError) as limited:
            keyed.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert limited.value.code == "rate_limited"
        assert int(limited.value.response.headers["retry-after"]) >= 1
        assert limited.value.response.headers["x-should-retry"] == "true"


def test_a_client_that_goes_away_gives_its_job_up(base_url: str) -> None:
    audio = base64.b64encode(speech_wav()).decode()
    content = [{"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}}]
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": content}]}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
        job_id = response.headers["x-stoker-job-id"]
        first = next(line for line in response.iter_lines() if line.startswith("data:"))
        assert '"role":"assistant"' in first
    # gone after the role chunk (sent once the audio was transcribed), before the answer
    job = httpx.get(f"{base_url}/v1/jobs/{job_id}", params={"wait": 30}, timeout=40).json()
    assert job["status"] == "cancelled"
    assert job["error"]["code"] == "client_disconnected"
    assert job["result"] is None


def test_a_deadline_that_passes_answers_504(workers: dict[str, Path]) -> None:
    # Speech no test has sent before: transcribing it takes longer than the deadline (a cached transcript of the
    # usual sentence could let the job reach the model, and be answered, within it). No inference reserve: with
    # one, preprocessing is cut off halfway and a fast model may start, and answer `degraded`, before the deadline.
    audio = base64.b64encode(speech_wav(f"The order number is {time.time_ns() % 100000}.")).decode()
    content: list[ChatCompletionContentPartParam] = [
        {"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}}
    ]
    with serve(create_app(ApiSettings(deadline_ms=100, infer_reserve_ms=0))) as base:
        official = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        with official, pytest.raises(openai.InternalServerError) as late:
            official.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
    assert (late.value.status_code, late.value.code) == (504, "deadline_exceeded")


def test_a_retried_chat_with_its_idempotency_key_gets_the_same_answer(client: openai.OpenAI) -> None:
    key = {"Idempotency-Key": str(uuid.uuid4())}
    first = _ask(client, "Say hello.", extra_headers=key)
    again = _ask(client, "Say hello.", extra_headers=key)
    assert first.headers["x-stoker-job-id"] == again.headers["x-stoker-job-id"]  # one job, answered twice
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert again.parse().choices[0].message.content == first.parse().choices[0].message.content
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        _ask(client, "Say goodbye.", extra_headers=key)
    assert refused.value.code == "idempotency_key_reused"


def _jobs_with_prompt(base_url: str, prompt: str) -> list[dict[str, Any]]:
    listed = httpx.get(f"{base_url}/v1/jobs", params={"limit": 20}, timeout=30).json()["data"]
    return [job for job in listed if job["prompt"] == prompt]


def test_a_non_streamed_client_that_goes_away_gives_its_job_up(base_url: str) -> None:
    prompt = f"What is said? {uuid.uuid4().hex[:8]}"
    audio = base64.b64encode(speech_wav("The parcel for the northern office leaves on Tuesday morning.")).decode()
    content = [
        {"type": "text", "text": prompt},
        {"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}},
    ]
    body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}).encode()
    url = httpx.URL(base_url)
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((url.host, url.port), timeout=30) as raw:
        raw.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: bool(_jobs_with_prompt(base_url, prompt)), 30, "the chat's job", [])
        (job,) = _jobs_with_prompt(base_url, prompt)
        assert job["status"] in ("queued", "preprocessing")  # its audio is still being transcribed
    ended = httpx.get(f"{base_url}/v1/jobs/{job['id']}", params={"wait": 30}, timeout=40).json()
    assert (ended["status"], ended["error"]["code"], ended["result"]) == ("cancelled", "client_disconnected", None)


class LosesFirstAnswer:
    """A gateway in front of the API that loses the first chat answer: its client gets a 503 (and retries, as
    the openai client does), though the API made the job and answered."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lost: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions" or self.lost:
            await self.app(scope, receive, send)
            return

        async def swallow(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.lost.append(dict(message["headers"])[b"x-stoker-job-id"].decode())

        await self.app(scope, receive, swallow)
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"bad gateway"})


def test_the_openai_clients_automatic_retry_makes_no_second_job(workers: dict[str, Path]) -> None:
    prompt = f"Say hi. {uuid.uuid4().hex[:8]}"
    gateway = LosesFirstAnswer(create_app(ApiSettings()))
    with serve(gateway) as base:
        retrying = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=2, timeout=120)
        with retrying:
            raw = _ask(retrying, prompt, max_tokens=2)
        assert raw.retries_taken == 1
        assert raw.headers["x-stoker-job-id"] == gateway.lost[0]  # the retry got the first request's job
        assert raw.headers["idempotent-replayed"] == "true"
        assert raw.parse().choices[0].message.content
        assert len(_jobs_with_prompt(base, prompt)) == 1
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as plain:
            again = _ask(plain, prompt, max_tokens=2)  # asked again, not retried: a job of its own
        assert again.headers["x-stoker-job-id"] != gateway.lost[0]
