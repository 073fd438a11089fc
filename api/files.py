"""OpenAI's Files API: `POST /v1/files` (multipart, `purpose=batch`), `GET /v1/files`, `GET /v1/files/{id}`,
`GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`.

An upload streams into the file storage (`api.upload`); its record, in the job store, names its tenant (another
tenant's id is 404, as if it did not exist), when it expires (`STOKER_FILES_TTL_S`), and counts its bytes against
the tenant's stored-files quota. Batches write their output and error files here too (`purpose=batch_output`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.context import ApiContext, Context
from api.schemas import error_responses
from api.tenancy import within_rate
from api.upload import stream_upload
from stoker.core.batchfiles import FileRecord, new_file_id, now_s
from stoker.core.errors import FileNotFound, InvalidRequest, TenantStorageFull

router = APIRouter()
Tenant = Annotated[str, Depends(within_rate)]


@router.post("/v1/files", response_model=FileRecord, responses=error_responses(401, 404, 413, 415, 422, 429))
async def create_file(request: Request, context: Context, tenant: Tenant) -> FileRecord:
    """Store an uploaded file (for a batch's input: `purpose=batch`), streamed as it arrives."""
    settings = context.settings
    file_id = new_file_id()
    quota = settings.files_tenant_max_bytes
    left = None if quota == 0 else quota - await run_in_threadpool(context.store.files.used, tenant)
    if left is not None and left <= 0:
        raise TenantStorageFull("the tenant's stored files hold their whole quota: delete some first")
    with context.files.create(file_id) as writer:
        upload = await stream_upload(request, writer, settings.files_max_bytes, left)
        if upload.fields.get("purpose") != "batch":
            raise InvalidRequest("purpose must be `batch` (the only use of files here)", param="purpose")
        if upload.lines > settings.batch_max_requests:
            message = f"a batch input file may hold at most {settings.batch_max_requests} lines"
            raise InvalidRequest(message, param="file")
    now = now_s()
    record = FileRecord(
        id=file_id,
        bytes=upload.size,
        created_at=now,
        expires_at=now + settings.files_ttl_s,
        filename=upload.filename or "upload.jsonl",
        purpose="batch",
        tenant=tenant,
        lines=upload.lines,
    )
    if not await run_in_threadpool(context.store.files.put, record, quota):
        context.files.delete(file_id)  # a concurrent upload took the room first
        raise TenantStorageFull("the tenant's stored files would pass their quota")
    return record


@router.get("/v1/files", responses=error_responses(401, 429))
async def list_files(
    context: Context,
    tenant: Tenant,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    """The tenant's files, newest first (OpenAI's list shape, paginated by `after`)."""
    found = await run_in_threadpool(context.store.files.page, tenant, after, limit + 1, purpose)
    if order == "asc":
        found.reverse()
    return page_of(found, limit)


@router.get("/v1/files/{file_id}", response_model=FileRecord, responses=error_responses(401, 404, 429))
async def retrieve_file(file_id: str, context: Context, tenant: Tenant) -> FileRecord:
    """A file's record."""
    return await owned_file(context, tenant, file_id)


@router.get("/v1/files/{file_id}/content", responses=error_responses(401, 404, 429))
async def file_content(file_id: str, context: Context, tenant: Tenant) -> StreamingResponse:
    """A file's bytes, streamed from the storage."""
    record = await owned_file(context, tenant, file_id)
    try:
        chunks = context.files.read(record.id)
    except FileNotFoundError as exc:
        raise FileNotFound(f"no file {file_id}") from exc
    headers = {"Content-Length": str(record.bytes), "Content-Disposition": f'attachment; filename="{record.filename}"'}
    return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)


@router.delete("/v1/files/{file_id}", responses=error_responses(401, 404, 429))
async def delete_file(file_id: str, context: Context, tenant: Tenant) -> dict[str, Any]:
    """Delete a file: its record, its bytes, and their weight in the tenant's quota."""
    record = await owned_file(context, tenant, file_id)
    await run_in_threadpool(forget_file, context, record)
    return {"id": record.id, "object": "file", "deleted": True}


async def owned_file(context: ApiContext, tenant: str, file_id: str) -> FileRecord:
    """The tenant's file; 404 when there is none, it expired, or it is another tenant's."""
    record = await run_in_threadpool(context.store.files.get, file_id)
    if record is None or record.tenant != tenant or _expired(record):
        raise FileNotFound(f"no file {file_id}", param="file_id")
    return record


def _expired(record: FileRecord) -> bool:
    return record.expires_at is not None and record.expires_at <= now_s()


def forget_file(context: ApiContext, record: FileRecord) -> None:
    """A file's record and bytes gone."""
    if context.store.files.delete(record):
        context.files.delete(record.id)


def sweep_expired_files(context: ApiContext) -> int:
    """Delete every file whose time is up; how many went."""
    gone = 0
    for file_id in context.store.files.due(now_s()):
        record = context.store.files.get(file_id)
        if record is None:
            context.store.files.forget_due(file_id)
            continue
        forget_file(context, record)
        gone += 1
    return gone


def store_file(context: ApiContext, tenant: str, filename: str, lines: Iterator[bytes]) -> FileRecord:
    """Write a file the service produces (a batch's output or error file), a line at a time, and record it for
    `tenant` (counted in its quota even past it: the results of its own batch are never refused)."""
    file_id, size, count = new_file_id(), 0, 0
    with context.files.create(file_id) as writer:
        for line in lines:
            writer.write(line + b"\n")
            size, count = size + len(line) + 1, count + 1
    now = now_s()
    record = FileRecord(
        id=file_id,
        bytes=size,
        created_at=now,
        expires_at=now + context.settings.files_ttl_s,
        filename=filename,
        purpose="batch_output",
        tenant=tenant,
        lines=count,
    )
    context.store.files.put(record, 0)
    return record


def page_of(items: list[Any], limit: int) -> dict[str, Any]:
    """OpenAI's list shape, from one more item than the page holds (which says whether there are more)."""
    shown = items[:limit]
    return {
        "object": "list",
        "data": [item.model_dump(mode="json") for item in shown],
        "first_id": shown[0].id if shown else None,
        "last_id": shown[-1].id if shown else None,
        "has_more": len(items) > limit,
    }
