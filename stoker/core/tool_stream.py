"""An answer that may call tools, streamed: its text as `content` deltas while it is text, and each call the model
opens (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the Hermes convention of `stoker.core.tools`) as
OpenAI's `tool_calls` deltas: first the call's index, id, type and name, then its arguments in fragments as they
are written, as vLLM's Hermes parser streams them.

A delta never has to be taken back: text is held while it may be the start of `<tool_call>` or is whitespace at
its end (the text before a call ends without it, as `parse_tool_calls` strips it), and a call's
arguments while their end may be the close of the call's object (`}`) or of its tag, so the fragments joined are
the call's arguments. A call whose name comes after its arguments, or that is not a call of an offered tool, is
sent when it closes: whole, or (not a call) as the text it was, as `parse_tool_calls` reads it.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Collection
from typing import Any

from stoker.core.tools import CALL_CLOSE, CALL_OPEN, parse_call

#: The start of a call's body up to its arguments' value, as the model writes it.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
#: What may end a call's body without being its arguments: the close of its object, and whitespace.
_TAIL = re.compile(r"\s*\}?\s*$")


def _held(text: str, marker: str) -> int:
    """How many of the text's last characters may be the start of `marker`."""
    return max((n for n in range(1, len(marker)) if text.endswith(marker[:n])), default=0)


class ToolCallStream:
    """Chat deltas of an answer streamed piece by piece, when the request offers tools (`names`)."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = set(names)
        #: Calls streamed so far (each one's deltas carry its index).
        self.calls = 0
        self._text = ""  # outside a call: what is not sent yet
        self._body: str | None = None  # inside a call: its body so far
        self._arguments_at: int | None = None  # where its arguments start, once its name was sent
        self._arguments_sent = 0
        self._any_text = False

    @property
    def in_call(self) -> bool:
        """Whether the answer so far ends inside a call the model opened and has not closed."""
        return self._body is not None

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The deltas the next piece of the answer makes."""
        deltas: list[dict[str, Any]] = []
        if self._body is None:
            self._text += piece
        else:
            self._body += piece
        while True:
            if self._body is None:
                deltas += self._outside()
                if self._body is None:
                    return deltas
            else:
                deltas += self._inside()
                if self._body is not None:
                    return deltas

    @property
    def called(self) -> bool:
        """Whether a call's first delta went out (the answer's calls are then streamed, not sent whole)."""
        return self.calls > 0 or self._arguments_at is not None

    def close(self) -> list[dict[str, Any]]:
        """What is left at the answer's end: the text held back. A call never closed (its answer cut by its token
        limit) is dropped where nothing of it went out, and left as far as it was sent where its name did."""
        if self._body is not None:
            return []
        return self._content(self._text.rstrip() if self.called else self._text)  # an answer of text keeps its own

    def _outside(self) -> list[dict[str, Any]]:
        opened = self._text.find(CALL_OPEN)
        if opened < 0:
            # held: what may open a call, and whitespace at the end (dropped if a call or the answer's end follows)
            ready = self._text[: len(self._text) - _held(self._text, CALL_OPEN)].rstrip()
            ready, self._text = self._text[: len(ready)], self._text[len(ready) :]
            return self._content(ready)
        before, self._body, self._text = self._text[:opened], self._text[opened + len(CALL_OPEN) :], ""
        self._arguments_at, self._arguments_sent = None, 0
        return self._content(before.rstrip() if self._any_text else before.strip())

    def _inside(self) -> list[dict[str, Any]]:
        assert self._body is not None
        deltas = self._named() if self._arguments_at is None else []
        closed = self._body.find(CALL_CLOSE)
        if closed < 0:
            if self._arguments_at is not None:
                deltas += self._arguments(self._body, final=False)
            return deltas
        body, self._text = self._body[:closed], self._body[closed + len(CALL_CLOSE) :].lstrip()
        deltas += self._arguments(body, final=True) if self._arguments_at is not None else self._whole(body)
        self._body = None
        return deltas

    def _named(self) -> list[dict[str, Any]]:
        """The call's first delta, once its name is written (before its arguments) and is an offered tool's."""
        assert self._body is not None
        head = _HEAD.match(self._body)
        if head is None or head.group(1) not in self.names:
            return []
        self._arguments_at = head.end()
        return [self._call_delta({"name": head.group(1), "arguments": ""}, opening=True)]

    def _arguments(self, body: str, final: bool) -> list[dict[str, Any]]:
        """The next fragment of the call's arguments; `final`: the call closed, so all of them."""
        assert self._arguments_at is not None
        written = body[self._arguments_at :]
        if not final:
            written = written[: len(written) - _held(written, CALL_CLOSE)]
        ready = _TAIL.sub("", written, count=1)
        fragment, self._arguments_sent = ready[self._arguments_sent :], max(self._arguments_sent, len(ready))
        deltas = [self._call_delta({"arguments": fragment})] if fragment else []
        if final:
            self.calls += 1
        return deltas

    def _whole(self, body: str) -> list[dict[str, Any]]:
        """A call closed before its name was streamed: whole, or the text it was when it is no call."""
        call = parse_call(body, self.names)
        if call is None:
            return self._content(f"{CALL_OPEN}{body}{CALL_CLOSE}")
        delta = self._call_delta(call.function.model_dump(), opening=True)
        self.calls += 1
        return [delta]

    def _call_delta(self, function: dict[str, Any], opening: bool = False) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": self.calls}
        if opening:
            entry.update(id=f"call_{secrets.token_hex(12)}", type="function")
        entry["function"] = function
        return {"tool_calls": [entry]}

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text or (not self._any_text and not text.strip()):
            return []
        self._any_text = True
        return [{"content": text}]
