"""Reading a job request: multipart or JSON in, validated prompt and sniffed, hashed inputs (or checked URLs) out."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import Request

from api.limits import read_json
from api.schemas import MAX_JSON_INPUTS, JobCreate
from stoker.core.errors import InvalidRequest, PromptTooLong, TooManyInputs, UnsupportedMediaType, UrlRejected
from stoker.core.jobs import Conversation, InputKind, SpeechOptions
from stoker.core.media import KIND_FORMATS, ContentHash, content_hash, sniff_format
from stoker.core.urls import parse_url
from stoker.settings import ApiSettings

FILE_FIELDS: tuple[InputKind, ...] = ("image", "audio", "video")
TEXT_FIELDS = ("prompt", "deadline_ms", "callback_url")


@dataclass(frozen=True)
class UrlInput:
    """An input given by URL: a worker fetches it, the API only checks its syntax."""

    url: str


#: What a request gives for one input: its bytes, or where to fetch them.
Payload = bytes | UrlInput


@dataclass(frozen=True)
class AcceptedInput:
    """An input that passed the door: its kind, bytes, identity and sniffed format; or, by URL, only the URL."""

    kind: InputKind
    data: bytes
    digest: ContentHash
    format: str
    url: str | None = None
    #: A recording's transcription options, as its request asked (`/v1/audio/transcriptions`).
    speech: SpeechOptions | None = None


@dataclass(frozen=True)
class AcceptedRequest:
    """A validated job request."""

    prompt: str
    inputs: list[AcceptedInput]
    deadline_ms: int
    #: A chat's turns and generation parameters (`/v1/chat/completions`); None for a job of the job API.
    chat: Conversation | None = None
    #: Where to POST the job when it ends (signed), if the client asked for that.
    callback_url: str | None = None
    #: A render whose every picture the stage cache holds rendered (in its tenant's scope): where each is, as a
    #: rendered picture's record says (`InputRecord.prepared`). It ends as it is taken in; no stage runs for it.
    rendered: dict[str, str] | None = None


async def read_request(request: Request, settings: ApiSettings) -> AcceptedRequest:
    """Parse and validate a job request; raises an InputError for anything that must not be enqueued."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        fields = await _read_multipart(request, settings)
    elif content_type.startswith("application/json"):
        # parsed and base64-decoded in a worker thread: a big body must not stall the event loop
        fields = await run_in_threadpool(_read_json, await read_json(request, settings.max_json_values), settings)
    else:
        raise UnsupportedMediaType("send multipart/form-data, a url-encoded form or application/json")
    prompt, raw, deadline, callback = fields
    return validate(prompt, raw, settings, deadline, callback_url=callback)


#: prompt, inputs, deadline_ms, callback_url: as a form or a JSON body gave them.
Fields = tuple[str | None, list[tuple[InputKind, Payload]], str | int | None, str | None]


