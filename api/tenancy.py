"""Who is calling, and whether they may: API-key authentication and per-tenant limits, as FastAPI dependencies.

Both read only headers, so a refused request is answered before its body is read.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Annotated

import redis
from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from api.context import ApiContext, Context
from stoker.adapters.metrics import ADMISSIONS
from stoker.core.errors import (
    BrokerUnavailable,
    PayloadTooLarge,
    RateLimited,
    StokerError,
    TenantOverShare,
    TenantStorageFull,
    TooManyJobsInFlight,
    Unauthorized,
)
from stoker.core.tenancy import DEFAULT_TENANT, IN_FLIGHT_RETRY_S, LimitVerdict, parse_key, verify

#: The one answer for an unknown, a wrong and a revoked key: nothing tells them apart.
INVALID_KEY = "the API key is not valid"
#: Parses `Authorization: Bearer …` and puts the scheme in the OpenAPI docs; stoker answers a missing key itself.
bearer = HTTPBearer(auto_error=False, description="An API key from `stoker keys create --tenant T`.")


async def authenticate(
    context: Context, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> str:
    """The tenant whose API key came with the request; 401 without a valid one. With auth off: the local tenant."""
    if not context.settings.auth:
        return DEFAULT_TENANT
    return await _verified(context, *_presented(credentials))


async def within_rate(
    context: Context, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> str:
    """The tenant whose API key came with the request, once the request is counted against its rate: 401 without
    a valid key, 429 over the rate. A key whose record this process has read is checked and counted in one round
    trip (`LoopTenants.admit_key`: one script, which counts nothing for a key that does not open); another is read
    first, then counted."""
    if not context.settings.auth:
        return DEFAULT_TENANT
    key_id, secret = _presented(credentials)
    try:
        checked = await context.loop.tenants.admit_key(key_id, secret, context.settings.tenant_limits)
    except redis.RedisError as exc:
        raise BrokerUnavailable("the key store cannot be reached") from exc
    if checked is None:
        tenant = await _verified(context, key_id, secret)
        await admit(context, tenant)
        return tenant
    tenant, verdict = checked
    _enforce(verdict)
    return tenant


def _presented(credentials: HTTPAuthorizationCredentials | None) -> tuple[str, str]:
    """The key id and secret of the key a request came with; 401 without one or with one of another shape."""
    if credentials is None:
        raise Unauthorized("send an API key: Authorization: Bearer <key>")
    parsed = parse_key(credentials.credentials)
    if parsed is None:
        raise Unauthorized(INVALID_KEY)
    return parsed


async def _verified(context: ApiContext, key_id: str, secret: str) -> str:
    """The tenant this key opens, its record read from the store; 401 for an unknown, a wrong or a revoked key."""
    try:
        stored = await context.loop.tenants.get_api_key(key_id)
    except redis.RedisError as exc:
        raise BrokerUnavailable("the key store cannot be reached") from exc
    tenant = verify(secret, stored)
    if tenant is None:  # one answer for an unknown, a wrong and a revoked key
        raise Unauthorized(INVALID_KEY)
    return tenant


async def admit(context: ApiContext, tenant: str, job_id: str | None = None, *, rated: bool = False) -> None:
    """Count a request against the tenant's rate and, for a new job, hold one of its in-flight slots; 429 when
    either limit is reached (nothing counted then). `rated`: the request was counted already (an Idempotency-Key's
    first request is, before it claims the key), so only the slot is held. Limits apply to authenticated tenants
    only."""
    settings = context.settings
    if not settings.auth:
        return
    # The slot is held at most this long before create_job ties it to the job's own deadline.
    hold_s = settings.max_deadline_ms / 1000
    limits = replace(settings.tenant_limits, rate_per_s=0) if rated else settings.tenant_limits  # 0: not counted
    try:
        verdict = await context.loop.tenants.admit_tenant(tenant, limits, job_id, hold_s)
    except redis.RedisError as exc:
        raise BrokerUnavailable("the job store cannot be reached") from exc
    if verdict.outcome != "ok" and job_id is not None:
        ADMISSIONS.labels(f"{verdict.outcome}_limited").inc()  # a refused submission: rate_limited, results_limited, …
    _enforce(verdict)


def _enforce(verdict: LimitVerdict) -> None:
    """Nothing where the request goes ahead; else the error for why not."""
    if verdict.outcome == "rate":
        raise RateLimited(retry_after_s=verdict.retry_after_s)
    if verdict.outcome == "unauthorized":
        raise Unauthorized(INVALID_KEY)
    if verdict.outcome != "ok":
        raise refusal(verdict.outcome, verdict.retry_after_s)


def refusal(outcome: str, retry_after_s: int = IN_FLIGHT_RETRY_S) -> StokerError:
    """The error for a tenant limit a new job hit (every outcome of the store's scripts but "ok" and "rate")."""
    if outcome == "in_flight":
        return TooManyJobsInFlight(retry_after_s=retry_after_s)
    if outcome == "share":
        return TenantOverShare(retry_after_s=retry_after_s)
    if outcome == "bytes":
        return TenantStorageFull(retry_after_s=retry_after_s)
    if outcome == "results":
        message = "this tenant's stored results hold as many bytes as it may keep: come back when some have expired"
        return TenantStorageFull(message, retry_after_s=retry_after_s)
    assert outcome == "too_big", outcome
    return PayloadTooLarge("the job's inputs are more bytes than its tenant may store at once")


async def charge(context: ApiContext, tenant: str, job_id: str, messages: int, stored_bytes: int) -> None:
    """Count an admitted job's queue messages and input bytes against its tenant (auth on); raise if over."""
    settings = context.settings
    if not settings.auth:
        return
    try:
        outcome = await context.loop.tenants.charge_job(tenant, job_id, messages, stored_bytes, settings.tenant_limits)
    except redis.RedisError as exc:
        raise BrokerUnavailable("the job store cannot be reached") from exc
    if outcome != "ok":
        ADMISSIONS.labels(f"{outcome}_limited").inc()
        raise refusal(outcome)


async def release(context: ApiContext, tenant: str, job_id: str) -> None:
    """Give back the in-flight slot of a job that was not accepted after all (its slot lapses anyway if this fails)."""
    if not context.settings.auth:
        return
    with contextlib.suppress(redis.RedisError):
        await run_in_threadpool(context.store.tenants.release_slot, tenant, job_id)
