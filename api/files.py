"""OpenAI's Files API: `POST /v1/files` (multipart, `purpose=batch`), `GET /v1/files`, `GET /v1/files/{id}`,
`GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`.

An upload streams into the file storage (`api.upload`); its record, in the job store, names its tenant (another
tenant's id is 404, as if it did not exist), when it expires (`STOKER_FILES_TTL_S`), and counts its bytes against
the tenant's stored-files quota. Batches write their output and error files here too (`purpose=batch_output`).
"""

from __future__ import annotations

import time
import unicodedata
from collections.abc import Iterator
from email.utils import encode_rfc2231
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.context import ApiContext, Context
from api.schemas import error_responses
from api.tenancy import within_rate
from api.upload import Uploaded, stream_upload
from stoker.adapters.store.openai_batches import HOLD_LEASE_S, FileRepository
from stoker.core.errors import FileNotFound, InvalidRequest, TenantStorageFull
from stoker.core.openai_batches import FileRecord, new_file_id, now_s

router = APIRouter()
Tenant = Annotated[str, Depends(within_rate)]

#: How far ahead of an upload's bytes it holds room in its tenant's quota: one round trip to the store per step.
HOLD_STEP_BYTES = 8 * 1024 * 1024


@router.post("/v1/files", response_model=FileRecord, responses=error_responses(401, 404, 413, 415, 422, 429))
async def create_file(request: Request, context: Context, tenant: Tenant) -> FileRecord:
    """Store an uploaded file (for a batch's input: `purpose=batch`), streamed as it arrives.

    The upload holds room in the tenant's quota a step ahead of its bytes (`QuotaHold`), so uploads in parallel
    never pass the quota together; the room is the file's once it is recorded, and free again if it is not."""
    settings, files = context.settings, context.store.files
    most = settings.files_tenant_max_count
    if most > 0 and await run_in_threadpool(files.count, tenant) >= most:
        raise TenantStorageFull(f"the tenant stores {most} files, as many as it may: delete some first")
    file_id = new_file_id()
    hold = QuotaHold(files, tenant, file_id, settings.files_tenant_max_bytes)
    try:
        await hold.cover(0)
        upload = await _stored_upload(request, context, file_id, hold)
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
        if not await run_in_threadpool(files.put, record, hold.quota, most):
            context.files.delete(file_id)  # the tenant's files filled up meanwhile (a lapsed hold, or their count)
            raise TenantStorageFull("the tenant's stored files would pass their quota")
    except Exception:  # a cancelled upload (the server stopping) leaves its hold to lapse
        await run_in_threadpool(hold.release)
        raise
    return record


async def _stored_upload(request: Request, context: ApiContext, file_id: str, hold: QuotaHold) -> Uploaded:
    """The upload streamed into the file storage as `file_id` and checked (its purpose, its lines); nothing kept
    when it is refused."""
    settings = context.settings
    with context.files.create(file_id) as writer:
        upload = await stream_upload(request, writer, settings.files_max_bytes, hold.cover)
        if upload.fields.get("purpose") != "batch":
            raise InvalidRequest("purpose must be `batch` (the only use of files here)", param="purpose")
        if upload.lines > settings.batch_max_requests:
            message = f"a batch input file may hold at most {settings.batch_max_requests} lines"
            raise InvalidRequest(message, param="file")
    return upload


class QuotaHold:
    """Room one upload holds in its tenant's stored-files quota (`quota` bytes; 0: none), a step ahead of its
    bytes as they stream in and renewed before its lease lapses."""

    def __init__(self, files: FileRepository, tenant: str, file_id: str, quota: int) -> None:
        self.files, self.tenant, self.file_id, self.quota = files, tenant, file_id, quota
        #: Bytes held now.
        self.held = -1
        self._renew_at = 0.0

    async def cover(self, size: int) -> None:
        """Hold room for the upload's `size` bytes so far (TenantStorageFull when the quota has none left)."""
        if self.quota == 0 or (size <= self.held and time.monotonic() < self._renew_at):
            return
        asked = size + HOLD_STEP_BYTES
        held = await run_in_threadpool(self.files.hold, self.tenant, self.file_id, size, asked, self.quota)
        if held < 0:
            raise TenantStorageFull("the tenant's stored files would pass their quota: delete some first")
        self.held, self._renew_at = held, time.monotonic() + HOLD_LEASE_S / 2

    def release(self) -> None:
        """The upload was not recorded: the room it held is free again."""
        if self.held >= 0:
            self.files.release(self.tenant, self.file_id)


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
    headers = {"Content-Length": str(record.bytes), "Content-Disposition": attachment(record.filename)}
    return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)


def attachment(filename: str) -> str:
    """A Content-Disposition naming a download `filename` whatever its characters (RFC 6266): the name itself,
    percent-encoded as UTF-8 (`filename*`, RFC 5987, the standard library's `encode_rfc2231`), and an ASCII
    fallback for clients without it, where nothing can end the quoted string or the header."""
    ascii_name = unicodedata.normalize("NFKD", filename).encode("ascii", "ignore").decode()
    fallback = "".join(c if c.isalnum() or c in "._- " else "_" for c in ascii_name).strip() or "download"
    return f'attachment; filename="{fallback}"; filename*={encode_rfc2231(filename, "utf-8")}'


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
