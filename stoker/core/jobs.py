"""The job: its states, its record, and the timings derived from its timestamps. Pure values, no I/O."""

from __future__ import annotations

import base64
import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from stoker.core.costs import MEDIUM, SizeClass
from stoker.core.errors import InvalidRequest, MediaEmpty
from stoker.core.model import EncoderUse, FinishReason, GenerationParams

JobStatus = Literal["queued", "preprocessing", "inferring", "succeeded", "degraded", "failed", "cancelled"]
InputKind = Literal["image", "audio", "video"]
#: A job's class: interactive requests go first at every queue and on the device; batch lines (`/v1/batches`) run
#: on the capacity they leave.
JobClass = Literal["interactive", "batch"]
#: skipped: a video keyframe slot the video did not fill (too short, no picture).
InputStatus = Literal["pending", "ok", "failed", "skipped"]
#: A job in one of these will not change any more: `cancelled` by its client (DELETE, or a chat client gone).
TERMINAL: frozenset[str] = frozenset({"succeeded", "degraded", "failed", "cancelled"})

#: A job id: 32 hex digits (uuid4().hex).
JOB_ID = re.compile(r"[0-9a-f]{32}")


def new_job_id() -> str:
    """A new job's id, of the shape `JOB_ID` checks."""
    return uuid.uuid4().hex


#: Suffix of an input's timing that is a stage's broker queue wait (`decode_queue`), not its run time.
QUEUE_SUFFIX = "_queue"

#: Timestamps a job collects on its way, in order (seconds since the epoch).
#: The most a job's record may hold when it is created, unless a deployment sets otherwise (`max_record_bytes`).
MAX_RECORD_BYTES = 1 << 20

STAMPS = ("accepted", "started", "preprocessed", "infer_start", "infer_end", "done")


class ErrorInfo(BaseModel):
    """A structured error: a stable machine code, a human message, the stage it came from."""

    code: str
    message: str
    stage: str | None = None


class Segment(BaseModel):
    """A timed stretch of a transcript."""

    start: float
    end: float
    text: str


class SpeechOptions(BaseModel):
    """How an audio input is transcribed, as its request asked (OpenAI's transcription `language`, `prompt` and
    `temperature`): each None leaves the deployment's way (the language detected, no prompt, the temperature
    fallback from 0)."""

    #: A Whisper language code (`stoker.core.speech_languages`).
    language: str | None = None
    #: Text the speech model reads as what came before the recording (faster-whisper's `initial_prompt`).
    prompt: str | None = None
    #: The temperature the first try of each window is decoded at; the fallback goes on from there.
    temperature: float | None = None


class InputRecord(BaseModel):
    """One input of a job (or one keyframe of a video input) and what preprocessing made of it."""

    index: int
    kind: InputKind
    #: Empty (and size_bytes 0) while a URL input is not fetched yet.
    content_hash: str
    size_bytes: int
    #: How large it is expected to be for its stages, read from its header at the door (`stoker.core.costs`: 0
    #: small, 1 medium, 2 large): small inputs' stage messages are taken first.
    size_class: SizeClass = MEDIUM
    status: InputStatus = "pending"
    #: For a URL input: where the fetch stage downloads its bytes from.
    url: str | None = None
    text: str | None = None
    features: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    timings_ms: dict[str, float] = Field(default_factory=dict)
    #: Per stage: whether its result came from the cache.
    cache_hit: dict[str, bool] = Field(default_factory=dict)
    segments: list[Segment] | None = None
    #: For a keyframe: where in its video it was taken.
    time_s: float | None = None
    #: For a video: the keyframes that went through the image branch.
    frames: list[InputRecord] | None = None
    #: For a picture, with a model that sees: its image processor's identity (`processor`) and the layout the
    #: prompt spells out for it (`layout`: tile rows and cols, or a patch grid), so tokenize needs no tensors.
    prepared: dict[str, Any] | None = None

    #: For a picture a vision-language model read: `hit` when its vision embeddings were cached, `miss` when the
    #: vision encoder ran for it (written when the job ends).
    encoder: EncoderUse | None = None
    #: For a page OCR'd in bands (each its own task): how many it was cut into.
    bands: int | None = None
    #: For a recording sent to be transcribed (`/v1/audio/transcriptions`): how, as its request asked; left out of
    #: a record when it did not ask.
    speech: SpeechOptions | None = Field(None, exclude_if=lambda speech: speech is None)


