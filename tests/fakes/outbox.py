"""An `Outbox` for a context whose test sends nothing through the broker: each call fails the test, saying what was
sent. Each method is marked `@override` and typed as the protocol's, so a seam renamed or re-typed fails type
checks here."""

from __future__ import annotations

from collections.abc import Iterable

from typing_extensions import override

from stoker.core.jobs import Job, JobClass
from stoker.runtime.seams import Outbox


class NoOutbox(Outbox):
    """A broker nothing is sent through, and whose depths nobody reads."""

    @override
    def enqueue_inference(
        self, job_id: str, prompt_tokens: int | None, deadline: float | None, job_class: JobClass = "interactive"
    ) -> None:
        raise AssertionError(f"job {job_id} enqueued for inference through an outbox the test never uses")

    @override
    def send_callback(self, job_id: str) -> None:
        raise AssertionError(f"job {job_id}'s callback sent through an outbox the test never uses")

    @override
    def resubmit(self, job: Job, deadline: float | None) -> None:
        raise AssertionError(f"job {job.id} resubmitted through an outbox the test never uses")

    @override
    def queue_depths(self, queues: Iterable[str], timeout_s: float | None = None) -> dict[str, int]:
        raise AssertionError("queue depths read from an outbox the test never uses")

    @override
    def promote_aged(self, queues: Iterable[str], max_age_s: float) -> int:
        raise AssertionError("aged messages promoted through an outbox the test never uses")
