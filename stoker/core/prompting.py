"""Prompt assembly and tokenization: the user's prompt plus what preprocessing read, in the model's template."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from stoker.core.jobs import InputRecord

#: Bump when prompt assembly changes.
VERSION = "2"

SYSTEM_PROMPT = (
    "You are a helpful assistant. The user may attach files; each attachment is given as its "
    "properties and the text that was read from it."
)


class ChatTokenizer(Protocol):
    """The slice of a Hugging Face fast tokenizer that prompt assembly needs."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        """Render and tokenize a conversation."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]:
        """Text to token ids."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str:
        """Token ids to text."""


@dataclass(frozen=True)
class Attachment:
    """One preprocessed input as the model will see it."""

    kind: str
    index: int
    text: str = ""
    features: dict[str, Any] = field(default_factory=dict)
    error_code: str | None = None

    def describe(self) -> str:
        """One block of plain text for the prompt."""
        props = ", ".join(f"{k}={v}" for k, v in sorted(self.features.items()))
        head = f"[{self.kind} {self.index + 1}" + (f": {props}" if props else "") + "]"
        if self.error_code:
            return f"{head}\n(could not be processed: {self.error_code})"
        label = {"audio": "Transcript", "video": "Transcript and on-screen text"}.get(self.kind, "Text read from it")
        return f"{head}\n{label}:\n{self.text or '(no text found)'}"


def render_user_message(prompt: str, attachments: Sequence[Attachment]) -> str:
    """The user turn: attachments first, then the question, so the question sits next to the answer."""
    blocks = [a.describe() for a in attachments]
    return "\n\n".join([*blocks, prompt]) if blocks else prompt


@dataclass(frozen=True)
class BuiltPrompt:
    """A chat prompt fitted to the budget: as token ids for a local model, and as text messages for a server."""

    ids: list[int]
    messages: list[dict[str, str]]


def build_prompt(tokenizer: ChatTokenizer, prompt: str, attachments: Sequence[Attachment], budget: int) -> BuiltPrompt:
    """The whole chat prompt, fitted into budget by trimming attachment text, then the prompt."""
    messages = _messages(prompt, attachments)
    ids = _render(tokenizer, messages)
    overflow = len(ids) - budget
    if overflow > 0 and any(a.text for a in attachments):
        attachments = _trim_attachments(tokenizer, attachments, overflow)
        messages = _messages(prompt, attachments)
        ids = _render(tokenizer, messages)
        overflow = len(ids) - budget
    if overflow > 0:
        prompt = _trim_text(tokenizer, prompt, _token_len(tokenizer, prompt) - overflow)
        messages = _messages(prompt, attachments)
        ids = _render(tokenizer, messages)
    if len(ids) > budget:  # the template alone does not fit: keep the generation prompt at the end
        ids = ids[len(ids) - budget :]
    return BuiltPrompt(ids, messages)


def build_prompt_ids(
    tokenizer: ChatTokenizer, prompt: str, attachments: Sequence[Attachment], budget: int
) -> list[int]:
    """Token ids of the whole chat prompt, fitted into budget."""
    return build_prompt(tokenizer, prompt, attachments, budget).ids


def _messages(prompt: str, attachments: Sequence[Attachment]) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": render_user_message(prompt, attachments)},
    ]


def _render(tokenizer: ChatTokenizer, messages: list[dict[str, str]]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(i) for i in out]


def _token_len(tokenizer: ChatTokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _trim_text(tokenizer: ChatTokenizer, text: str, keep_tokens: int) -> str:
    if keep_tokens <= 0:
        return ""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= keep_tokens:
        return text
    return tokenizer.decode(ids[:keep_tokens], skip_special_tokens=True) + " …"


def _trim_attachments(tokenizer: ChatTokenizer, attachments: Sequence[Attachment], overflow: int) -> list[Attachment]:
    """Cut attachment texts, longest first, until overflow tokens (plus slack for markers) are gone."""
    lengths = [_token_len(tokenizer, a.text) for a in attachments]
    to_cut = overflow + 4 * len(attachments)
    keep = list(lengths)
    while to_cut > 0 and any(keep):
        longest = max(range(len(keep)), key=keep.__getitem__)
        second = sorted(keep)[-2] if len(keep) > 1 else 0
        step = min(to_cut, max(keep[longest] - second, 1))
        keep[longest] -= step
        to_cut -= step
    return [
        replace(a, text=_trim_text(tokenizer, a.text, k)) if k < n else a
        for a, k, n in zip(attachments, keep, lengths, strict=True)
    ]


def attachment_for(record: InputRecord) -> Attachment:
    """How one preprocessed input appears in the prompt: its text (and a video's on-screen text), a few facts."""
    texts = [record.text or ""] + [
        f"On screen at {f.time_s:.1f}s: {f.text}" for f in record.frames or [] if f.status == "ok" and f.text
    ]
    keep = ("format", "width", "height", "duration_s")
    return Attachment(
        kind=record.kind,
        index=record.index,
        text="\n".join(t for t in texts if t),
        features={k: v for k, v in (record.features or {}).items() if k in keep},
        error_code=record.error.code if record.error else None,
    )
