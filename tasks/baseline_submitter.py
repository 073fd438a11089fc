"""The synchronous baseline's submitter (`STOKER_PIPELINE_MODE=sync`, benchmarks only): what the API composes in
place of the pipeline's (`api.context.default_submitter`, the one place the baseline is chosen). Its jobs go whole
to the baseline's one queue, which `tasks.baseline`'s one worker serves."""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery

from stoker.core.jobs import InputRecord, JobClass
from stoker.core.queues import QUEUES, SYNC_QUEUE
from tasks.pipeline import UNWAITED, Start, Submitter


class SyncSubmitter(Submitter):
    """The synchronous baseline (`STOKER_PIPELINE_MODE=sync`): the whole job goes to one worker as one message."""

    #: Whole jobs wait in the baseline's queue, beside the stages' (empty here) that the monitor samples as well.
    queues = (*QUEUES, SYNC_QUEUE)

    def __init__(self, app: Celery) -> None:
        self.app = app

    def submit(
        self,
        job_id: str,
        inputs: Sequence[InputRecord],
        start: Start = "preprocess",
        deadline: float | None = None,
        prompt_tokens: int | None = None,
        job_class: JobClass = "interactive",
    ) -> None:
        """Publish the job whole; the sync worker preprocesses what is not done yet, then infers.

        No `expires`: there is no reaper in the baseline, so the consumer itself answers jobs whose deadline passed.
        """
        kwargs = {"job_id": job_id, "prompt_tokens": prompt_tokens, "deadline": deadline}
        self.app.signature("stoker.sync", kwargs=kwargs, **UNWAITED).apply_async()
