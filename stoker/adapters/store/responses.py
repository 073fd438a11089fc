"""Stored responses of the Responses API: one record per (response, tenant), kept for a while so that a later
request may follow it (`previous_response_id`) and a client may read, cancel or delete it."""

from __future__ import annotations

from typing import Any

import redis
from pydantic import BaseModel, Field

from stoker.adapters.store.keys import response_key
from stoker.core.responses import ResponseCreate


class StoredResponse(BaseModel):
    """A response as kept: its request, the conversation up to and including its input, its job, and (once its job
    ended) the `response` object it was answered with."""

    job_id: str
    created_at: float
    request: ResponseCreate
    #: Every turn up to and including this response's input, as chat messages (instructions are not carried on).
    messages: list[dict[str, Any]]
    #: Its own input, as OpenAI's `input_items` lists it.
    input_items: list[dict[str, Any]] = Field(default_factory=list)
    response: dict[str, Any] | None = None


class ResponseRepository:
    """One string per (response, tenant): a tenant never reads, cancels or deletes another's."""

    def __init__(self, client: redis.Redis[bytes], ttl_s: int) -> None:
        self.redis = client
        self.ttl_s = ttl_s

    def put(self, response_id: str, tenant: str, stored: StoredResponse) -> None:
        """Keep (or rewrite) a response for `ttl_s` from now."""
        self.redis.set(response_key(response_id, tenant), stored.model_dump_json(), ex=self.ttl_s)

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The tenant's response, while it is kept."""
        raw = self.redis.get(response_key(response_id, tenant))
        return StoredResponse.model_validate_json(raw) if raw is not None else None

    def delete(self, response_id: str, tenant: str) -> bool:
        """Forget the tenant's response; False if there was none."""
        return bool(self.redis.delete(response_key(response_id, tenant)))
