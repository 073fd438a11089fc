"""The model's side of a job, as plain values: the request a backend gets, its answer, and the hook contract every
backend follows (LitServe-style: setup(device) loads the model, then batch → predict → unbatch)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from stoker.core.errors import StokerError
from stoker.core.tools import MAX_TOOLS, ResponseFormat, ToolChoice, ToolSpec, call_mode

#: `tool_calls`: the answer is calls of the request's tools (OpenAI's).
FinishReason = Literal["stop", "length", "tool_calls"]
#: Whether a picture's vision embeddings came from the cache (`hit`) or from running the vision encoder (`miss`).
EncoderUse = Literal["hit", "miss"]


#: OpenAI's limit on stop sequences, and stoker's on each one's length: they are stored with the job.
MAX_STOP = 4
MAX_STOP_CHARS = 256
#: The most choices (`n`) one request may ask for: each is a whole answer of the device's time.
MAX_CHOICES = 4
#: The most alternatives per token (`top_logprobs`), as OpenAI's limit.
MAX_TOP_LOGPROBS = 20


class GenerationParams(BaseModel):
    """How one request wants its answer generated: OpenAI's sampling parameters (greedy by default)."""

    model_config = ConfigDict(frozen=True)

    #: New tokens at most; None: the deployment's default (`STOKER_MAX_NEW_TOKENS`).
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: tuple[Annotated[str, Field(max_length=MAX_STOP_CHARS)], ...] = Field((), max_length=MAX_STOP)
    seed: int | None = None
    #: Answers to make (OpenAI's `n`).
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    #: Each answer token's log probability, and that of the `top_logprobs` likeliest tokens at its place.
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    #: The functions the model may call, and whether it must (OpenAI's `tools` and `tool_choice`).
    tools: tuple[ToolSpec, ...] = Field((), max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    #: The answer's form: JSON (`json_object`), JSON valid against a schema (`json_schema`), or free text.
    response_format: ResponseFormat | None = None

    @property
    def calls(self) -> str:
        """What the answer must be as to tool calls (`stoker.core.tools.call_mode`)."""
        return call_mode(self.tools, self.tool_choice)

    @property
    def greedy(self) -> bool:
        """Temperature 0: the most likely token every step, no randomness."""
        return self.temperature == 0

    def sampling_key(self) -> tuple[Any, ...]:
        """Requests with equal keys can share one generate call (greedy ones all can, whatever their seed)."""
        shape = (self.n, self.logprobs, self.top_logprobs)
        return ("greedy", *shape) if self.greedy else ("sample", self.temperature, self.top_p, self.seed, *shape)

    def new_tokens(self, default: int, cap: int, room: int | None = None) -> int:
        """The number of new tokens this request may have: as asked (or `default`), within the cap and the
        context's room left after its prompt, where that is known."""
        return max(1, min(self.max_tokens or default, cap, room if room is not None else cap))


@dataclass(frozen=True)
class ModelRequest:
    """One job as the model gets it: token ids for a local model; the chat as text, and the content hashes of its
    decoded images (and the cache scope they were decoded in), for a server that templates and sees images itself."""

    prompt_ids: list[int]
    #: The chat as text turns; a user turn may name the pictures it carried (`images`: content hashes).
    messages: list[dict[str, Any]] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    #: The stage-cache scope (the job's tenant, or the shared one) where its decoded images are.
    scope: str = ""
    params: GenerationParams = field(default_factory=GenerationParams)
    #: Where a backend that streams sends this answer's pieces as they come (the job's id); None: not streamed.
    stream_to: str | None = None
    #: A batch line's (OpenAI's Batch API): it runs on capacity interactive requests leave, on a server too.
    background: bool = False
    #: An answer under way (`Continued`): the tokens it has so far, and what of it was streamed. Never stored.
    generated: tuple[int, ...] = ()
    sent: str = ""
    #: Its prompt was trimmed to fit the context (`stoker_truncate`): its answer says so.
    truncated: bool = False
    #: The job it is of, for a backend that drops a job cancelled mid-call at its next step. Never stored.
    job_id: str = ""

    def continued(self, progress: Continued) -> ModelRequest:
        """This request, to go on from where its answer is."""
        return replace(self, generated=progress.generated, sent=progress.sent)

    def to_json(self) -> str:
        """The stored form."""
        return json.dumps(
            {
                "ids": self.prompt_ids,
                "messages": self.messages,
                "images": self.images,
                "scope": self.scope,
                "params": self.params.model_dump(exclude_defaults=True),
                "stream_to": self.stream_to,
                **({"truncated": True} if self.truncated else {}),
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> ModelRequest:
        """Back from the stored form."""
        data = json.loads(raw)
        return cls(
            [int(i) for i in data["ids"]],
            list(data.get("messages", [])),
            list(data.get("images", [])),
            str(data.get("scope", "")),
            GenerationParams.model_validate(data.get("params") or {}),
            data.get("stream_to"),
            truncated=bool(data.get("truncated", False)),
        )


@dataclass(frozen=True)
class Prediction:
    """One request's answer."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    #: `length`: it stopped at its token limit; `stop`: it ended on its own (or on a stop sequence).
    finish_reason: FinishReason = "stop"
    #: With `logprobs`: one entry per answer token, in OpenAI's shape (`token`, `logprob`, `bytes`, `top_logprobs`).
    logprobs: list[dict[str, Any]] | None = None
    #: With `n` above 1: the answers after this one (their `completion_tokens` are counted in this one's).
    more: tuple[Prediction, ...] = ()
    #: Per picture it read (content hash): whether the vision encoder ran for it or its embeddings were cached.
    encoder: dict[str, EncoderUse] = field(default_factory=dict)
    #: The calls of the request's tools the answer makes (OpenAI's `tool_calls` entries); None: it makes none.
    tool_calls: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Continued:
    """An answer not finished when its generate call yielded (a request waited for the device, or other answers of
    the call were done): it goes on in a later call from the tokens it has."""

    generated: tuple[int, ...]
    #: What of it was streamed to its client already.
    sent: str = ""


#: What a backend makes of one request: its answer, the error that request alone ran into, or (a backend that
#: yields between decoding steps) its answer so far.
Outcome = Prediction | StokerError | Continued


class Predictor(Protocol):
    """What the inference consumer drives. setup() loads the model; it never happens at import."""

    name: str
    #: Whether one call may mix requests with different sampling (see `sampling_groups`).
    mixes_sampling: bool

    def setup(self, device: str) -> None:
        """Load the model onto device."""

    def batch(self, requests: Sequence[ModelRequest]) -> Any:
        """Collate the requests into one model input."""

    def predict(self, batch: Any) -> Any:
        """Run the model once over the batch."""

    def unbatch(self, output: Any) -> Sequence[Outcome]:
        """Split the model output into one outcome per request, in order."""


def run_predictor(predictor: Predictor, requests: Sequence[ModelRequest]) -> list[Outcome]:
    """One full pass of the hook contract."""
    return list(predictor.unbatch(predictor.predict(predictor.batch(requests))))


def sampling_groups(requests: Sequence[ModelRequest], mixes_sampling: bool) -> list[list[int]]:
    """Positions of the requests, grouped so that each group can be one backend call: all together when the
    backend mixes sampling parameters in a call; otherwise one group per sampling key, in order of first arrival."""
    if mixes_sampling:
        return [list(range(len(requests)))] if requests else []
    groups: dict[tuple[Any, ...], list[int]] = {}
    for position, request in enumerate(requests):
        groups.setdefault(request.params.sampling_key(), []).append(position)
    return list(groups.values())


def apply_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """The text up to the earliest stop sequence in it, and whether one was found (OpenAI drops the sequence)."""
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)
