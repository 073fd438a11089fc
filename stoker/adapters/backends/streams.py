"""A local model's answers streamed while its batch generates: a hook `generate` calls once per decoding step
(as a logits processor that leaves the scores alone) sends each streamed row's new text to its job.

`transformers`' own streamers take a batch of one; this one follows every row of a batch at once, each to its
own answer stream."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stoker.core.batching import strip_generated
from stoker.core.streaming import TextStream

log = logging.getLogger(__name__)

#: Where a piece of a job's answer goes (`AnswerStreams.append`: job id, piece).
Pieces = Callable[[str, str], None]


@dataclass
class StreamedRow:
    """One row of the generate call that is streamed: its job, how many new tokens it may keep, and its text."""

    row: int
    job_id: str
    limit: int
    text: TextStream
    #: The answer's tokens from earlier calls (it goes on).
    prefix: list[int] = field(default_factory=list)


class RowStreams:
    """Sends each streamed row's text as it grows; `finish` sends what is left of each final answer."""

    def __init__(
        self,
        rows: Sequence[StreamedRow],
        width: int,
        decode: Callable[[list[int]], str],
        stop_ids: set[int],
        pieces: Pieces,
    ) -> None:
        self.rows = list(rows)
        self.width = width
        self.decode = decode
        self.stop_ids = stop_ids
        self.pieces = pieces

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if input_ids.shape[1] > self.width:
            for streamed in self.rows:
                self._send(streamed, self._new(streamed, input_ids[streamed.row].tolist()))
        return scores

    def _new(self, streamed: StreamedRow, row: list[int]) -> list[int]:
        """A row's answer so far: its earlier tokens and this call's, up to its end and its limit."""
        (new,) = strip_generated([row], self.width, self.stop_ids)
        return [*streamed.prefix, *new][: streamed.limit]

    def _send(self, streamed: StreamedRow, ids: list[int]) -> None:
        self._put(streamed.job_id, streamed.text.advance(self.decode(ids)))

    def sent(self, row: int) -> str:
        """What of a row's answer was sent so far ("" for a row not streamed)."""
        return next((s.text.sent for s in self.rows if s.row == row), "")

    def finish(self, row: int, final: str) -> None:
        """The rest of a streamed row's final answer."""
        for streamed in self.rows:
            if streamed.row == row:
                self._put(streamed.job_id, streamed.text.finish(final))

    def _put(self, job_id: str, piece: str) -> None:
        send_piece(self.pieces, job_id, piece)


def send_piece(pieces: Pieces, job_id: str, piece: str) -> None:
    """Send a piece of a job's answer (nothing for an empty one); one that cannot be stored is logged, never
    raised: the whole answer still will be."""
    if not piece:
        return
    try:
        pieces(job_id, piece)
    except Exception:  # a piece that cannot be stored must not fail the batch
        log.warning("a piece of job %s's answer could not be stored", job_id, exc_info=True)
