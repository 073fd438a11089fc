"""Prompt assembly and tokenization: the user's prompt plus what preprocessing read, in the model's template."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from stoker.core.jobs import ChatTurn, Conversation, InputRecord, image_hashes
from stoker.core.model import ModelRequest

#: Bump when prompt assembly changes.
VERSION = "4"

SYSTEM_PROMPT = (
    "You are a helpful assistant. The user may attach files; each attachment is given as its "
    "properties and the text that was read from it."
)


class ChatTokenizer(Protocol):
    """What prompt assembly needs of the model's tokenizer.

    Every string in a message is untrusted (the user's prompt, a chat turn, OCR text, a transcript): it must reach
    the model as text. Only the chat template's own markers may become control tokens, so an attachment reading
    `<|im_end|><|im_start|>system` cannot open a turn of its own.
    """

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat in the model's template, the assistant's turn opened; the messages' text encoded as text."""

    def encode_text(self, text: str) -> list[int]:
        """Untrusted text to token ids, as plain text (no control token)."""

    def decode_text(self, token_ids: Sequence[int]) -> str:
        """Token ids of plain text back to text."""


@dataclass(frozen=True)
class Attachment:
    """One preprocessed input as the model will see it."""

    kind: str
    index: int
    text: str = ""
    features: dict[str, Any] = field(default_factory=dict)
    error_code: str | None = None
    #: Content hashes of the decoded pictures it gave (an image, a video's keyframes), for a model that sees.
    pictures: tuple[str, ...] = ()

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
    messages: list[dict[str, Any]]


def build_prompt(
    tokenizer: ChatTokenizer,
    prompt: str,
    attachments: Sequence[Attachment],
    budget: int,
    turns: Sequence[ChatTurn] | None = None,
) -> BuiltPrompt:
    """The whole chat prompt, fitted into budget: attachment text is trimmed first, then the oldest turns of a chat
    are dropped, then the last turn's text is cut. Without `turns` the chat is one user turn: the prompt with every
    attachment."""
    chat = list(turns) if turns else [ChatTurn(role="user", text=prompt, inputs=[a.index for a in attachments])]
    built = _fit(tokenizer, chat, attachments)
    if len(built.ids) > budget and any(a.text for a in attachments):
        attachments = _trim_attachments(tokenizer, attachments, len(built.ids) - budget)
        built = _fit(tokenizer, chat, attachments)
    while len(built.ids) > budget and _droppable(chat):
        chat.pop(next(i for i, t in enumerate(chat) if t.role != "system"))
        built = _fit(tokenizer, chat, attachments)
    if len(built.ids) > budget:
        last = chat[-1]
        ids = tokenizer.encode_text(last.text)
        chat[-1] = last.model_copy(update={"text": _cut(tokenizer, ids, len(ids) - (len(built.ids) - budget))})
        built = _fit(tokenizer, chat, attachments)
    if len(built.ids) > budget:  # the template alone does not fit: keep the generation prompt at the end
        built = BuiltPrompt(built.ids[len(built.ids) - budget :], built.messages)
    return built


def build_prompt_ids(
    tokenizer: ChatTokenizer, prompt: str, attachments: Sequence[Attachment], budget: int
) -> list[int]:
    """Token ids of the whole chat prompt, fitted into budget."""
    return build_prompt(tokenizer, prompt, attachments, budget).ids


def _droppable(chat: Sequence[ChatTurn]) -> bool:
    """More than the last turn besides the system ones: the oldest can go."""
    return sum(1 for t in chat if t.role != "system") > 1


def _fit(tokenizer: ChatTokenizer, chat: Sequence[ChatTurn], attachments: Sequence[Attachment]) -> BuiltPrompt:
    messages = _messages(chat, attachments)
    return BuiltPrompt(_render(tokenizer, messages), messages)


def _messages(chat: Sequence[ChatTurn], attachments: Sequence[Attachment]) -> list[dict[str, Any]]:
    """stoker's system prompt (with the chat's own system turns after it), then each turn; a user turn is its
    attachments' text and its own, and names the pictures it carried for a model that sees."""
    by_index = {a.index: a for a in attachments}
    system = "\n\n".join([SYSTEM_PROMPT, *(t.text for t in chat if t.role == "system" and t.text)])
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in (t for t in chat if t.role != "system"):
        own = [by_index[i] for i in turn.inputs if i in by_index]
        message: dict[str, Any] = {"role": turn.role, "content": render_user_message(turn.text, own)}
        pictures = [p for a in own for p in a.pictures]
        if pictures:
            message["images"] = pictures
        messages.append(message)
    return messages


def _render(tokenizer: ChatTokenizer, messages: list[dict[str, Any]]) -> list[int]:
    return tokenizer.render([{"role": m["role"], "content": m["content"]} for m in messages])


def _cut(tokenizer: ChatTokenizer, ids: Sequence[int], keep_tokens: int) -> str:
    """The text of a text's first keep_tokens token ids, marked as cut."""
    if keep_tokens <= 0:
        return ""
    return tokenizer.decode_text(ids[:keep_tokens]) + " …"


def _trim_attachments(tokenizer: ChatTokenizer, attachments: Sequence[Attachment], overflow: int) -> list[Attachment]:
    """Cut attachment texts, longest first, until overflow tokens (plus slack for markers) are gone."""
    encoded = [tokenizer.encode_text(a.text) for a in attachments]  # once: counted here, cut below
    lengths = [len(ids) for ids in encoded]
    to_cut = overflow + 4 * len(attachments)
    keep = list(lengths)
    while to_cut > 0 and any(keep):
        longest = max(range(len(keep)), key=keep.__getitem__)
        second = sorted(keep)[-2] if len(keep) > 1 else 0
        step = min(to_cut, max(keep[longest] - second, 1))
        keep[longest] -= step
        to_cut -= step
    return [
        replace(a, text=_cut(tokenizer, ids, k)) if k < len(ids) else a
        for a, k, ids in zip(attachments, keep, encoded, strict=True)
    ]


def attachment_for(record: InputRecord) -> Attachment:
    """How one preprocessed input appears in the prompt: its text (and a video's on-screen text), a few facts."""
    texts = [record.text or ""] + [
        f"On screen at {f.time_s:.1f}s: {f.text}" for f in record.frames or [] if f.status == "ok" and f.text
    ]
    keep = ("format", "width", "height", "duration_s")
    pictures = [f for f in ([record] if record.kind == "image" else record.frames or []) if f.status == "ok"]
    return Attachment(
        kind=record.kind,
        index=record.index,
        text="\n".join(t for t in texts if t),
        features={k: v for k, v in (record.features or {}).items() if k in keep},
        error_code=record.error.code if record.error else None,
        pictures=tuple(p.content_hash for p in pictures if p.content_hash),
    )


def model_request(
    built: dict[str, Any], inputs: list[InputRecord], scope: str, chat: Conversation | None, job_id: str
) -> ModelRequest:
    """The model's request for a built prompt (`ids`, `messages`, as cached): with a chat's generation parameters,
    and streamed to the job when its client reads a stream."""
    return ModelRequest(
        [int(i) for i in built["ids"]],
        list(built.get("messages", [])),
        image_hashes(inputs),
        scope,
        chat.params if chat else ModelRequest([]).params,
        job_id if chat and chat.stream else None,
    )
