"""OpenAI's Chat Completions schemas, as far as stoker serves them: the request (with vLLM's `audio_url` and
`video_url` parts), the `chat.completion` answer, its streamed `chat.completion.chunk`s and the model list.

Unknown fields inside the request's parts are ignored, as vLLM does, and skipped by the parser without being built
into Python objects (`extra="ignore"` with `model_validate_json`). Unknown top-level fields are kept, only so that
their names can be logged (one line each): a body holds at most `max_json_values` values (refused 413 before it is
parsed above that), so what they cost to build is bounded.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stoker.core.model import MAX_CHOICES, MAX_STOP, MAX_STOP_CHARS, MAX_TOP_LOGPROBS, FinishReason
from stoker.core.tools import MAX_TOOLS, NamedToolChoice, ResponseFormat, ToolChoice, ToolSpec

#: Turns a chat may have.
MAX_MESSAGES = 256


class _Lenient(BaseModel):
    """Unknown fields are accepted and dropped unread (clients send options stoker does not serve)."""

    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImageUrl(_Lenient):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(_Lenient):
    data: str = Field(description="base64-encoded audio")
    format: Literal["wav", "mp3"]


class AudioPart(_Lenient):
    type: Literal["input_audio"]
    input_audio: InputAudio


class MediaUrl(_Lenient):
    url: str


class AudioUrlPart(_Lenient):
    type: Literal["audio_url"]
    audio_url: MediaUrl


class VideoUrlPart(_Lenient):
    type: Literal["video_url"]
    video_url: MediaUrl


ContentPart = Annotated[TextPart | ImagePart | AudioPart | AudioUrlPart | VideoUrlPart, Field(discriminator="type")]


class CalledFunction(_Lenient):
    name: str
    arguments: str


class MessageToolCall(_Lenient):
    """A call an earlier assistant turn made, sent back with the chat."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Lenient):
    """One turn. `developer` is OpenAI's newer name for `system`; a `tool` turn is a call's result."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _calls_where_they_belong(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionCreate(BaseModel):
    """A chat-completions request; unknown top-level fields are kept in `model_extra`, to be logged and dropped."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    #: OpenAI's bounds (a signed 64-bit integer), as a server it is passed to takes it.
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_CHOICES, description=f"answers to make, at most {MAX_CHOICES}")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    #: Accepted as OpenAI's; a forced call (`required`, a named function) is one call.
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    #: What an input that cannot be read does: `degrade` (answer from the rest, 200) or `fail` (422 with its code).
    stoker_on_input_error: Literal["degrade", "fail"] | None = None
    #: A prompt over the model's context: trimmed to fit (true; the answer then says so, `x-stoker-truncated`) or
    #: refused 400 `context_length_exceeded` (false); unset: as the deployment says (`STOKER_TRUNCATE_PROMPTS`).
    stoker_truncate: bool | None = None

    @model_validator(mode="after")
    def _tools_that_exist(self) -> ChatCompletionCreate:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: each function needs a name of its own")
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names `{self.tool_choice.function.name}`, which is not in tools")
        if self.response_format and self.response_format.type == "json_schema" and not self.response_format.json_schema:
            raise ValueError("response_format of type json_schema needs its json_schema")
        return self

    @model_validator(mode="after")
    def _served_together(self) -> ChatCompletionCreate:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.stream and ((self.n or 1) > 1 or self.logprobs):
            raise ValueError("n above 1 and logprobs are served on answers that are not streamed")
        return self

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(len(stop) > MAX_STOP_CHARS for stop in ([value] if isinstance(value, str) else value or [])):
            raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        return value

    def stops(self) -> tuple[str, ...]:
        """The stop sequences as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    #: None when the answer is only calls (as OpenAI's).
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChoiceLogprobs(BaseModel):
    #: One entry per answer token: `token`, `logprob`, `bytes`, `top_logprobs`.
    content: list[dict[str, Any]]


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class InputFacts(BaseModel):
    """What preprocessing made of one input of the chat."""

    index: int
    kind: str
    status: str
    error_code: str | None = None
    #: What was read from it (OCR text, transcript), as the model got it before any trimming.
    text: str | None = None


class StokerFacts(BaseModel):
    """stoker's own account of the job behind an answer."""

    job_id: str
    status: str
    inputs: list[InputFacts]
    timings_ms: dict[str, float]


class ChatCompletion(BaseModel):
    """OpenAI's `chat.completion`, plus the `stoker` object."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    stoker: StokerFacts


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "stoker"
    #: The most new tokens one answer may have: a request without `max_tokens` gets up to this many, and one that
    #: asks for more is refused (400 `max_tokens_over_cap`).
    max_tokens_cap: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def chunk(
    completion_id: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`: a delta of the one choice, or (with usage and no delta) the closing usage."""
    body: dict[str, Any] = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
    body["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body