class ChoiceInfo(BaseModel):
    """One more answer of a request that asked for several (`n`)."""

    text: str
    finish_reason: FinishReason = "stop"
    logprobs: list[dict[str, Any]] | None = None
    #: The calls of the request's tools this answer makes (OpenAI's `tool_calls` entries).
    tool_calls: list[dict[str, Any]] | None = None


class ResultInfo(BaseModel):
    """The model's answer."""

    text: str
    model: str
    prompt_tokens: int
    #: Every answer's tokens, when several were asked for.
    completion_tokens: int
    finish_reason: FinishReason = "stop"
    #: With `logprobs`: one entry per answer token (OpenAI's `logprobs.content`).
    logprobs: list[dict[str, Any]] | None = None
    #: The calls of the request's tools the answer makes (OpenAI's `tool_calls` entries); None: it makes none.
    tool_calls: list[dict[str, Any]] | None = None
    #: With `n` above 1: the answers after the first.
    more: list[ChoiceInfo] = Field(default_factory=list)
    #: The prompt was trimmed to fit the model's context, as the request (`stoker_truncate`) or the deployment
    #: (`STOKER_TRUNCATE_PROMPTS`) allowed; left out of a record when it was not.
    truncated: bool = Field(False, exclude_if=lambda truncated: not truncated)


class BatchInfo(BaseModel):
    """Which batch the request rode in on the device."""

    id: str
    size: int
    wait_ms: float
    #: Backend calls the batch was split into: more than one when its requests asked for sampling that the
    #: backend cannot mix in one call (the local model: one call per temperature / top_p / seed).
    groups: int = 1


#: `prompt`: a legacy completion's prompt (`/v1/completions`), the only turn of its job, given to the model as it is,
#: without the chat template.
ChatRole = Literal["system", "user", "assistant", "tool", "prompt"]
#: The role of a completion's raw prompt.
RAW_PROMPT: ChatRole = "prompt"


class ChatTurn(BaseModel):
    """One message of a chat: who said it, its text, and the job's inputs (by index) that came with it."""

    role: ChatRole
    text: str
    inputs: list[int] = Field(default_factory=list)
    #: An assistant turn's calls of the chat's tools (OpenAI's `tool_calls` entries); left out of a record when none.
    tool_calls: list[dict[str, Any]] = Field(default_factory=list, exclude_if=lambda calls: not calls)
    #: A `tool` turn: the call whose result it is.
    tool_call_id: str | None = Field(None, exclude_if=lambda value: value is None)


class Conversation(BaseModel):
    """A job that came as a chat (`/v1/chat/completions`): every turn reaches the model, with its parameters."""

    turns: list[ChatTurn]
    params: GenerationParams = Field(default_factory=GenerationParams)
    #: The client reads the answer as a stream: a backend that can stream sends it piece by piece.
    stream: bool = False
    #: An input that cannot be read: `degrade` answers from what is left (the job `degraded`); `fail` ends the job
    #: `failed` with that input's error before the model runs.
    on_input_error: Literal["degrade", "fail"] = "degrade"
    #: A render (`/v1/chat/completions/render`): its pictures are rendered into the stage cache and the job ends
    #: there, never reaching the model; left out of a record when false.
    render: bool = Field(False, exclude_if=lambda render: not render)
    #: A prompt over the model's context is trimmed to fit (`stoker_truncate`), instead of refused 400
    #: `context_length_exceeded`; the answer then says it was (`ResultInfo.truncated`).
    truncate: bool = Field(False, exclude_if=lambda truncate: not truncate)


class CallbackState(BaseModel):
    """Where a job is POSTed when it ends, and how that delivery stands."""

    url: str
    #: pending: not delivered yet (the job runs, or attempts are under way); delivered; failed: given up.
    status: Literal["pending", "delivered", "failed"] = "pending"
    attempts: int = 0
    last_error: str | None = None


class Job(BaseModel):
    """A job as clients see it."""

    id: str
    status: JobStatus
    prompt: str
    inputs: list[InputRecord]
    result: ResultInfo | None = None
    error: ErrorInfo | None = None
    batch: BatchInfo | None = None
    timings_ms: dict[str, float] = Field(default_factory=dict)
    #: The deadline the job was accepted with.
    deadline_ms: int | None = None
    #: Preprocessing's share of the total time, once the job ended.
    preprocess_share: float | None = None
    #: The job's OpenTelemetry trace (32 hex digits), when tracing is on.
    trace_id: str | None = None
    #: For a job that came as a chat: its turns and generation parameters (its `prompt` is the last user turn).
    chat: Conversation | None = None
    #: For a job with a `callback_url`: the delivery of its end to that URL.
    callback: CallbackState | None = None
    #: Interactive, or a line of a batch (`batch_id`), which runs only on the capacity interactive jobs leave.
    job_class: JobClass = "interactive"
    batch_id: str | None = None
    #: Whose job it is: only that tenant may read it. Kept out of every answer (the caller knows who it is).
    tenant: str | None = Field(None, exclude=True)

    @property
    def terminal(self) -> bool:
        """True once the job will not change any more."""
        return self.status in TERMINAL