async def _read_multipart(request: Request, settings: ApiSettings) -> Fields:
    form = await request.form(
        max_files=settings.max_images + settings.max_audio + settings.max_video + 1,
        max_fields=len(TEXT_FIELDS) + 8,
        max_part_size=settings.max_prompt_chars * 4,
    )
    unknown = set(form.keys()) - set(FILE_FIELDS) - set(TEXT_FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown form fields: {', '.join(sorted(unknown))}")
    prompt, deadline, callback = form.get("prompt"), form.get("deadline_ms"), form.get("callback_url")
    if isinstance(prompt, UploadFile) or isinstance(deadline, UploadFile) or isinstance(callback, UploadFile):
        raise InvalidRequest("prompt, deadline_ms and callback_url must be text fields")
    files: list[tuple[InputKind, Payload]] = []
    for kind in FILE_FIELDS:
        for item in form.getlist(kind):
            if not isinstance(item, UploadFile):
                raise InvalidRequest(f"{kind} must be a file")
            files.append((kind, await item.read()))
    await form.close()
    return prompt, files, deadline, callback


def _read_json(body: bytes, settings: ApiSettings) -> Fields:
    inputs: list[tuple[InputKind, Payload]] = []
    try:
        spec = JobCreate.model_validate_json(body)
    except ValidationError as exc:
        where, message = first_error(exc)
        kind = exc.errors()[0]["type"]
        if kind == "too_long" and where == "inputs":
            raise TooManyInputs(f"at most {MAX_JSON_INPUTS} inputs per job", param=where) from exc
        if kind == "extra_forbidden":
            raise InvalidRequest(f"unknown field: {where}", param=where) from exc
        raise InvalidRequest(f"{where}: {message}", param=where) from exc
    count_inputs([item.kind for item in spec.inputs], settings)  # before any base64 is decoded
    for position, item in enumerate(spec.inputs):
        if item.url is not None:
            inputs.append((item.kind, UrlInput(item.url)))
            continue
        try:
            inputs.append((item.kind, base64.b64decode(item.data or "", validate=True)))
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequest(f"inputs[{position}].data is not valid base64") from exc
    return spec.prompt, inputs, spec.deadline_ms, spec.callback_url


def first_error(exc: ValidationError) -> tuple[str, str]:
    """Where the first validation error is (dotted path), and what it says."""
    err = exc.errors()[0]
    return ".".join(str(p) for p in err["loc"]) or "body", str(err["msg"])


def validate(
    prompt: str | None,
    raw: list[tuple[InputKind, Payload]],
    settings: ApiSettings,
    deadline_ms: str | int | None = None,
    *,
    callback_url: str | None = None,
) -> AcceptedRequest:
    """Check the prompt and the deadline, sniff every input by its magic bytes, check every URL's syntax."""
    if prompt is None or not prompt.strip():
        raise InvalidRequest("prompt is required")
    if len(prompt) > settings.max_prompt_chars:
        raise PromptTooLong(
            f"the prompt is {len(prompt)} characters, more than the {settings.max_prompt_chars} this server takes",
            param="prompt",
        )
    accepted = validate_inputs(raw, settings)
    deadline = _deadline_ms(deadline_ms, settings)
    return AcceptedRequest(prompt, accepted, deadline, callback_url=_callback_url(callback_url))


def _callback_url(url: str | None) -> str | None:
    """Where to POST the job when it ends: its syntax checked here, its address by the worker that sends it."""
    if url is None or not url.strip():
        return None
    try:
        parse_url(url.strip())
    except UrlRejected as exc:
        raise UrlRejected(f"callback_url: {exc.message}", param="callback_url") from exc
    return url.strip()


def validate_inputs(raw: list[tuple[InputKind, Payload]], settings: ApiSettings) -> list[AcceptedInput]:
    """Count the inputs per kind against the limits, sniff each by its magic bytes, check each URL's syntax."""
    count_inputs([kind for kind, _ in raw], settings)
    return [_accept(i, kind, data) for i, (kind, data) in enumerate(raw)]


def count_inputs(kinds: list[InputKind], settings: ApiSettings) -> None:
    """Refuse more inputs of a kind than a job may have (`too_many_inputs`)."""
    limits = {"image": settings.max_images, "audio": settings.max_audio, "video": settings.max_video}
    for kind, limit in limits.items():
        if kinds.count(kind) > limit:  # type: ignore[arg-type]
            raise TooManyInputs(f"at most {limit} {kind} input(s) per job")


def _deadline_ms(value: str | int | None, settings: ApiSettings) -> int:
    """The requested deadline in ms (the default when none), within [100, max_deadline_ms]."""
    if value is None or value == "":
        return settings.deadline_ms
    try:
        ms = int(value)
    except ValueError as exc:
        raise InvalidRequest("deadline_ms must be a whole number of milliseconds") from exc
    if not 100 <= ms <= settings.max_deadline_ms:
        raise InvalidRequest(f"deadline_ms must be between 100 and {settings.max_deadline_ms}")
    return ms


def _accept(position: int, kind: InputKind, data: Payload) -> AcceptedInput:
    if isinstance(data, UrlInput):
        return _accept_url(position, kind, data.url)
    fmt = sniff_format(kind, data)
    if fmt is None:
        allowed = ", ".join(KIND_FORMATS[kind])
        raise UnsupportedMediaType(
            f"input {position} is not {kind} in an allowed format ({allowed}), judged by its content"
        )
    return AcceptedInput(kind=kind, data=data, digest=content_hash(data), format=fmt)


def _accept_url(position: int, kind: InputKind, url: str) -> AcceptedInput:
    """A URL input is not fetched here: only its syntax is checked (http or https, a host, no credentials)."""
    try:
        parse_url(url)
    except UrlRejected as exc:
        raise UrlRejected(f"inputs[{position}].url: {exc.message}") from exc
    return AcceptedInput(kind=kind, data=b"", digest=ContentHash(""), format="", url=url)
