"""OpenAI's Batch API: `POST /v1/batches`, `GET /v1/batches/{id}`, `GET /v1/batches`, `POST /v1/batches/{id}/cancel`.

Creating a batch only records it (`validating`); the batch feeder (`api.openai_batch_feeder`) checks its input
file, feeds its lines into the pipeline as room appears, collects their outcomes and writes the output and error
files. A batch, like its files, is its tenant's alone: another tenant's id is 404. In code it is an `OpenAIBatch`, so
that a bare "batch" means a device batch (see `stoker.core.openai_batches`).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field, StringConstraints, ValidationError
from starlette.concurrency import run_in_threadpool

from api.context import ApiContext, Context
from api.files import owned_file, page_of
from api.intake import first_error
from api.limits import read_json
from api.schemas import error_responses
from api.tenancy import within_rate
from stoker.core.errors import (
    BatchAlreadyEnded,
    BatchNotFound,
    InvalidRequest,
    StoreFull,
    TooManyBatches,
)
from stoker.core.openai_batches import ENDPOINTS, WINDOWS, OpenAIBatch, new_openai_batch_id, now_s

router = APIRouter()
Tenant = Annotated[str, Depends(within_rate)]

#: OpenAI's limits on a batch's metadata: 16 pairs, keys of 64 characters, values of 512.
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class OpenAIBatchCreate(BaseModel):
    """A batch to run: its input file, the endpoint every line calls, the window it must finish in."""

    input_file_id: str = Field(max_length=128)
    endpoint: str = Field(max_length=128)
    completion_window: str = Field(max_length=16)
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)


#: The body's schema in the OpenAPI document (the route reads the body itself, once the key is checked).
_BODY_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": OpenAIBatchCreate.model_json_schema()}},
    }
}


@router.post(
    "/v1/batches",
    response_model=OpenAIBatch,
    responses=error_responses(401, 404, 413, 422, 429, 503),
    openapi_extra=_BODY_SCHEMA,
)
async def create_batch(request: Request, context: Context, tenant: Tenant) -> OpenAIBatch:
    """Record a batch over one of the tenant's files; it is validated and run in the background.

    The body is read only once the key and the rate let the request in (and the store has room), counted as it
    streams (`read_json`) and parsed off the event loop."""
    settings = context.settings
    full = context.monitor.store_full()
    if full is not None:
        raise StoreFull(f"the job store holds {full.used >> 20} MiB of its {full.limit >> 20} MiB: try again soon")
    spec = await run_in_threadpool(parse_openai_batch_create, await read_json(request, settings.max_json_values))
    source = await owned_file(context, tenant, spec.input_file_id)
    if source.purpose != "batch":
        raise InvalidRequest("the input file must be one uploaded with purpose `batch`", param="input_file_id")
    now = now_s()
    window = min(WINDOWS[spec.completion_window], settings.batch_window_s)
    record = OpenAIBatch(
        id=new_openai_batch_id(),
        endpoint=spec.endpoint,
        input_file_id=source.id,
        completion_window=spec.completion_window,
        status="validating",
        created_at=now,
        expires_at=now + window,
        metadata=spec.metadata,
        tenant=tenant,
    )
    if not await run_in_threadpool(context.store.openai_batches.create, record, settings.batch_tenant_max_live):
        most = settings.batch_tenant_max_live
        raise TooManyBatches(f"the tenant has {most} batches running, as many as it may: wait for one to end")
    return record


def parse_openai_batch_create(body: bytes) -> OpenAIBatchCreate:
    """The request's body as a batch to create (422 `invalid_request` naming the field for anything else)."""
    try:
        spec = OpenAIBatchCreate.model_validate_json(body)
    except ValidationError as exc:
        where, message = first_error(exc)
        raise InvalidRequest(f"{where}: {message}", param=where) from exc
    if spec.endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    if spec.completion_window not in WINDOWS:
        raise InvalidRequest(f"completion_window must be one of {', '.join(WINDOWS)}", param="completion_window")
    return spec


@router.get("/v1/batches", responses=error_responses(401, 429))
async def list_batches(
    context: Context, tenant: Tenant, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None
) -> dict[str, Any]:
    """The tenant's batches, newest first (OpenAI's list shape, paginated by `after`)."""
    found = await run_in_threadpool(context.store.openai_batches.page, tenant, after, limit + 1)
    return page_of(found, limit)


@router.get("/v1/batches/{batch_id}", response_model=OpenAIBatch, responses=error_responses(401, 404, 429))
async def retrieve_batch(batch_id: str, context: Context, tenant: Tenant) -> OpenAIBatch:
    """A batch as it stands: status, timestamps, request counts, output and error files once it ended."""
    return await owned_openai_batch(context, tenant, batch_id)


@router.post("/v1/batches/{batch_id}/cancel", response_model=OpenAIBatch, responses=error_responses(401, 404, 409))
async def cancel_batch(batch_id: str, context: Context, tenant: Tenant) -> OpenAIBatch:
    """Stop a batch: nothing more is fed, what is queued is cancelled, what finished is kept (`cancelling`, then
    `cancelled` with the partial output)."""
    record = await owned_openai_batch(context, tenant, batch_id)
    store = context.store.openai_batches
    moved = await run_in_threadpool(
        lambda: store.move(batch_id, "cancelling", now_s(), only_from=("validating", "in_progress"))
    )
    if not moved and record.status != "cancelling":
        raise BatchAlreadyEnded(f"the batch is {record.status}: it can no longer be cancelled")
    return await owned_openai_batch(context, tenant, batch_id)


async def owned_openai_batch(context: ApiContext, tenant: str, batch_id: str) -> OpenAIBatch:
    """The tenant's batch; 404 when there is none or it is another tenant's."""
    record = await run_in_threadpool(context.store.openai_batches.get, batch_id)
    if record is None or record.tenant != tenant:
        raise BatchNotFound(f"no batch {batch_id}", param="batch_id")
    return record
