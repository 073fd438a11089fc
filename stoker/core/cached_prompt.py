"""A built prompt as the tokenize stage's cache keeps it: written by the tokenize stage and by the API that tokenizes a
short prompt itself, read by both, turned into the model's request."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stoker.core.jobs import Conversation
from stoker.core.model import ModelRequest
from stoker.core.prompting import BuiltPrompt


@dataclass(frozen=True)
class CachedPrompt:
    """A chat prompt fitted to the budget: its token ids, its messages (for a server) and the pictures it shows
    (content hashes, in the order of their placeholders)."""

    ids: list[int]
    messages: list[dict[str, Any]]
    images: list[str] = field(default_factory=list)
    #: It was trimmed to fit the model's context (`BuiltPrompt.truncated`).
    truncated: bool = False

    @classmethod
    def of(cls, built: BuiltPrompt) -> CachedPrompt:
        """The prompt as built."""
        return cls(built.ids, built.messages, built.images, built.truncated)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> CachedPrompt:
        """The prompt from its cache entry (fields the cache adds, as its cost, are left out)."""
        ids, messages, images = [int(i) for i in value["ids"]], list(value.get("messages", [])), value.get("images")
        return cls(ids, messages, list(images or []), bool(value.get("truncated", False)))

    def to_dict(self) -> dict[str, Any]:
        """The cache entry's JSON object (the layout every cached prompt has had: `ids`, `messages`, `images`; and
        `truncated` where it was)."""
        entry: dict[str, Any] = {"ids": self.ids, "messages": self.messages, "images": self.images}
        if self.truncated:
            entry["truncated"] = True
        return entry

    def request(self, scope: str, chat: Conversation | None, job_id: str) -> ModelRequest:
        """The model's request for this prompt: with a chat's generation parameters, and streamed to the job when
        its client reads a stream. Its pictures are those the prompt shows."""
        return ModelRequest(
            list(self.ids),
            list(self.messages),
            list(self.images),
            scope,
            chat.params if chat else ModelRequest([]).params,
            job_id if chat and chat.stream else None,
            truncated=self.truncated,
        )
