"""An answer sent while it is generated: what of the text so far can go out without ever being taken back."""

from __future__ import annotations

from collections.abc import Sequence

from stoker.core.model import apply_stop


class TextStream:
    """The pieces of one answer, as its text grows token by token.

    A piece never has to be taken back: text is held while it may still turn out to be the start of a stop sequence
    (the answer ends before one, dropping it) or is an unfinished character (a token that ends inside a UTF-8
    sequence decodes to U+FFFD). So the pieces joined are always the start of the final answer, and `finish` sends
    the rest. The answer keeps the model's whitespace, as vLLM's does.
    """

    def __init__(self, stop: Sequence[str] = (), sent: str = "") -> None:
        self.stop = [s for s in stop if s]
        #: What was sent (of an answer that goes on: what earlier calls sent).
        self.sent = sent
        self.ended = False

    def advance(self, text: str) -> str:
        """The next piece, given the whole answer so far ("" when nothing more can be sent yet)."""
        if self.ended:
            return ""
        cut, stopped = apply_stop(text, self.stop)
        if stopped:
            self.ended = True
            return self._send(cut)
        return self._send(text[: len(text) - self._held(text)].rstrip("\ufffd"))

    def finish(self, final: str) -> str:
        """What is left to send of the final answer."""
        self.ended = True
        return final[len(self.sent) :] if final.startswith(self.sent) else ""

    def _held(self, text: str) -> int:
        """How many of the text's last characters may be the start of a stop sequence."""
        return max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)

    def _send(self, safe: str) -> str:
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        piece, self.sent = safe[len(self.sent) :], safe
        return piece
