"""Request and response schemas of the HTTP API."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stoker.core.jobs import Job


class InputCreate(BaseModel):
    """One input of a JSON job request: media as base64, or an http(s) URL a worker fetches."""

    #: A field stoker does not know is refused (422), never silently dropped: a misspelt `url` is not a job.
    model_config = ConfigDict(extra="forbid")

    kind: Literal["image", "audio", "video"]
    data: str | None = Field(None, description="base64-encoded bytes")
    url: str | None = Field(None, description="http or https URL, fetched by a worker (not the API)")

    @model_validator(mode="after")
    def _data_or_url(self) -> InputCreate:
        """Exactly one of the two."""
        if (self.data is None) == (self.url is None):
            raise ValueError("give either data or url")
        return self


#: More inputs than any deployment allows per job: a longer list is refused as soon as parsing passes it.
MAX_JSON_INPUTS = 64


class JobCreate(BaseModel):
    """A JSON job request; unknown fields are refused (422 `invalid_request`), as in a multipart form."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    inputs: list[InputCreate] = Field(default_factory=list, max_length=MAX_JSON_INPUTS)
    deadline_ms: int | None = Field(None, description="answer within this many ms (default from settings)")
    callback_url: str | None = Field(None, description="POST the job here, signed, when it ends")


class JobPublic(Job):
    """A job as the API returns it."""


class JobList(BaseModel):
    """A page of a tenant's jobs, newest first; `next_cursor` (None on the last page) fetches the next."""

    object: str = "list"
    data: list[JobPublic]
    next_cursor: str | None = None


class ErrorBody(BaseModel):
    """The structured error every 4xx and 5xx carries, in OpenAI's shape (`type`, `param`) with stoker's stable
    `code`."""

    code: str
    message: str
    type: str
    param: str | None = None
    stage: str | None = None


class ErrorPublic(BaseModel):
    """Error envelope."""

    error: ErrorBody


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's documented error answers (OpenAPI `responses`): every one is the error envelope."""
    return {status: {"model": ErrorPublic} for status in statuses}
