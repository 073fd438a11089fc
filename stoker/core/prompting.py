"""Prompt assembly and tokenization: the user's prompt plus what preprocessing read, in the model's template.

The chat reaches the model as it was sent: no system prompt of stoker's own (a deployment may set one,
`STOKER_SYSTEM_PROMPT`). Each attachment goes into the user turn it came with: for a model that sees, each of its
pictures as an image part (in order, before the turn's text), with its text only when something was read from it
(OCR that ran, a transcript); for a model that reads only text, its facts and the text read from it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from stoker.core.errors import ContextLengthExceeded
from stoker.core.jobs import RAW_PROMPT, ChatTurn, Conversation, InputRecord
from stoker.core.tools import ToolSpec

#: Bump when prompt assembly changes.
VERSION = "7"

#: A picture's layout as its image processor gave it (tile rows and cols, or a patch grid): what the prompt needs
#: to spell out the picture's placeholder tokens.
Layout = dict[str, Any]


class ChatTokenizer(Protocol):
    """What prompt assembly needs of the model's tokenizer.

    Every string in a message is untrusted (the user's prompt, a chat turn, OCR text, a transcript): it must reach
    the model as text. Only the chat template's own markers may become control tokens, so an attachment reading
    `<|im_end|><|im_start|>system` cannot open a turn of its own (nor `<image>` a picture).
    """

    def render(self, messages: list[dict[str, Any]], tools: Sequence[ToolSpec] = ()) -> list[int]:
        """The chat in the model's template, the assistant's turn opened; the messages' text encoded as text. A
        message's `images` (layouts) are the pictures the model sees, as image parts before its text, each
        placeholder expanded as the model's processor expands it. `tools`: the functions the model is offered
        (an assistant turn may carry its `tool_calls`, a `tool` turn a call's result)."""

    def encode_text(self, text: str) -> list[int]:
        """Untrusted text to token ids, as plain text (no control token)."""

    def decode_text(self, token_ids: Sequence[int]) -> str:
        """Token ids of plain text back to text."""


@dataclass(frozen=True)
class Attachment:
    """One preprocessed input as the model will see it."""

    kind: str
    index: int
    #: What was read from it; None when nothing was asked to read it (OCR off for this model).
    text: str | None = ""
    features: dict[str, Any] = field(default_factory=dict)
    error_code: str | None = None
    #: Content hashes of the decoded pictures it gave (an image, a video's keyframes), for a model that sees.
    pictures: tuple[str, ...] = ()
    #: For a model that sees: each picture's layout from its image processor (empty for a text-only model).
    layouts: tuple[Layout, ...] = ()
    #: Its pictures were left out: the prompt had no room for them.
    left_out: bool = False

    @property
    def seen(self) -> bool:
        """Whether the model sees its pictures itself (as image parts of the turn)."""
        return bool(self.layouts)

    def describe(self) -> str:
        """One block of plain text for the prompt ("" when the model sees the picture and nothing was read)."""
        name = f"{self.kind} {self.index + 1}"
        if self.error_code:
            return f"[{name} could not be read: {self.error_code}]"
        if self.seen and self.kind == "image":
            return f"[Text read from {name}]\n{self.text}" if self.text else ""
        props = ", ".join(f"{k}={v}" for k, v in sorted(self.features.items()))
        head = f"[{name}" + (f": {props}" if props else "") + "]"
        if self.left_out:
            what = "image left out" if self.kind == "image" else "keyframes left out"
            head += f"\n({what}: the prompt had no room for {'it' if self.kind == 'image' else 'them'})"
        if self.text is None:
            return head
        label = {"audio": "Transcript", "video": "Transcript and on-screen text"}.get(self.kind, "Text read from it")
        return f"{head}\n{label}:\n{self.text or '(no text found)'}"


def render_user_message(prompt: str, attachments: Sequence[Attachment]) -> str:
    """The user turn's text: attachments first, then the question, so the question sits next to the answer."""
    blocks = [block for block in (a.describe() for a in attachments) if block]
    return "\n\n".join([*blocks, prompt]) if blocks else prompt


@dataclass(frozen=True)
class BuiltPrompt:
    """A chat prompt fitted to the budget: as token ids for a local model, as messages for a server, and the
    pictures it shows (content hashes, in the order of their placeholders)."""

    ids: list[int]
    messages: list[dict[str, Any]]
    images: list[str] = field(default_factory=list)
    #: It was trimmed to fit (`trim`): attachment text cut, turns or pictures dropped, or the last turn cut.
    truncated: bool = False


def build_prompt(
    tokenizer: ChatTokenizer,
    prompt: str,
    attachments: Sequence[Attachment],
    budget: int,
    turns: Sequence[ChatTurn] | None = None,
    system: str = "",
    tools: Sequence[ToolSpec] = (),
    *,
    trim: bool = False,
) -> BuiltPrompt:
    """The whole chat prompt, if it fits into budget; one that does not is refused (`context_length_exceeded`),
    or with `trim` fitted into it (`_trimmed`). Without `turns` the chat is one user turn: the prompt with every
    attachment. `system`: a system prompt of the deployment's, before the chat ("" for none); `tools`: the
    functions offered. A completion's raw prompt (its one turn's role `prompt`) is encoded as it is, without the
    template (`raw_prompt`)."""
    if turns and turns[0].role == RAW_PROMPT:
        return raw_prompt(tokenizer, turns[0].text, budget, trim=trim)
    chat = list(turns) if turns else [ChatTurn(role="user", text=prompt, inputs=[a.index for a in attachments])]
    built = _fit(tokenizer, chat, attachments, system, tools)
    if len(built.ids) <= budget:
        return built
    if not trim:
        raise context_overflow(len(built.ids), budget)
    return _trimmed(tokenizer, chat, list(attachments), budget, system, tools)


def context_overflow(tokens: int, budget: int, param: str = "messages") -> ContextLengthExceeded:
    """The refusal of a prompt of `tokens` over a budget of `budget`, in the words vLLM uses (which LiteLLM and
    LangChain recognise as a context-window error)."""
    return ContextLengthExceeded(
        f"This model's maximum context length is {budget} tokens for the prompt (the rest of its context is kept for "
        f"the answer). However, your request has {tokens} input tokens. Please reduce the length of the input "
        "messages.",
        stage="tokenize",
        param=param,
    )


def _trimmed(
    tokenizer: ChatTokenizer,
    chat: list[ChatTurn],
    attachments: list[Attachment],
    budget: int,
    system: str,
    tools: Sequence[ToolSpec],
) -> BuiltPrompt:
    """The chat prompt fitted into budget: attachment text is trimmed first, then the oldest turns of the chat are
    dropped, then pictures (whole, the oldest first: a picture's placeholder tokens are never cut), then the last
    turn's text is cut."""

    def fit() -> BuiltPrompt:
        return _fit(tokenizer, chat, attachments, system, tools)

    built = fit()
    if len(built.ids) > budget and any(a.text for a in attachments):
        attachments = _trim_attachments(tokenizer, attachments, len(built.ids) - budget)
        built = fit()
    while len(built.ids) > budget and _droppable(chat):
        chat.pop(next(i for i, t in enumerate(chat) if t.role != "system"))
        built = fit()
    while len(built.ids) > budget and (shown := _shown_pictures(chat, attachments)):
        attachments = [_left_out(a) if a.index == shown[0] else a for a in attachments]
        built = fit()
    if len(built.ids) > budget:
        last = chat[-1]
        ids = tokenizer.encode_text(last.text)
        chat[-1] = last.model_copy(update={"text": _cut(tokenizer, ids, len(ids) - (len(built.ids) - budget))})
        built = fit()
    if len(built.ids) > budget:  # the template alone does not fit (no picture is left): keep its end
        built = replace(built, ids=built.ids[len(built.ids) - budget :])
    return replace(built, truncated=True)


def raw_prompt(tokenizer: ChatTokenizer, text: str, budget: int, *, trim: bool = False) -> BuiltPrompt:
    """A completion's prompt as the model continues it: its text encoded as plain text (no chat template, no system
    prompt, no control token); one over the budget is refused, or with `trim` its end kept (the text next to the
    answer)."""
    ids = tokenizer.encode_text(text)
    if len(ids) > budget and not trim:
        raise context_overflow(len(ids), budget, param="prompt")
    kept = ids[max(len(ids) - budget, 0) :]
    return BuiltPrompt(kept, [{"role": RAW_PROMPT, "content": text}], truncated=len(kept) < len(ids))


def build_prompt_ids(
    tokenizer: ChatTokenizer, prompt: str, attachments: Sequence[Attachment], budget: int, *, trim: bool = False
) -> list[int]:
    """Token ids of the whole chat prompt (see `build_prompt`)."""
    return build_prompt(tokenizer, prompt, attachments, budget, trim=trim).ids


def material_chars(turns: Sequence[ChatTurn], tools: Sequence[ToolSpec] = ()) -> int:
    """The characters of a chat's prompt material: every turn's text, the calls an assistant turn makes (their ids,
    function names and arguments), the call a tool turn answers, and the offered tools as the prompt spells them
    (JSON)."""
    calls = sum(_call_chars(call) for turn in turns for call in turn.tool_calls)
    answered = sum(len(turn.tool_call_id or "") for turn in turns)
    return sum(len(turn.text) for turn in turns) + calls + answered + sum(tool_chars(tool) for tool in tools)


def tool_chars(tool: ToolSpec) -> int:
    """The characters of one offered tool as the prompt spells it (`stoker.core.tools.tools_prompt`)."""
    return len(json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False))


def _call_chars(call: dict[str, Any]) -> int:
    """The characters of one call an assistant turn made (OpenAI's `tool_calls` entry): its id, its function's name
    and its arguments."""
    function = call.get("function") or {}
    return sum(len(str(part or "")) for part in (call.get("id"), function.get("name"), function.get("arguments")))


def _droppable(chat: Sequence[ChatTurn]) -> bool:
    """More than the last turn besides the system ones: the oldest can go."""
    return sum(1 for t in chat if t.role != "system") > 1


def _shown_pictures(chat: Sequence[ChatTurn], attachments: Sequence[Attachment]) -> list[int]:
    """Indices of the attachments whose pictures the prompt still shows, in the chat's order."""
    by_index = {a.index: a for a in attachments}
    return [i for t in chat for i in t.inputs if i in by_index and by_index[i].pictures and not by_index[i].error_code]


def _left_out(attachment: Attachment) -> Attachment:
    return replace(attachment, pictures=(), layouts=(), left_out=True)


def offered_tools(chat: Conversation | None) -> tuple[ToolSpec, ...]:
    """The functions a chat offers the model: its tools, unless it said the answer calls none."""
    return chat.params.tools if chat and chat.params.calls != "none" else ()


def _fit(
    tokenizer: ChatTokenizer,
    chat: Sequence[ChatTurn],
    attachments: Sequence[Attachment],
    system: str,
    tools: Sequence[ToolSpec],
) -> BuiltPrompt:
    shown = _messages(chat, attachments, system)
    ids = tokenizer.render([_rendered(m) for m in shown], tools)
    messages = [{k: v for k, v in m.items() if k != "layouts"} for m in shown]
    return BuiltPrompt(ids, messages, [p for m in messages for p in m.get("images", [])])


def _rendered(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the tokenizer renders it: role, text, its calls or the call it answers, and the layouts of the
    pictures the model sees."""
    out: dict[str, Any] = {k: message[k] for k in ("role", "content", "tool_calls", "tool_call_id") if k in message}
    return {**out, "images": message["layouts"]} if message.get("layouts") else out


def _messages(chat: Sequence[ChatTurn], attachments: Sequence[Attachment], system: str) -> list[dict[str, Any]]:
    """The deployment's system prompt (if any), then each turn as it was sent; a user turn is its attachments'
    text and its own, and names the pictures it carried (`images`), with their layouts for a model that sees
    (`layouts`). A model that sees is shown only the pictures it has layouts for."""
    by_index = {a.index: a for a in attachments}
    sees = any(a.seen for a in attachments)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for turn in chat:
        own = [by_index[i] for i in turn.inputs if i in by_index]
        message: dict[str, Any] = {"role": turn.role, "content": render_user_message(turn.text, own)}
        if turn.tool_calls:
            message["tool_calls"] = turn.tool_calls
        if turn.tool_call_id is not None:
            message["tool_call_id"] = turn.tool_call_id
        shown = [a for a in own if a.seen or not sees]
        pictures = [p for a in shown for p in a.pictures]
        if pictures:
            message["images"] = pictures
        layouts = [layout for a in shown for layout in a.layouts]
        if layouts:
            message["layouts"] = layouts
        messages.append(message)
    return messages


def _cut(tokenizer: ChatTokenizer, ids: Sequence[int], keep_tokens: int) -> str:
    """The text of a text's first keep_tokens token ids, marked as cut."""
    if keep_tokens <= 0:
        return ""
    return tokenizer.decode_text(ids[:keep_tokens]) + " …"


def _trim_attachments(tokenizer: ChatTokenizer, attachments: Sequence[Attachment], overflow: int) -> list[Attachment]:
    """Cut attachment texts, longest first, until overflow tokens (plus slack for markers) are gone."""
    encoded = [tokenizer.encode_text(a.text or "") for a in attachments]  # once: counted here, cut below
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
    """How one preprocessed input appears in the prompt: its pictures, the text read from it (and a video's
    on-screen text), a few facts."""
    frames = [f for f in record.frames or [] if f.status == "ok"]
    texts = [record.text] + [f"On screen at {f.time_s:.1f}s: {f.text}" for f in frames if f.text]
    read = [t for t in texts if t is not None]
    keep = ("format", "width", "height", "duration_s")
    pictures = [p for p in ([record] if record.kind == "image" and record.status == "ok" else frames) if p.content_hash]
    layouts = tuple(p.prepared["layout"] for p in pictures if p.prepared)
    return Attachment(
        kind=record.kind,
        index=record.index,
        text="\n".join(t for t in read if t) if read else None,
        features={k: v for k, v in (record.features or {}).items() if k in keep},
        error_code=record.error.code if record.error else None,
        pictures=tuple(p.content_hash for p in pictures),
        layouts=layouts if len(layouts) == len(pictures) else (),
    )
