"""Reading a job request: multipart or JSON in, validated prompt and sniffed, hashed inputs out."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request

from api.schemas import JobCreate
from stoker.core.media import ContentHash, content_hash, sniff_image_format
from stoker.errors import InvalidRequest, TooManyInputs, UnsupportedMediaType
from stoker.settings import ApiSettings

FILE_FIELDS = ("image",)
TEXT_FIELDS = ("prompt",)


@dataclass(frozen=True)
class AcceptedInput:
    """An input that passed the door: its kind, bytes, identity and sniffed format."""

    kind: str
    data: bytes
    digest: ContentHash
    format: str


@dataclass(frozen=True)
class AcceptedRequest:
    """A validated job request."""

    prompt: str
    inputs: list[AcceptedInput]


async def read_request(request: Request, settings: ApiSettings) -> AcceptedRequest:
    """Parse and validate a job request; raises an InputError for anything that must not be enqueued."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        prompt, raw = await _read_multipart(request, settings)
    elif content_type.startswith("application/json"):
        prompt, raw = _read_json(await request.body())
    else:
        raise UnsupportedMediaType("send multipart/form-data, a url-encoded form or application/json")
    return validate(prompt, raw, settings)


async def _read_multipart(request: Request, settings: ApiSettings) -> tuple[str | None, list[tuple[str, bytes]]]:
    form = await request.form(
        max_files=settings.max_images + 1,
        max_fields=len(TEXT_FIELDS) + 8,
        max_part_size=settings.max_prompt_chars * 4,
    )
    unknown = set(form.keys()) - set(FILE_FIELDS) - set(TEXT_FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown form fields: {', '.join(sorted(unknown))}")
    prompt = form.get("prompt")
    if isinstance(prompt, UploadFile):
        raise InvalidRequest("prompt must be a text field")
    files: list[tuple[str, bytes]] = []
    for kind in FILE_FIELDS:
        for item in form.getlist(kind):
            if not isinstance(item, UploadFile):
                raise InvalidRequest(f"{kind} must be a file")
            files.append((kind, await item.read()))
    await form.close()
    return prompt, files


def _read_json(body: bytes) -> tuple[str, list[tuple[str, bytes]]]:
    inputs: list[tuple[str, bytes]] = []
    try:
        spec = JobCreate.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidRequest(_first_error(exc)) from exc
    for position, item in enumerate(spec.inputs):
        try:
            inputs.append((item.kind, base64.b64decode(item.data, validate=True)))
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequest(f"inputs[{position}].data is not valid base64") from exc
    return spec.prompt, inputs


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    return f"{where}: {err['msg']}"


def validate(prompt: str | None, raw: list[tuple[str, bytes]], settings: ApiSettings) -> AcceptedRequest:
    """Check the prompt and sniff every input by its magic bytes."""
    if prompt is None or not prompt.strip():
        raise InvalidRequest("prompt is required")
    if len(prompt) > settings.max_prompt_chars:
        raise InvalidRequest(f"prompt exceeds {settings.max_prompt_chars} characters")
    if len(raw) > settings.max_images:
        raise TooManyInputs(f"at most {settings.max_images} images per job")
    return AcceptedRequest(prompt=prompt, inputs=[_accept(i, kind, data) for i, (kind, data) in enumerate(raw)])


def _accept(position: int, kind: str, data: bytes) -> AcceptedInput:
    fmt = sniff_image_format(data)
    if fmt is None:
        raise UnsupportedMediaType(
            f"input {position} is not a JPEG, PNG, WEBP, GIF, BMP or TIFF image (judged by its content)"
        )
    return AcceptedInput(kind=kind, data=data, digest=content_hash(data), format=fmt)
