"""Per-job deadlines, and what the reaper does about a job that is late. Pure values and decisions, no I/O.

A job has one deadline. Preprocessing may use it up to `preprocess_by`, which keeps an inference reserve back
(never more than half the deadline); when that runs out the job goes to the model with what it has. A job that
reaches the model after its deadline is dropped, never computed for nobody.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stoker.core.jobs import TERMINAL


@dataclass(frozen=True)
class Deadline:
    """When a job must be answered, and when its preprocessing must hand over (seconds since the epoch)."""

    at: float
    preprocess_by: float


def deadline_for(accepted: float, deadline_ms: int, infer_reserve_ms: int) -> Deadline:
    """The job's deadline, and its preprocessing budget: the deadline less a reserve of at most half of it."""
    reserve_ms = min(infer_reserve_ms, deadline_ms / 2)
    return Deadline(at=accepted + deadline_ms / 1000, preprocess_by=accepted + (deadline_ms - reserve_ms) / 1000)


@dataclass(frozen=True)
class JobClock:
    """What the reaper reads about a job: its status, its deadlines, and how far it got."""

    status: str | None  # None: the record is gone
    deadline: float
    preprocess_by: float
    preprocessed: float | None = None
    infer_start: float | None = None
    redrives: int = 0
    accepted: float | None = None
    #: When its first stage started it, and when a stage last wrote an input record (or a band of one).
    started: float | None = None
    progressed: float | None = None

    @property
    def last_progress(self) -> float | None:
        """The last time the job moved: accepted, started, or a stage result written."""
        moments = [t for t in (self.accepted, self.started, self.progressed) if t is not None]
        return max(moments) if moments else None


@dataclass(frozen=True)
class ReapPolicy:
    """How long the reaper lets a job sit before acting (seconds)."""

    #: Handed to inference but not started for this long: its message is presumed lost and sent again.
    redrive_after_s: float = 120.0
    max_redrives: int = 3
    #: A batch that ran this long (plus redrive_after_s for a redelivery) will not report any more.
    batch_timeout_s: float = 60.0
    #: After a cut-off, look again this soon in case the hand-over itself did not happen.
    recheck_s: float = 5.0
    #: The broker's: a message a dead worker held is back in its queue after this long (it outlasts every stage).
    visibility_timeout_s: float = 300.0


Action = Literal["forget", "wait", "cutoff", "expire", "restart", "redrive", "abandon"]


@dataclass(frozen=True)
class Verdict:
    """What to do with a job now, and when to look at it next."""

    action: Action
    next_at: float | None = None


def decide(clock: JobClock, now: float, policy: ReapPolicy) -> Verdict:
    """What the reaper does with one job at time `now`.

    forget   the job is gone or finished
    cutoff   preprocessing budget spent: fail unfinished inputs as deadline_exceeded, go to inference
    restart  its preprocessing messages may be lost, send it again (the reaper does so only while the CPU queues
             are empty, where no message of it can be waiting): accepted long ago and no stage ever started it, or
             started and no stage wrote anything for longer than a dead worker's messages take to come back
    expire   deadline passed before the model started: fail the job as deadline_exceeded
    redrive  handed to inference long ago and never started: send it to the inference queue again
    abandon  a batch started so long ago that it will never report: fail the job as inference_failed
    """
    if clock.status is None or clock.status in TERMINAL:
        return Verdict("forget")
    if clock.infer_start is not None:
        give_up_at = clock.infer_start + policy.batch_timeout_s + policy.redrive_after_s
        return Verdict("abandon") if now >= give_up_at else Verdict("wait", give_up_at)
    if now >= clock.deadline:
        return Verdict("expire")
    if clock.preprocessed is None:
        if now >= clock.preprocess_by:
            return Verdict("cutoff", min(now + policy.recheck_s, clock.deadline))
        restart_at = restart_due(clock, policy)
        if restart_at is None:
            return Verdict("wait", clock.preprocess_by)
        if now >= restart_at:
            return Verdict("restart", min(now + policy.redrive_after_s, clock.preprocess_by))
        return Verdict("wait", min(restart_at, clock.preprocess_by))
    redrive_at = clock.preprocessed + policy.redrive_after_s * (clock.redrives + 1)
    if clock.redrives < policy.max_redrives and now >= redrive_at:
        return Verdict("redrive", min(now + policy.redrive_after_s, clock.deadline))
    if clock.redrives < policy.max_redrives:
        return Verdict("wait", min(redrive_at, clock.deadline))
    return Verdict("wait", clock.deadline)


def restart_due(clock: JobClock, policy: ReapPolicy) -> float | None:
    """When a job not yet handed to inference is presumed to have lost its preprocessing messages, each try waiting
    longer than the one before; None when it is not sent again (its re-sends are spent, or no stage can have it).

    Queued: `redrive_after_s` after it was accepted, and no stage started it. Preprocessing: the visibility timeout
    plus `redrive_after_s` after its last progress. kombu's Redis transport takes a message off its queue before it
    records it as unacknowledged, so a worker killed in between loses it for good; by then any message of the job
    that was not lost has run or is back in a queue, which the reaper looks at before it sends anything again.
    """
    if clock.redrives >= policy.max_redrives:
        return None
    tries = clock.redrives + 1
    if clock.status == "queued" and clock.accepted is not None:
        return clock.accepted + policy.redrive_after_s * tries
    last = clock.last_progress
    if clock.status == "preprocessing" and last is not None:
        return last + (policy.visibility_timeout_s + policy.redrive_after_s) * tries
    return None
