"""`GET /v1/models` and `GET /v1/models/{id}` with the official `openai` client, over HTTP, behind the key auth."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import openai
import pytest
import redis

from api.app import create_app
from stoker.adapters.store import Store
from stoker.core.tenancy import issue_key
from stoker.settings import ApiSettings
from tests.serving import serve


@pytest.fixture(scope="module")
def served(store_redis: redis.Redis[bytes]) -> Iterator[tuple[str, str]]:
    """An API with auth on, serving a model whose public name has a slash, and a tenant's key for it."""
    store = Store.over(store_redis, blob_ttl_s=3600, job_ttl_s=3600)
    issued = issue_key(f"models-{uuid.uuid4().hex[:8]}", time.time())
    store.tenants.put_api_key(issued.record)
    with serve(create_app(ApiSettings(auth=True, served_model_name="org/model-1"))) as base:
        yield base, issued.token


def test_the_served_model_is_retrieved_by_its_id(served: tuple[str, str]) -> None:
    base, token = served
    with openai.OpenAI(base_url=f"{base}/v1", api_key=token, max_retries=0) as client:
        card = client.models.retrieve("org/model-1")
        assert (card.id, card.object, card.owned_by) == ("org/model-1", "model", "stoker")
        assert card.model_extra is not None
        assert card.model_extra["max_tokens_cap"] == ApiSettings().max_tokens_cap
        assert [m.id for m in client.models.list()] == ["org/model-1"]
        with pytest.raises(openai.NotFoundError) as unknown:
            client.models.retrieve("gpt-4o")
    body = unknown.value.body
    assert isinstance(body, dict)
    assert (body["code"], body["param"], body["type"]) == ("model_not_found", "model", "not_found_error")
    assert "gpt-4o" in unknown.value.message


def test_retrieving_a_model_needs_a_key(served: tuple[str, str]) -> None:
    base, _ = served
    with (
        openai.OpenAI(base_url=f"{base}/v1", api_key="sk-not-a-stoker-key", max_retries=0) as keyless,
        pytest.raises(openai.AuthenticationError),
    ):
        keyless.models.retrieve("org/model-1")
