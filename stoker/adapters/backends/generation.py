"""The local model's restart-based path on transformers' `generate` (`engine=False`, the decode engine's "before"):
the hooks a call runs with (stop sequences, yield points, per-row sampling) and what one call made."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from stoker.adapters.backends.calls import LocalBatch, stops_now
from stoker.adapters.backends.grammar import GrammarMask
from stoker.adapters.backends.streams import RowStreams
from stoker.core.batching import strip_generated
from stoker.core.errors import InferenceFailed
from stoker.core.model import apply_stop


class StopSequences:
    """A stopping criterion for `generate`: a row whose answer's text holds one of its request's stop sequences is
    done at the step whose token completed it (`generate` pads it from then on, and the call ends when every row
    is done), so its answer, usage and log probabilities end at that token.

    By hand rather than transformers' `StopStringCriteria`: that one takes one list of stop strings for every row
    of the call, where the rows of a call carry their own requests' stops; and it matches the stop against the
    ends of tokens, where this decodes each row's answer and looks for a stop as the answer is then cut
    (`apply_stop`), so a row ends at exactly the token the cut answer ends before."""

    def __init__(
        self,
        stops: list[tuple[str, ...]],
        prefixes: list[list[int]],
        width: int,
        decode: Callable[[list[int]], str],
        stop_ids: set[int],
    ) -> None:
        self.stops = stops
        #: Per row: the answer's tokens from earlier calls (a stop may span them and this call's).
        self.prefixes = prefixes
        self.width = width
        self.decode = decode
        self.stop_ids = stop_ids
        #: The rows a stop sequence ended.
        self.done: set[int] = set()

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch  # heavy: in the model's process only

        if input_ids.shape[1] > self.width:
            for row, stop in enumerate(self.stops):
                if stop and row not in self.done and self._holds(row, stop, input_ids[row].tolist()):
                    self.done.add(row)
        ended = [row in self.done for row in range(input_ids.shape[0])]
        return torch.tensor(ended, dtype=torch.bool, device=input_ids.device)

    def _holds(self, row: int, stop: tuple[str, ...], ids: list[int]) -> bool:
        """Whether a row's answer so far (up to its end of sequence) holds one of its stops."""
        (new,) = strip_generated([ids], self.width, self.stop_ids)
        return apply_stop(self.decode([*self.prefixes[row], *new]), stop)[1]


class YieldPoints:
    """A stopping criterion for `generate`: every `every` new tokens, the whole call stops when some of its rows
    are done and others are not (the done answers go out now rather than with the longest), or when a request
    waits for the device and the call has room for it (it joins the next call); else the call goes on. A row is
    done at its end of sequence, at its limit, or when one of its stop sequences ended it (`finished`)."""

    def __init__(
        self,
        every: int,
        width: int,
        rest: list[int],
        stop_ids: set[int],
        waiting: Callable[[], int],
        max_rows: int,
        finished: Collection[int] = (),
    ) -> None:
        self.every = every
        self.finished = finished
        self.width = width
        #: Per row: the new tokens it may still have in this call.
        self.rest = rest
        self.stop_ids = sorted(stop_ids)
        self.waiting = waiting
        self.max_rows = max_rows

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch  # heavy: in the model's process only

        rows, steps = input_ids.shape[0], input_ids.shape[1] - self.width
        stop = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
        if steps == 0 or steps % self.every:
            return stop
        ended = torch.isin(input_ids[:, self.width :], torch.tensor(self.stop_ids, device=input_ids.device)).any(1)
        rest = enumerate(zip(ended.tolist(), self.rest, strict=True))
        done = [bool(e) or steps >= r or row in self.finished for row, (e, r) in rest]
        return ~stop if stops_now(rows - sum(done), rows, self.max_rows, self.waiting) else stop


