"""What a call of the local model is made of, on either path (the decode engine or `generate`): the batch it
takes, the consumer it yields to, what an engine call made, and an answer's tool calls parsed out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from stoker.adapters.backends.engine import DecodeEngine
from stoker.adapters.backends.engine_rows import EngineFull, EngineRequest, Finished, Row
from stoker.core.batching import Collated
from stoker.core.model import GenerationParams, ModelRequest, Prediction
from stoker.core.tools import parse_tool_calls


def torch_dtype(torch: Any, dtype: str, device: str) -> Any:
    """The dtype a setting names; `auto`: bfloat16 on CUDA, float32 on a CPU."""
    if dtype != "auto":
        return getattr(torch, dtype)
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


@dataclass(frozen=True)
class LocalBatch:
    """Left-padded prompts (each with the answer it has so far, if it goes on), and the requests they are of (one
    sampling key for the whole batch)."""

    collated: Collated
    requests: list[ModelRequest]

    @property
    def params(self) -> list[GenerationParams]:
        """Each request's generation parameters."""
        return [r.params for r in self.requests]


class YieldsToConsumer:
    """A backend whose calls can stop between decoding steps for the consumer's waiting requests: the consumer
    hands it the count of those (`yield_to`); `stops_now` is the rule its calls stop by. The consumer may hand it
    too what says a job was cancelled, for a call that can drop a request between steps."""

    #: How many interactive requests wait for the device (the consumer's), and the most rows a call may have.
    _waiting: Callable[[], int] | None = None
    _max_rows = 0
    #: Whether a job was cancelled (by id; the consumer's, as it hears them), asked between steps.
    _cancelled: Callable[[str], bool] | None = None

    def yield_to(
        self, waiting: Callable[[], int], max_rows: int, cancelled: Callable[[str], bool] | None = None
    ) -> None:
        """Let calls stop between decoding steps for the requests `waiting` counts (and drop those `cancelled`
        says were cancelled)."""
        self._waiting, self._max_rows, self._cancelled = waiting, max_rows, cancelled


def stops_now(going: int, rows: int, max_rows: int, waiting: Callable[[], int]) -> bool:
    """Whether a call of `rows` answers, `going` of them unfinished, stops at this step: when some are done and
    others are not (the done ones go out now rather than with the longest: their clients gain, at the cost of the
    others re-reading their prompts in the next call), or when a request waits for the device and the call has room
    for it (it joins the next call)."""
    return going > 0 and (going < rows or (going < max_rows and waiting() > 0))


def with_calls(answer: Prediction, params: GenerationParams) -> Prediction:
    """An answer of a request with tools, its calls parsed out of its text (`finish_reason` `tool_calls`)."""
    if params.calls == "none":
        return answer
    text, calls = parse_tool_calls(answer.text, params.tools)
    if not calls:
        return answer
    dumped = [c.model_dump() for c in calls]
    return replace(answer, text=text, tool_calls=dumped, finish_reason="tool_calls")


@dataclass(frozen=True)
class EngineRun:
    """What one call on the decode engine made: the requests whose answers all ended (by position), and the rows
    of those it parked, still going."""

    batch: LocalBatch
    finished: dict[int, Finished]
    going: dict[int, list[Row]]


def submit_in_turn(engine: DecodeEngine, queued: list[EngineRequest]) -> list[EngineRequest]:
    """Submit the queued requests in order while the engine has room for them; the rest, still queued."""
    for position, request in enumerate(queued):
        try:
            engine.submit(request)
        except EngineFull:
            return queued[position:]
    return []
