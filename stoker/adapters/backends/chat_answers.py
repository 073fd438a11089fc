"""A chat-completions server's answers read back (the `openai` backend's, `stoker.adapters.backends.remote`): a
whole answer's choices, or a streamed one's Server-Sent Events put back together and handed on piece by piece."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from stoker.core.errors import InferenceFailed
from stoker.core.model import FinishReason, Prediction
from stoker.core.tools import CALL_CLOSE, CALL_OPEN


def sse_chunks(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a Server-Sent Events stream of chat-completion chunks, up to `[DONE]`.

    By hand: the stream is `data: <json>` lines, and an SSE client library would be one more dependency for
    three lines of parsing."""
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments (keep-alives), other fields
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise InferenceFailed(f"the inference server sent a malformed chunk: {data[:80]}", stage="infer") from exc
        if "error" in chunk:
            raise InferenceFailed(f"the inference server failed mid-stream: {chunk['error']}", stage="infer")
        yield chunk


class StreamedChat:
    """A streamed chat answer put back together (text, calls, finish reason, usage), and handed on piece by piece
    as the local model's answer is: its content as it comes, and each call the server streams as `tool_calls`
    deltas written back as the Hermes markup the model would have written (`<tool_call>{"name": …, "arguments":
    …}</tool_call>`, `stoker.core.tools`), its name once it comes and its arguments fragment by fragment, so the
    API's `ToolCallStream` streams it on to the client as it arrives. A call cut by the token limit is left
    unclosed, as the local model leaves it (the API drops it; the answer has no calls, `finish_reason` `length`)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.finish_reason = "stop"
        self.usage: dict[str, Any] = {}
        self._open = False  # the last call's markup is open in the pieces handed on
        self._arguments_sent = 0

    def add(self, chunk: dict[str, Any]) -> str:
        """Take one chunk (its first choice: a stream is asked for with `n` 1); its piece ('' for none)."""
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or []:
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            delta = choice.get("delta") or {}
            content = str(delta.get("content") or "")
            self.text.append(content)
            piece = (self._close() + content) if content else ""  # text after a call: the call ended
            return piece + "".join(self._call_piece(call) for call in delta.get("tool_calls") or [])
        return ""

    def rest(self) -> str:
        """What is left to hand on once the stream ended: the close of its last call, unless the limit cut it."""
        return "" if self.finish_reason == "length" else self._close()

    def _call_piece(self, delta: dict[str, Any]) -> str:
        """The markup one `tool_calls` delta adds: a new call closes the one before it."""
        piece = ""
        if int(delta.get("index", max(len(self.calls) - 1, 0))) >= len(self.calls):
            piece = self._close()
            self.calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call, function = self.calls[-1], delta.get("function") or {}
        call["id"] = delta.get("id") or call["id"]
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""
        return piece + self._markup(call["function"])

    def _markup(self, function: dict[str, str]) -> str:
        """What of the call's markup is not handed on yet: its head once its name came, then its arguments."""
        if not function["name"]:
            return ""
        head = ""
        if not self._open:
            self._open, self._arguments_sent = True, 0
            head = f'{CALL_OPEN}\n{{"name": {json.dumps(function["name"])}, "arguments": '
        fragment = function["arguments"][self._arguments_sent :]
        self._arguments_sent += len(fragment)
        return head + fragment

    def _close(self) -> str:
        if not self._open:
            return ""
        self._open = False
        return ("{}" if self._arguments_sent == 0 else "") + f"}}\n{CALL_CLOSE}"

    def prediction(self) -> Prediction:
        """The whole answer: its text, and its calls unless the limit cut them."""
        calls = self.calls if self.calls and self.finish_reason != "length" else None
        ending: FinishReason = "tool_calls" if calls else "length" if self.finish_reason == "length" else "stop"
        return Prediction(
            text="".join(self.text),
            prompt_tokens=int(self.usage.get("prompt_tokens", 0)),
            completion_tokens=int(self.usage.get("completion_tokens", 0)),
            finish_reason=ending,
            tool_calls=calls,
        )


def answer_of(data: dict[str, Any]) -> Prediction:
    """The server's answer: its first choice, the others (`n`) after it, each with its logprobs if it sent them."""
    try:
        choices = sorted(data["choices"], key=lambda c: int(c.get("index", 0)))
        first, *more = [choice_of(c) for c in choices]
        usage = data.get("usage") or {}
    except (KeyError, ValueError, TypeError) as exc:
        raise InferenceFailed(f"the inference server's answer has no message: {exc!r}", stage="infer") from exc
    tokens = int(usage.get("completion_tokens", 0))
    return replace(first, prompt_tokens=int(usage.get("prompt_tokens", 0)), completion_tokens=tokens, more=tuple(more))


def choice_of(choice: dict[str, Any]) -> Prediction:
    text = choice["message"]["content"] or ""
    logprobs = (choice.get("logprobs") or {}).get("content")
    calls = choice["message"].get("tool_calls") or None
    ending = choice.get("finish_reason")
    return Prediction(
        text=str(text),
        prompt_tokens=0,
        completion_tokens=0,
        finish_reason="tool_calls" if calls else "length" if ending == "length" else "stop",
        logprobs=list(logprobs) if logprobs is not None else None,
        tool_calls=[dict(c) for c in calls] if calls else None,
    )
