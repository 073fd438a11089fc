"""API keys, and what each tenant may do: its request rate, its jobs in flight, its share of the queues, its bytes."""

from __future__ import annotations

from pydantic import Field

from stoker.settings.base import MiB, SettingsPart


class TenancySettings(SettingsPart):
    """API keys and the per-tenant limits the API admits jobs under."""

    auth: bool = Field(
        True,
        description="API keys required on /v1 (`Authorization: Bearer <key>`, keys from `stoker keys create`); "
        "`on`/`off`. Off: every job belongs to one tenant, `local`, and the per-tenant limits below do not apply.",
    )
    rate_limit_per_s: float = Field(
        20.0,
        ge=0,
        description="Per tenant: requests per second to /v1 (GCRA, with a burst of `rate_limit_burst`). Over it: "
        "429 `rate_limited` with Retry-After. 0 turns the limit off.",
    )
    rate_limit_burst: int = Field(
        40, ge=1, description="Per tenant: how many /v1 requests may come at once, over the request rate."
    )
    max_jobs_in_flight: int = Field(
        100,
        ge=0,
        description="Per tenant: jobs accepted but not yet ended. Over it: 429 `too_many_jobs_in_flight` with "
        "Retry-After. 0 turns the limit off.",
    )
    tenant_max_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Per tenant: the most of the queues (`cpu_queue_limit` messages) its unfinished jobs may fan "
        "out into while the others are idle; with n tenants busy, 1/n of them where that is less. A tenant over its "
        "share is refused (429 `tenant_over_share`) while the others are still admitted. 0 turns fair share off.",
    )
    idempotency_ttl_s: int = Field(
        86_400,
        ge=60,
        description="A POST with an `Idempotency-Key` header made within this long gets the same job back on a retry.",
    )
    retry_window_s: int = Field(
        60,
        ge=0,
        description="A client's automatic retry (`x-stainless-retry-count` above 0, as the openai client sends) of "
        "a request without an `Idempotency-Key` gets the job an identical request made back, for as long as that "
        "job may run (its deadline) plus this long, instead of a second job; 0: every retry makes a new job.",
    )
    idempotency_claim_s: int = Field(
        60,
        ge=1,
        description="The first request with an `Idempotency-Key` claims it for this long, renewing the claim every "
        "third of it while its body is read and its job written: a request that died mid-intake frees its key this "
        "long after.",
    )
    tenant_max_stored_bytes: int = Field(
        512 * MiB,
        ge=0,
        description="Per tenant: input bytes its unfinished jobs may hold at once, uploads and URL downloads alike "
        "(429 `tenant_storage_full`; a URL download that would pass it fails its input `storage_quota_exceeded`). "
        "0: no cap.",
    )
    tenant_max_result_bytes: int = Field(
        512 * MiB,
        ge=0,
        description="Per tenant: bytes its jobs' stored results may hold together (a quarter of the shipped store's "
        "2 GB `maxmemory`: size it to yours). A result is kept with its job's record, `job_ttl_s` from acceptance, "
        "and counts from the job's end until then; a tenant at the cap is refused new jobs (429 "
        "`tenant_storage_full`, Retry-After: until its first result expires). Jobs already running still store "
        "theirs, so it may be passed by what they hold (each at most `max_result_bytes`). 0: no cap.",
    )
