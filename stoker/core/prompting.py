"""Prompt assembly and tokenization: the user's prompt plus what preprocessing read, in the model's template."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from stoker.core.jobs import ChatTurn, Conversation, InputRecord, image_hashes
from stoker.core.model import ModelRequest

#: Bump when prompt assembly changes.
VERSION = "3"

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
        keep = _token_len(tokenizer, last.text) - (len(built.ids) - budget)
        chat[-1] = last.model_copy(update={"text": _trim_text(tokenizer, last.text, keep)})
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
    text_only = [{"role": m["role"], "content": m["content"]} for m in messages]
    out = tokenizer.apply_chat_template(text_only, add_generation_prompt=True, tokenize=True, return_dict=False)
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
