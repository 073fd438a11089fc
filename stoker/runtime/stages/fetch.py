"""The fetch stage of a URL input: a worker (never the API) downloads it without SSRF and sniffs it like an upload.

The bytes are stored by content hash like uploaded ones, and the input's usual branch reads them from there.
"""

from __future__ import annotations

from typing import Any

from stoker.adapters import urlfetch
from stoker.adapters.urlfetch import FetchPolicy
from stoker.core.errors import FetchFailed, FetchUnavailable, StorageQuotaExceeded, UnsupportedMediaType
from stoker.core.jobs import InputRecord
from stoker.core.media import KIND_FORMATS, content_hash, sniff_format
from stoker.core.tenancy import DEFAULT_TENANT
from stoker.runtime.context import WorkerContext
from stoker.runtime.stage import last_try, run_input_stage, time_limit


def run_fetch(ctx: WorkerContext, job_id: str, ref: str) -> dict[str, Any]:
    """Download a URL input, check that its content is the declared kind, and store it for the stages after."""
    return run_input_stage(ctx, job_id, ref, "fetch", _fetch, opens_job=True, done=_downloaded)


def _downloaded(record: InputRecord) -> bool:
    """A redelivered message whose download was already stored has nothing left to do."""
    return bool(record.content_hash)


def _fetch(ctx: WorkerContext, job_id: str, record: InputRecord) -> None:
    data = download(record, ctx.fetch_policy)
    if sniff_format(record.kind, data) is None:
        allowed = ", ".join(KIND_FORMATS[record.kind])
        raise UnsupportedMediaType(f"the content at the URL is not {record.kind} in an allowed format ({allowed})")
    store = ctx.store
    # Counted against the tenant's stored bytes like an upload: a small request must not make a worker store a lot.
    tenant = store.jobs.tenant(job_id) or DEFAULT_TENANT
    if not store.tenants.charge_bytes(tenant, job_id, len(data)):
        raise StorageQuotaExceeded(f"storing these {len(data)} bytes would pass the input bytes its tenant may hold")
    digest = content_hash(data)
    store.blobs.put_blob(digest, data, job_id)
    record.content_hash, record.size_bytes = digest, len(data)


def download(record: InputRecord, policy: FetchPolicy) -> bytes:
    """The bytes at the record's URL, within the fetch caps (and the stage's own time limit, whatever blocks).

    A temporary failure is retried (the task's retries); on the last try it fails the input as fetch_failed instead.
    """
    try:
        with time_limit(policy.timeout_s, "fetch"):
            return urlfetch.fetch(record.url or "", policy)
    except FetchUnavailable as exc:
        if last_try():
            raise FetchFailed(exc.message) from exc
        raise
