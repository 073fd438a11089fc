"""What the decode engine (`stoker.adapters.backends.engine`) takes and gives: a request, the rows it answers in,
how a sampled row draws, and what a finished request holds."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stoker.adapters.backends.grammar import RowGrammar
from stoker.core.model import GenerationParams
from stoker.core.streaming import TextStream

#: One generated token's (id, log probability), and the likeliest tokens' at its place.
Step = tuple[tuple[int, float], list[tuple[int, float]]]


class EngineFull(Exception):
    """The engine has no room for the request's rows."""


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine takes it: its prompt, how it is sampled, how many new tokens its answers may have
    (`limit`: in all, the answer so far counted), and what goes with it."""

    key: Hashable
    prompt_ids: Sequence[int]
    params: GenerationParams = field(default_factory=GenerationParams)
    limit: int = 64
    #: An answer under way: the tokens it has (its parked cache is picked up when it holds them).
    generated: tuple[int, ...] = ()
    #: The llguidance grammar its answers must follow (None: free text).
    grammar: str | None = None
    #: The job its (first) answer is streamed to, and what of it was sent already.
    stream_to: str | None = None
    sent: str = ""
    #: A vision-language model's: its pictures' embeddings in placeholder order, and their content hashes.
    features: Sequence[Any] = ()
    images: tuple[str, ...] = ()
    #: When (time.time()) it is dropped at the next step, unanswered.
    deadline: float | None = None

    @property
    def content(self) -> tuple[Any, ...]:
        """What its cache holds: the same prompt, pictures and answer so far make the same cache."""
        return (tuple(self.prompt_ids), self.images, self.generated)


@dataclass
class Row:
    """One answer being generated: its tokens, its log probabilities, how it ended (None: it goes on)."""

    request: EngineRequest
    answer: int
    draws: RowDraws | None
    grammar: RowGrammar | None
    stream: TextStream | None
    tokens: list[int]
    steps: list[Step] = field(default_factory=list)
    end: str | None = None
    #: Why its grammar failed (its request fails).
    failure: str | None = None
    #: Prompt and answer tokens in its cache (its next position).
    cached: int = 0
    #: Set aside between calls (`DecodeEngine.park`).
    parked: bool = False
    #: The end-of-sequence token it ended at (never one of its `tokens`), if it did.
    end_token: int | None = None


@dataclass(frozen=True)
class Finished:
    """A request whose answers all ended (`stop`, `length`, or `cancelled`: dropped unanswered)."""

    key: Hashable
    rows: list[Row]


@dataclass(frozen=True)
class RowDraws:
    """Where a sampled row's draws come from: its request's seed, which of its answers it is. The draw for the
    answer's k-th token is fixed by these and k alone, never by the rows beside it."""

    seed: int
    answer: int

    def uniform(self, place: int) -> float:
        """A number in [0, 1) for the answer's token at `place`."""
        import hashlib

        digest = hashlib.blake2b(f"{self.seed}:{self.answer}:{place}".encode(), digest_size=8).digest()
        return (int.from_bytes(digest, "little") >> 11) * 2.0**-53  # the top 53 bits: every double in [0, 1)


def reach(request: EngineRequest) -> int:
    """The cache tokens one row of a request may reach: its prompt and its answer's limit."""
    return len(request.prompt_ids) + request.limit


def step_logprobs(raw: Any, token: int, top: int, torch: Any) -> Step:
    """A token's log probability under the model's raw logits (before temperature or top_p, as OpenAI's), with
    the `top` likeliest tokens'."""
    logprobs = torch.log_softmax(raw, dim=-1)
    best = logprobs.topk(top) if top else None
    alternatives = list(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best is not None else []
    return (token, float(logprobs[token])), alternatives
