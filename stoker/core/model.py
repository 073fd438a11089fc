"""The model's side of a job, as plain values: the request a backend gets, its answer, and the hook contract every
backend follows (LitServe-style: setup(device) loads the model, then batch → predict → unbatch)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stoker.core.errors import StokerError


@dataclass(frozen=True)
class ModelRequest:
    """One job as the model gets it: token ids for a local model; the chat as text, and the content hashes of its
    decoded images (and the cache scope they were decoded in), for a server that templates and sees images itself."""

    prompt_ids: list[int]
    messages: list[dict[str, str]] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    #: The stage-cache scope (the job's tenant, or the shared one) where its decoded images are.
    scope: str = ""

    def to_json(self) -> str:
        """The stored form."""
        return json.dumps(
            {"ids": self.prompt_ids, "messages": self.messages, "images": self.images, "scope": self.scope}
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> ModelRequest:
        """Back from the stored form."""
        data = json.loads(raw)
        ids, messages, images = (
            [int(i) for i in data["ids"]],
            list(data.get("messages", [])),
            list(data.get("images", [])),
        )
        return cls(ids, messages, images, str(data.get("scope", "")))


@dataclass(frozen=True)
class Prediction:
    """One request's answer."""

    text: str
    prompt_tokens: int
    completion_tokens: int


#: What a backend makes of one request: its answer, or the error that request alone ran into.
Outcome = Prediction | StokerError


class Predictor(Protocol):
    """What the inference consumer drives. setup() loads the model; it never happens at import."""

    name: str

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
