"""OpenAI's audio endpoints: `POST /v1/audio/transcriptions` served by stoker's speech stage, and
`POST /v1/audio/translations` and `POST /v1/embeddings` refused with their reason.

A transcription is a stoker job of one audio input that ends at its hand-off, before the model (as a render does:
`Conversation.render`), so it is taken in like a chat (its key, its tenant's rate and slots, 429 under queue
pressure, the deadline and the reaper) and goes through the same stages: probe, then the speech model, its
transcript cached by the recording's content hash in the tenant's scope (a recording sent again is a cache read).
Its answer is the transcript the stage wrote into the job's input record, in the `response_format` asked: `json`,
`text`, `srt`, `vtt` or `verbose_json` (with its timed segments). A recording that cannot be read is a 4xx with its
error code, never an empty transcript.

The speech model is the workers' (`STOKER_ASR_MODEL`): the request's `model` may be the served model's name or
`whisper-1` (OpenAI's, so clients written for OpenAI run unchanged). `language` (a Whisper language code, else 400),
`prompt` (read by the speech model as the text before the recording) and `temperature` (the first try's; the
fallback goes on from there) are carried with the recording to the speech stage, and are part of its transcript's
cache address (a transcript made in one language is never read for another). Word timestamps and streaming are
refused 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, Field, ValidationError
from starlette.datastructures import UploadFile

from api.chat import answer_deadline, job_failure, wait_job
from api.context import ApiContext, Context
from api.disconnects import watching
from api.headers import SHOULD_RETRY, job_headers
from api.intake import AcceptedRequest, first_error, validate_inputs
from api.schemas import error_responses
from api.submission import submit_job
from api.tenancy import authenticate, within_rate
from stoker.core.errors import (
    ClientGone,
    EndpointNotServed,
    InputError,
    InvalidRequest,
    ModelNotFound,
    UnsupportedMediaType,
    UnsupportedParameter,
    error_envelope,
)
from stoker.core.jobs import Conversation, InputRecord, Job, SpeechOptions
from stoker.core.speech_languages import LANGUAGES, language_name
from stoker.core.subtitles import srt, vtt
from stoker.settings import ApiSettings

router = APIRouter()

#: The model name OpenAI's transcriptions take, accepted beside the served model's own.
OPENAI_SPEECH_MODEL = "whisper-1"
#: The form's text fields (`timestamp_granularities[]` as the openai client sends the list).
TEXT_FIELDS = ("model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]", "stream")
ResponseFormat = Literal["json", "text", "srt", "vtt", "verbose_json"]


class TranscriptionCreate(BaseModel):
    """The form's fields other than the file, checked."""

    model: str
    language: str | None = Field(None, max_length=16)
    prompt: str | None = Field(None, max_length=4096)
    response_format: ResponseFormat = "json"
    temperature: float | None = Field(None, ge=0, le=1)
    timestamp_granularities: tuple[Literal["segment", "word"], ...] = ("segment",)
    stream: bool = False


@dataclass
class _Read:
    """What the job's intake read of the form."""

    spec: TranscriptionCreate | None = None
    filename: str | None = None
    parts: list[str] = field(default_factory=list)


@router.post("/v1/audio/transcriptions", responses=error_responses(400, 401, 404, 413, 415, 422, 429, 499, 503, 504))
async def create_transcription(
    request: Request, context: Context, tenant: Annotated[str, Depends(authenticate)]
) -> Response:
    """The recording's transcript, by stoker's speech stage, in OpenAI's shape."""
    read = _Read()

    async def accept() -> AcceptedRequest:
        read.spec, data = await _read_form(request, context.settings)
        return _accepted(data, read.spec, context.settings)

    # no Idempotency-Key: a replayed job would not bring back the format its first request asked for
    job = (await submit_job(context, tenant, None, accept, watched=True)).job
    ended = await _wait(context, request, job, tenant)
    failed = _refusal(ended)
    if failed is not None:
        return failed
    assert read.spec is not None  # a job made without a key is always read
    return _answer(ended, read.spec)


@router.post("/v1/audio/translations", dependencies=[Depends(within_rate)], responses=error_responses(401, 404))
async def create_translation() -> Response:
    """Not served: stoker's speech stage transcribes in the language spoken, it does not translate."""
    raise EndpointNotServed(
        "/v1/audio/translations is not served: stoker's speech model transcribes in the language spoken and does not "
        "translate; use /v1/audio/transcriptions",
    )


@router.post("/v1/embeddings", dependencies=[Depends(within_rate)], responses=error_responses(401, 404))
async def create_embeddings() -> Response:
    """Not served: the model served here is a generative one, with no embedding head."""
    raise EndpointNotServed(
        "/v1/embeddings is not served: stoker serves a generative model, not an embedding model; serve embeddings "
        "from an embedding server (vLLM with an embedding model, or the provider's)",
    )