@dataclass(frozen=True)
class Cursor:
    """A place in a tenant's job list (newest first): the job there, and when it was accepted."""

    accepted: float
    job_id: str

    def after(self, other: Cursor) -> bool:
        """Whether this entry comes after `other` in the list (older; at the same time, a lower id)."""
        return (self.accepted, self.job_id) < (other.accepted, other.job_id)

    def encode(self) -> str:
        """The opaque `cursor` a client sends back for the next page."""
        return base64.urlsafe_b64encode(f"{self.accepted!r}:{self.job_id}".encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Cursor:
        """A cursor from what a client sent; InvalidRequest if it is not one this API gave out."""
        try:
            accepted, job_id = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode().split(":", 1)
            cursor = cls(float(accepted), job_id)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequest("cursor is not one this API gave out", param="cursor") from exc
        if not math.isfinite(cursor.accepted) or not JOB_ID.fullmatch(cursor.job_id):
            raise InvalidRequest("cursor is not one this API gave out", param="cursor")
        return cursor


def compute_timings(stamps: dict[str, float]) -> dict[str, float]:
    """Job-level durations in ms from its timestamps; a duration appears once both ends are known."""
    spans = {
        "queued": ("accepted", "started"),
        "preprocess": ("accepted", "preprocessed"),
        "infer_wait": ("preprocessed", "infer_start"),
        "infer": ("infer_start", "infer_end"),
        "total": ("accepted", "done"),
    }
    return {
        name: round(max(stamps[end] - stamps[start], 0.0) * 1000, 2)
        for name, (start, end) in spans.items()
        if start in stamps and end in stamps
    }


def preprocess_share(timings_ms: dict[str, float]) -> float | None:
    """Preprocessing's share of a finished job's total time (0..1), or None before it ended."""
    total, pre = timings_ms.get("total"), timings_ms.get("preprocess")
    if not total or pre is None:
        return None
    return round(min(pre / total, 1.0), 3)


def renders_pictures(chat: Conversation | None, inputs: Sequence[InputRecord]) -> bool:
    """Whether a job is a render of pictures sent inline and nothing else: its canvas is its pictures' rendering
    (`stoker.render`). A render of a sound (a transcription) or of a URL still to fetch goes through preprocessing."""
    if chat is None or not chat.render:
        return False
    return all(record.kind == "image" and record.url is None for record in inputs)


def final_status(inputs: list[InputRecord]) -> JobStatus:
    """A job whose model run succeeded is degraded when any of its inputs failed."""
    return "degraded" if any(i.status == "failed" for i in inputs) else "succeeded"


def degraded_codes(inputs: list[InputRecord]) -> list[str]:
    """The error codes of a job's inputs that could not be read, each once, in the inputs' order."""
    codes = [i.error.code if i.error else "input_failed" for i in inputs if i.status == "failed"]
    return list(dict.fromkeys(codes))


def input_failure(inputs: list[InputRecord]) -> ErrorInfo | None:
    """What ends a job that asked to fail on an unreadable input: the first such input's error (its code, where
    it is), or None while every input is readable."""
    failed = next((i for i in inputs if i.status == "failed"), None)
    if failed is None:
        return None
    error = failed.error or ErrorInfo(code="input_failed", message="it could not be read")
    where = f"input {failed.index} ({failed.kind})"
    return ErrorInfo(code=error.code, message=f"{where} could not be read: {error.message}", stage=error.stage)


def settle_video(record: InputRecord) -> bool:
    """A video with no audio stream is usable only through its keyframes; with none either, it failed."""
    no_sound = (record.features or {}).get("audio_streams") == 0
    frames_ok = any(f.status == "ok" for f in record.frames or [])
    if record.kind != "video" or record.status != "ok" or not no_sound or frames_ok:
        return False
    record.status = "failed"
    record.error = ErrorInfo(**MediaEmpty("no audio track and no decodable frame", stage="keyframes").to_dict())
    return True
