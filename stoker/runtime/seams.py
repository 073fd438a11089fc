"""The runtime's seams to the broker: what it sends (`Outbox`) and what it holds (`Message`). Celery implements
them in `tasks`; a unit test implements them in memory."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from stoker.core.jobs import Job, JobClass


class Outbox(Protocol):
    """What the runtime sends through the broker, and how full its queues are."""

    def enqueue_inference(
        self, job_id: str, prompt_tokens: int | None, deadline: float | None, job_class: JobClass = "interactive"
    ) -> None:
        """Put a tokenized job on the inference queue (a batch line's behind interactive jobs)."""

    def send_callback(self, job_id: str) -> None:
        """Hand an ended job's completion callback to a CPU worker."""

    def resubmit(self, job: Job, deadline: float | None) -> None:
        """Send a job to preprocessing again: no stage started it, or its preprocessing stopped moving (a message
        was lost)."""

    def queue_depths(self, queues: Iterable[str], timeout_s: float | None = None) -> dict[str, int]:
        """Each queue's depth now; raises while the broker does not answer."""

    def promote_aged(self, queues: Iterable[str], max_age_s: float) -> int:
        """Lift medium and large inputs' stage messages that waited `max_age_s` to the front of their queues (the
        age bound of small-before-large); how many moved."""


class Message(Protocol):
    """A broker message a consumer holds until it acks it or hands it back (a Celery request)."""

    @property
    def id(self) -> str:
        """The message's task id."""

    @property
    def kwargs(self) -> dict[str, Any] | None:
        """What the message carries."""

    def acknowledge(self) -> None:
        """Done with: the broker forgets it."""

    def reject(self, requeue: bool = False) -> None:
        """Handed back (to the queue, with requeue)."""


class LineSource(Protocol):
    """Batch lines' inference messages, taken one at a time when the consumer has room for them."""

    def take(self) -> Message | None:
        """The next line's message waiting, or None; raises while the broker does not answer."""

    def close(self) -> None:
        """Let go of the broker (lines taken and not settled go back to their queue)."""


class Intake(Protocol):
    """Interactive inference messages, as many as the consumer has room for at once (a Redis broker's queue read
    directly; on RabbitMQ, Celery's consumer hands them over instead)."""

    def wait_below(self, most: int, timeout_s: float) -> int:
        """Wait until fewer than `most` messages are held (at most `timeout_s`); how many are held."""

    def take(self, most: int, block_s: float) -> Sequence[Message]:
        """Up to `most` messages, waiting up to `block_s` for the first; raises while the broker does not
        answer."""

    def close(self) -> None:
        """Let go of the broker (what is held and not settled is restored by the broker's redelivery)."""
