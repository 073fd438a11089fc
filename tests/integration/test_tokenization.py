"""vLLM's `/tokenize` and `/detokenize` over HTTP, against the real workers' published pipeline and the model's
tokenizer, behind the key auth."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from fastapi import FastAPI

from api.app import create_app
from api.context import ApiContext
from stoker.adapters.store import Store
from stoker.core.tenancy import issue_key
from stoker.settings import ApiSettings
from tests.serving import serve
from workers.procs import wait_for

MODEL = ApiSettings().public_model_name


def _ready(app: FastAPI) -> bool:
    context: ApiContext = app.state.context
    return context.prompts.loaded and context.cache.context() is not None


@pytest.fixture(scope="module")
def api(workers: dict[str, Path], store_redis: redis.Redis[bytes]) -> Iterator[httpx.Client]:
    """An API with auth on, once its tokenizer is loaded and the workers' pipeline published; a client with a
    tenant's key, and one with a small prompt limit."""
    store = Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600)
    issued = issue_key(f"tokenize-{uuid.uuid4().hex[:8]}", time.time())
    store.tenants.put_api_key(issued.record)
    app = create_app(ApiSettings(auth=True, max_prompt_chars=200))
    with serve(app) as base:
        wait_for(lambda: _ready(app), 60, "the API's tokenizer and the workers' pipeline", [])
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {issued.token}"}, timeout=60) as client:
            yield client


def test_a_prompt_round_trips_and_is_counted_as_a_completion_gets_it(api: httpx.Client) -> None:
    prompt = "The quick brown fox jumps over the lazy dog."
    answer = api.post("/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["count"] == len(body["tokens"]) > 5
    assert body["max_model_len"] > body["count"]
    assert len(body["token_strs"]) == body["count"]
    back = api.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": prompt}


def test_a_chat_is_counted_with_its_template(api: httpx.Client) -> None:
    text = "What is the capital of France?"
    chat = api.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": text}]}).json()
    plain = api.post("/tokenize", json={"prompt": text}).json()
    assert chat["token_strs"] is None
    assert chat["count"] > plain["count"]  # the template's turn markers and the opened assistant turn
    spelled = api.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text in spelled
    assert spelled.index(text) > 0


def test_refusals(api: httpx.Client) -> None:
    unknown = api.post("/tokenize", json={"model": "gpt-4o", "prompt": "hi"})
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "model_not_found")
    too_long = api.post("/tokenize", json={"prompt": "x" * 201})
    assert (too_long.status_code, too_long.json()["error"]["code"]) == (422, "prompt_too_long")
    outside = api.post("/detokenize", json={"tokens": [1, 10**9]})
    assert (outside.status_code, outside.json()["error"]["code"]) == (400, "invalid_token_ids")
    negative = api.post("/detokenize", json={"tokens": [-1]})
    assert negative.status_code == 422
    prefill = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}
    refused = api.post("/tokenize", json=prefill)
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "add_generation_prompt")
    base = str(api.base_url).rstrip("/")
    for path in ("/tokenize", "/detokenize"):
        keyless = httpx.post(f"{base}{path}", json={"prompt": "hi", "tokens": [1]})
        assert (keyless.status_code, keyless.json()["error"]["code"]) == (401, "unauthorized")
