"""A streamed response's events, in the order of the Responses API: `response.created`, `response.in_progress`, the
message item and its `output_text` part opened before the first text delta, the deltas, their `…done` events, each
function call as an item with its arguments, then `response.completed` (or `response.incomplete`,
`response.failed`). Plain values in, event bodies out: the API only sends them.

With tools offered, the text is held back from the point where it may turn out to open a call (the Hermes
`<tool_call>` markup): what the client sees as text is never a call's markup; the calls come as items once the
answer is parsed.
"""

from __future__ import annotations

from typing import Any

from stoker.core.responses import message_item
from stoker.core.tools import CALL_OPEN


class ResponseEvents:
    """The events of one streamed response, numbered in order (`sequence_number`)."""

    def __init__(self, started: dict[str, Any], gated: bool) -> None:
        #: The response as it starts (`in_progress`, no output yet).
        self.started = started
        self.gated = gated
        self.number = 0
        self.message_id = f"msg_{started['id']}"
        self.opened = False
        self.seen = ""  # every piece the backend streamed
        self.sent = ""  # the text sent as deltas

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        body = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return body

    def opening(self) -> list[dict[str, Any]]:
        """`response.created` and `response.in_progress`."""
        return [
            self._event("response.created", response=self.started),
            self._event("response.in_progress", response=self.started),
        ]

    def text(self, piece: str) -> list[dict[str, Any]]:
        """A piece of the answer's text as deltas (the message opened before the first)."""
        self.seen += piece
        safe = _before_call(self.seen) if self.gated else self.seen
        if self.gated and not safe.strip():  # what comes before a call alone opens no message
            return []
        return self._delta(safe[len(self.sent) :]) if safe.startswith(self.sent) else []

    def _delta(self, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        events = self._open_message()
        self.sent += delta
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        events.append(self._event("response.output_text.delta", **where, delta=delta, logprobs=[]))
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        if self.opened:
            return []
        self.opened = True
        item = {**message_item(self.message_id, "", "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **where, part=part),
        ]

    def finish(self, final: dict[str, Any]) -> list[dict[str, Any]]:
        """The rest of the answer once it ended (`final`: the whole `response`): the text not yet sent, each item's
        `…done` events, each call's item and arguments, then the response's own end."""
        events: list[dict[str, Any]] = []
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":
                events.extend(self._message_done(item))
            else:
                events.extend(self._call(index, item))
        end = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(final["status"])
        events.append(self._event(end or "response.failed", response=final))
        return events

    def _message_done(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        part = item["content"][0]
        text = part["text"]
        events = self._delta(text[len(self.sent) :]) if text.startswith(self.sent) else []
        events = [*self._open_message(), *events]
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        events.append(self._event("response.output_text.done", **where, text=text, logprobs=[]))
        events.append(self._event("response.content_part.done", **where, part=part))
        events.append(self._event("response.output_item.done", output_index=0, item=item))
        return events

    def _call(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        where = {"item_id": item["id"], "output_index": index}
        opened = {**item, "arguments": "", "status": "in_progress"}
        return [
            self._event("response.output_item.added", output_index=index, item=opened),
            self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=index, item=item),
        ]


def _before_call(text: str) -> str:
    """The text that cannot be part of a call's markup: all of it before a call opens, less an ending that may be
    the start of one."""
    opened = text.find(CALL_OPEN)
    if opened >= 0:
        return text[:opened]
    for keep in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-keep:]):
            return text[:-keep]
    return text