@dataclass(frozen=True)
class Generated:
    """What one generate call made: every row's ids, with `logprobs` each row's steps, the streamed rows, and the
    rows' grammars (which say what rows broke theirs)."""

    batch: LocalBatch
    rows: list[list[int]]
    steps: Steps | None
    streams: RowStreams | None = None
    grammars: GrammarMask | None = None

    def broken(self, rows: range) -> InferenceFailed | None:
        """The error of a request whose rows (one of them) broke their grammar mid-answer; None when none did."""
        failed = self.grammars.failed if self.grammars is not None else {}
        reason = next((failed[row] for row in rows if row in failed), None)
        if reason is None:
            return None
        return InferenceFailed(f"the answer could not be held to its format ({reason}): it was ended", stage="infer")


@dataclass(frozen=True)
class RowDraws:
    """Where a sampled row's draws come from: its request's seed, which of the request's answers it is, and how
    many tokens the answer had before this call."""

    seed: int
    answer: int
    offset: int

    def uniform(self, step: int) -> float:
        """The draw for this call's `step`-th token: a number in [0, 1) fixed by the seed, the answer and the
        token's place in it, and by nothing else (neither the other rows of the call nor the calls before)."""
        place = f"{self.seed}:{self.answer}:{self.offset + step}".encode()
        bits = int.from_bytes(hashlib.blake2b(place, digest_size=8).digest(), "little")
        return (bits >> 11) * 2.0**-53  # the top 53 bits: every double in [0, 1) a draw can be


class RowSampler:
    """A logits processor that samples each row's next token itself and leaves it the only one `generate` can take:
    the scores warped as transformers warps them (temperature; the model's own top_k, if its generation config sets
    one; top_p), then the token where the row's own draw (`RowDraws.uniform`) falls in their cumulative
    distribution.

    By hand, because generate's sampling draws every row from one global generator: a row's tokens would then
    depend on the rows beside it, and a seed set at each call would start over at every continuation."""

    def __init__(self, temperature: float, top_p: float, top_k: int | None, rows: list[RowDraws], width: int) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper  # heavy: see setup()

        warpers: list[Any] = [TemperatureLogitsWarper(temperature)]
        if top_k:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1:
            warpers.append(TopPLogitsWarper(top_p))
        self.warpers = warpers
        self.rows = rows
        self.width = width

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch  # heavy: in the model's process only

        for warp in self.warpers:
            scores = warp(input_ids, scores)
        step = input_ids.shape[1] - self.width
        probs = torch.softmax(scores.double(), dim=-1)
        cumulative = probs.cumsum(-1)
        draws = torch.tensor([[r.uniform(step)] for r in self.rows], dtype=torch.float64, device=scores.device)
        chosen = torch.searchsorted(cumulative, draws * cumulative[:, -1:], right=True)
        last = (probs > 0).long().cumsum(-1).argmax(-1, keepdim=True)  # each row's last token that can be drawn
        chosen = torch.minimum(chosen, last)
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen, 0.0)


#: One generated token's (id, log probability), and the likeliest tokens' at its place.
Step = tuple[tuple[int, float], list[tuple[int, float]]]
#: Per row of a generate call, per new token.
Steps = list[list[Step]]


def step_logprobs(torch: Any, out: Any, width: int, top: int) -> Steps:
    """Each row's new tokens' log probabilities under the model's raw logits (before temperature or top_p, as
    OpenAI's), with the `top` likeliest tokens at each place."""
    logits = torch.stack(out.logits, dim=1).float()  # rows x new tokens x vocabulary
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = out.sequences[:, width : width + logits.shape[1]]
    picked = logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    best = logprobs.topk(top, dim=-1) if top else None
    rows: Steps = []
    for row in range(logits.shape[0]):
        tokens = list(zip(chosen[row].tolist(), picked[row].tolist(), strict=True))
        rows.append(list(zip(tokens, _alternatives(best, row, len(tokens)), strict=True)))
    return rows


def _alternatives(best: Any, row: int, count: int) -> list[list[tuple[int, float]]]:
    """A row's likeliest tokens at each of its `count` places (none when no `top_logprobs` were asked)."""
    if best is None:
        return [[] for _ in range(count)]
    indices, values = best.indices[row].tolist(), best.values[row].tolist()
    return [list(zip(i, v, strict=True)) for i, v in zip(indices, values, strict=True)]