async def _read_form(request: Request, settings: ApiSettings) -> tuple[TranscriptionCreate, bytes]:
    """The form's fields, checked, and the recording's bytes (the body's size is bounded by `max_body_bytes`)."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise UnsupportedMediaType("send multipart/form-data with the recording as `file`")
    async with request.form(max_files=1, max_fields=len(TEXT_FIELDS) + 4, max_part_size=8192) as form:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("`file` must be the recording, sent as a file", param="file")
        values: dict[str, Any] = {
            name.removesuffix("[]"): form.getlist(name) if name.endswith("[]") else form.get(name)
            for name in TEXT_FIELDS
            if name in form
        }
        data = await upload.read()
    return _spec(values, settings), data


def _spec(values: dict[str, Any], settings: ApiSettings) -> TranscriptionCreate:
    if any(isinstance(v, UploadFile) for v in values.values()):
        raise InvalidRequest("only `file` may be a file")
    try:
        spec = TranscriptionCreate.model_validate(values)
    except ValidationError as exc:
        where, message = first_error(exc)
        raise InvalidRequest(f"{where}: {message}", param=where) from exc
    if spec.model not in (settings.public_model_name, OPENAI_SPEECH_MODEL):
        raise ModelNotFound(f"the model `{spec.model}` does not exist here", param="model")
    if "word" in spec.timestamp_granularities:
        raise UnsupportedParameter(
            "word timestamps are not served: the speech stage keeps segment timings", param="timestamp_granularities"
        )
    if spec.stream:
        raise UnsupportedParameter("a transcription is answered whole, not streamed", param="stream")
    if spec.language and spec.language not in LANGUAGES:
        raise InputError(
            f"language: `{spec.language}` is not a language code the speech model knows (ISO-639-1, as `en`)",
            param="language",
        )
    return spec


def _accepted(data: bytes, spec: TranscriptionCreate, settings: ApiSettings) -> AcceptedRequest:
    """The job: the recording as its one audio input, sniffed by its content, carrying how it is to be
    transcribed; ending before the model."""
    try:
        inputs = validate_inputs([("audio", data)], settings)
    except UnsupportedMediaType as exc:
        raise UnsupportedMediaType(exc.message.replace("input 0", "`file`"), param="file") from exc
    speech = SpeechOptions(language=spec.language or None, prompt=spec.prompt or None, temperature=spec.temperature)
    if speech != SpeechOptions():  # a recording sent with no options has the record it had before they were taken
        inputs = [replace(item, speech=speech) for item in inputs]
    chat = Conversation(turns=[], on_input_error="fail", render=True)
    return AcceptedRequest(prompt="", inputs=inputs, deadline_ms=settings.deadline_ms, chat=chat)


async def _wait(context: ApiContext, request: Request, job: Job, tenant: str) -> Job:
    until = answer_deadline(job, context.settings)
    async with watching(request.receive) as client:
        ended = await wait_job(context, client, job.id, tenant, until)
    if ended is None:
        raise ClientGone(stage="api")
    return ended


def _refusal(job: Job) -> JSONResponse | None:
    """Why an ended transcription has no transcript, or None: a recording that could not be read is a 4xx with its
    code (`param` the file); the deadline or another failure as a chat's would be said."""
    headers = {**job_headers(job), SHOULD_RETRY: "false"}
    failed = next((r for r in job.inputs if r.status == "failed" and r.error is not None), None)
    if job.status == "failed" and failed is not None and failed.error is not None:
        info = failed.error
        body = error_envelope(422, info.code, f"`file`: {info.message}", param="file", stage=info.stage)
        return JSONResponse(body, status_code=422, headers=headers)
    if job.status == "succeeded" and job.inputs and job.inputs[0].status == "ok":
        return None
    status, body = job_failure(job) or (500, error_envelope(500, "internal_error", "the transcription ended unread"))
    return JSONResponse(body, status_code=status, headers=headers)


def _answer(job: Job, spec: TranscriptionCreate) -> Response:
    """The transcript in the format asked."""
    record, headers = job.inputs[0], job_headers(job)
    text, segments = record.text or "", record.segments or []
    if spec.response_format == "text":
        return PlainTextResponse(text, headers=headers)
    if spec.response_format in ("srt", "vtt"):
        subtitles = srt(segments) if spec.response_format == "srt" else vtt(segments)
        return PlainTextResponse(subtitles, headers=headers)
    if spec.response_format == "json":
        return JSONResponse({"text": text}, headers=headers)
    return JSONResponse(_verbose(record, spec), headers=headers)


def _verbose(record: InputRecord, spec: TranscriptionCreate) -> dict[str, Any]:
    """`verbose_json`: the transcript, its language and duration, and its timed segments (each with its id and
    its text; the speech stage keeps no token ids or decoding scores, so those of OpenAI's segment are left out)."""
    features = record.features or {}
    segments = [{"id": i, "start": s.start, "end": s.end, "text": s.text} for i, s in enumerate(record.segments or [])]
    return {
        "task": "transcribe",
        "language": language_name(features.get("language") or spec.language),
        "duration": float(features.get("duration_s", segments[-1]["end"] if segments else 0.0)),
        "text": record.text or "",
        "segments": segments,
    }
