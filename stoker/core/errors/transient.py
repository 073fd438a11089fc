"""Temporary failures (`TransientError`): retried with a delay, answered with Retry-After."""

from __future__ import annotations

from stoker.core.errors.base import TransientError


class Overloaded(TransientError):
    """The queues are full: come back after Retry-After seconds."""

    code = "overloaded"
    http_status = 429


class TenantLimited(TransientError):
    """This tenant is over one of its limits: come back after Retry-After seconds."""

    code = "tenant_limited"
    http_status = 429
    retry_after_s = 1


class RateLimited(TenantLimited):
    """This tenant sent more requests than its rate allows: come back after Retry-After seconds."""

    code = "rate_limited"


class TooManyJobsInFlight(TenantLimited):
    """This tenant has as many unfinished jobs as it may: come back when one has ended."""

    code = "too_many_jobs_in_flight"


class TenantOverShare(TenantLimited):
    """This tenant's unfinished jobs hold its fair share of the queues: come back when some have ended."""

    code = "tenant_over_share"


class TenantStorageFull(TenantLimited):
    """This tenant's unfinished jobs hold as many input bytes as it may store: come back when some have ended."""

    code = "tenant_storage_full"


class TooManyBatches(TenantLimited):
    """This tenant has as many batches running as it may: come back when one has ended."""

    code = "too_many_batches"
    retry_after_s = 60


class BrokerUnavailable(TransientError):
    """The broker or the job store cannot be reached."""

    code = "broker_unavailable"


class StoreFull(TransientError):
    """The job store is nearly full: new jobs wait until running ones end and free their inputs."""

    code = "store_full"


class RenderingLost(TransientError):
    """A picture's rendering left the stage cache before its render was answered: send the render again."""

    code = "rendering_lost"


class IdempotencyKeyInUse(TransientError):
    """A request with this Idempotency-Key is still being taken in: retry in a moment."""

    code = "idempotency_key_in_use"
    http_status = 409
    retry_after_s = 1


class FetchUnavailable(TransientError):
    """The URL's server could not be reached or answered a temporary error; fetching again later may work."""

    code = "fetch_unavailable"


class ServerStopping(TransientError):
    """This API process is stopping and could not wait any longer for the job, which goes on: read its answer at
    `/v1/jobs/{id}` (its id is in the `X-Stoker-Job-Id` header), from any API process."""

    code = "server_stopping"
    retry_after_s = 1


class ModelUnavailable(TransientError):
    """The model is not available yet."""

    code = "model_unavailable"
