"""Batching: when waiting requests form a batch (the policy), and how a batch is collated for the model.

Pure values in, pure values out; the inference consumer applies the policy, the predictor makes tensors.
Here, as everywhere in stoker's code, a bare "batch" is a device batch; OpenAI's Batch API object is an
`OpenAIBatch` (`stoker.core.openai_batches`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Collated:
    """A left-padded batch: every row ends at the same position, where generation starts."""

    input_ids: list[list[int]]
    attention_mask: list[list[int]]

    @property
    def width(self) -> int:
        """Padded length of every row."""
        return len(self.input_ids[0]) if self.input_ids else 0


def collate_left(sequences: Sequence[Sequence[int]], pad_id: int) -> Collated:
    """Left-pad token sequences to the longest one, with the matching attention mask."""
    if any(len(s) == 0 for s in sequences):
        raise ValueError("cannot collate an empty sequence")
    width = max((len(s) for s in sequences), default=0)
    ids = [[pad_id] * (width - len(s)) + list(s) for s in sequences]
    mask = [[0] * (width - len(s)) + [1] * len(s) for s in sequences]
    return Collated(input_ids=ids, attention_mask=mask)


def strip_generated(rows: Sequence[Sequence[int]], prompt_width: int, stop_ids: set[int]) -> list[list[int]]:
    """The newly generated ids of each row, cut at the first stop token."""
    out: list[list[int]] = []
    for row in rows:
        new = list(row[prompt_width:])
        cut = next((i for i, t in enumerate(new) if t in stop_ids), len(new))
        out.append(new[:cut])
    return out


@dataclass(frozen=True)
class Waiting:
    """A request waiting for the device: its size in prompt tokens, when it arrived, when it is due, and whether it
    is a batch line (served only after every interactive request waiting)."""

    key: str
    tokens: int
    arrived: float
    deadline: float | None = None
    batch: bool = False

    @property
    def order(self) -> tuple[bool, float]:
        """Where it stands in line: interactive requests first, each class in arrival order."""
        return (self.batch, self.arrived)


@dataclass(frozen=True)
class BatchPolicy:
    """When a batch goes to the device: `max_batch_size` items, `max_batch_tokens` prompt tokens, or `max_wait_s`
    after its first item arrived, whichever comes first."""

    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float


@dataclass(frozen=True)
class Plan:
    """What to do with the waiting requests now."""

    run: list[Waiting]
    expired: list[Waiting]
    keep: list[Waiting]
    #: When to look again if nothing changes (the oldest waiting item's flush time); None when nothing waits.
    next_at: float | None


def plan_batch(waiting: Sequence[Waiting], now: float, policy: BatchPolicy, device_free: bool = True) -> Plan:
    """Drop what is past its deadline, then decide whether the oldest requests form a batch now.

    Requests are served in arrival order. A batch is full at `max_batch_size` items or when the next item would
    take it past `max_batch_tokens` (a single item larger than the budget still runs, alone). A batch that is
    not full runs once its first item has waited `max_wait_s`. Nothing runs while the device is busy.
    """
    expired = [w for w in waiting if w.deadline is not None and w.deadline <= now]
    alive = sorted((w for w in waiting if w.deadline is None or w.deadline > now), key=lambda w: w.arrived)
    if not alive:
        return Plan([], expired, [], None)
    take, tokens = 0, 0
    while take < min(len(alive), policy.max_batch_size):
        if take and tokens + alive[take].tokens > policy.max_batch_tokens:
            break
        tokens += alive[take].tokens
        take += 1
    full = take == policy.max_batch_size or take < len(alive)
    due = alive[0].arrived + policy.max_wait_s
    if not device_free or not (full or now >= due):
        return Plan([], expired, alive, due)
    rest = alive[take:]
    return Plan(alive[:take], expired, rest, rest[0].arrived + policy.max_wait_s if rest else None)


def top_up(
    waiting: Sequence[Waiting],
    have: int,
    have_tokens: int,
    now: float,
    policy: BatchPolicy,
    interactive_in_batch: bool = False,
    line_room: int | None = None,
) -> Plan:
    """What joins the batch being prepared now, beside the `have` requests (of `have_tokens` prompt tokens)
    already in it: the oldest waiting requests that fit its size and token budget (interactive ones before any
    batch line), and those past their deadline.

    A batch line never shares a batch with an interactive request (`interactive_in_batch`: the batch already
    holds one): on a device whose batch takes longer the fuller it is, a line would make the interactive
    request's batch slower. Lines wait for a batch of their own, of at most `line_room` more lines.

    Work-conserving: nothing is held back to wait for company (`start_at` decides when the device starts).
    A request larger than the whole token budget still goes, alone, in a batch of its own.
    """
    expired = [w for w in waiting if w.deadline is not None and w.deadline <= now]
    queued = sorted((w for w in waiting if w.deadline is None or w.deadline > now), key=lambda w: w.order)
    lines_wait = interactive_in_batch or any(not w.batch for w in queued)
    interactive = [w for w in queued if not w.batch]
    lines = [] if lines_wait else [w for w in queued if w.batch][:line_room]
    alive = interactive + lines
    take, tokens = 0, have_tokens
    while take < len(alive) and have + take < policy.max_batch_size:
        alone = have + take == 0
        if not alone and tokens + alive[take].tokens > policy.max_batch_tokens:
            break
        tokens += alive[take].tokens
        take += 1
    run = alive[:take]
    return Plan(run, expired, queued[len(run) :], None)


def start_at(arrivals: Sequence[float], now: float, policy: BatchPolicy) -> float | None:
    """When a free device starts a prepared batch whose requests arrived at `arrivals`: at once by default (the
    device never idles while work waits); with `max_wait_s`, not before its first request waited that long,
    unless it is already full. None when nothing is prepared."""
    if not arrivals:
        return None
    if policy.max_wait_s <= 0 or len(arrivals) >= policy.max_batch_size:
        return now
    return min(arrivals) + policy.max_wait_s


def idle_gap_summary(gaps_s: Sequence[float]) -> dict[str, float | int]:
    """p50 and p99 (milliseconds, nearest rank) of the device's idle gaps between batches while work waited."""
    ordered = sorted(gaps_s)
    if not ordered:
        return {"samples": 0}

    def rank(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * 1000, 3)

    return {"samples": len(ordered), "p50_ms": rank(0.50), "p99_ms": rank(0.99)}
