"""OpenAI's legacy Completions schemas (`POST /v1/completions`), as vLLM serves them and as far as stoker does: the
request, the `text_completion` answer and its streamed chunks, and its logprobs shape.

A completion is run as a chat of one raw prompt: `CompletionCreate.as_chat` is the chat request it makes, so its
limits and checks are the chat's own.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.chat_schemas import StokerFacts, StreamOptions, Usage
from stoker.core.errors import UnsupportedParameter
from stoker.core.model import MAX_CHOICES, MAX_TOP_LOGPROBS, FinishReason


class CompletionCreate(BaseModel):
    """A completions request; unknown top-level fields are kept in `model_extra`, to be logged and dropped."""

    model_config = ConfigDict(extra="allow")

    model: str
    #: One prompt; a list of one string is taken as that string (several prompts and token ids are refused).
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    #: The most likely alternatives to return with each answer token (its own logprob always comes).
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    #: As a chat's: a prompt over the context trimmed to fit (its end kept) rather than refused.
    stoker_truncate: bool | None = None

    def as_chat(self) -> dict[str, Any]:
        """The chat request this completion runs as (to be validated as a `ChatCompletionCreate`), its one user turn
        the prompt; 400 `unsupported_parameter` for what is not served."""
        self._served()
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": self.prompt_text()}],
            "stream": self.stream,
            **self.model_dump(
                include={"max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream_options", "stoker_truncate"}
            ),
        }
        if self.logprobs is not None:
            chat.update(logprobs=True, top_logprobs=self.logprobs)
        return chat

    def prompt_text(self) -> str:
        """The one prompt, as text."""
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise UnsupportedParameter(
                    "prompt: one prompt per request, as a string (or a list of one string); several prompts and "
                    "token ids are not served",
                    param="prompt",
                )
            return prompt[0]
        return prompt

    def _served(self) -> None:
        if self.echo:
            raise UnsupportedParameter("echo is not served: the prompt's logprobs are not computed", param="echo")
        if self.suffix:
            raise UnsupportedParameter("suffix is not served (no fill-in-the-middle)", param="suffix")


class CompletionLogprobs(BaseModel):
    """OpenAI's completions logprobs: per answer token its text, its logprob, the alternatives asked for (a map of
    token to logprob, the token itself among them) and its offset in the answer's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    """OpenAI's `text_completion`, plus the `stoker` object."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    stoker: StokerFacts


def completion_logprobs(entries: list[dict[str, Any]]) -> CompletionLogprobs:
    """A chat answer's logprobs (`token`, `logprob`, `top_logprobs` per token) in the completions shape."""
    offsets, at = [], 0
    for entry in entries:
        offsets.append(at)
        at += len(entry["token"])
    return CompletionLogprobs(
        tokens=[entry["token"] for entry in entries],
        token_logprobs=[entry["logprob"] for entry in entries],
        top_logprobs=[_alternatives(entry) for entry in entries],
        text_offset=offsets,
    )


def _alternatives(entry: dict[str, Any]) -> dict[str, float]:
    found = {top["token"]: top["logprob"] for top in entry.get("top_logprobs") or []}
    found.setdefault(entry["token"], entry["logprob"])
    return found


def completion_chunk(
    completion_id: str,
    created: int,
    model: str,
    text: str | None = None,
    finish_reason: str | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """One streamed `text_completion`: a piece of the one choice's text (or its finish), or (with usage and no text)
    the closing usage."""
    body: dict[str, Any] = {"id": completion_id, "object": "text_completion", "created": created, "model": model}
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    body["choices"] = [] if text is None and finish_reason is None else [choice]
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body
