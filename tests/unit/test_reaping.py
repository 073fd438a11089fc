"""The reaper's restart of a job whose preprocessing messages were lost, over an in-memory store and outbox: which
jobs it sends to preprocessing again, and which it leaves alone (no Redis, no Celery)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from stoker.core.deadlines import JobClock
from stoker.core.jobs import InputRecord, Job
from stoker.core.queues import CPU_QUEUES
from stoker.runtime.context import WorkerContext
from stoker.runtime.reaping import lift_aged, reap_once
from stoker.settings import WorkerSettings
from tests.fakes.store import MemoryStore

#: A started job is presumed to have lost its messages 300 (visibility timeout) + 120 (redrive_after_s) seconds
#: after its last progress, at most 3 times.
SETTINGS = WorkerSettings(visibility_timeout_s=300, redrive_after_s=120.0, max_redrives=3)
STARTED = 1000.0
STALLED = STARTED + 300 + 120


class RecordingOutbox:
    """Queue depths as a test sets them; every job sent to preprocessing again."""

    def __init__(self) -> None:
        self.depths = dict.fromkeys(CPU_QUEUES, 0)
        self.resubmitted: list[str] = []
        self.promoted: list[tuple[tuple[str, ...], float]] = []

    def enqueue_inference(self, job_id: str, prompt_tokens: int | None, deadline: float | None, *_: str) -> None:
        raise AssertionError("a job not yet preprocessed is never sent to inference")

    def send_callback(self, job_id: str) -> None:
        raise AssertionError("no job here ends")

    def resubmit(self, job: Job, deadline: float | None) -> None:
        self.resubmitted.append(job.id)

    def queue_depths(self, queues: Iterable[str], timeout_s: float | None = None) -> dict[str, int]:
        return {queue: self.depths[queue] for queue in queues}

    def promote_aged(self, queues: Iterable[str], max_age_s: float) -> int:
        self.promoted.append((tuple(queues), max_age_s))
        return 2


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore.empty()


@pytest.fixture
def outbox() -> RecordingOutbox:
    return RecordingOutbox()


def _reap(store: MemoryStore, outbox: RecordingOutbox, now: float) -> list[str]:
    """One pass of the reaper at `now`; the jobs it sent to preprocessing again."""
    reap_once(WorkerContext(SETTINGS, outbox, store=store), now=now)
    return outbox.resubmitted


def _stalled_job(store: MemoryStore, *, progressed: float | None = None, redrives: int = 0) -> str:
    """A job a stage started at STARTED and that is due for a look; its budget and deadline far off."""
    store.watch.clocks["j"] = JobClock(
        status="preprocessing",
        deadline=STARTED + 7200,
        preprocess_by=STARTED + 7000,
        accepted=STARTED - 1,
        started=STARTED,
        progressed=progressed,
        redrives=redrives,
    )
    store.watch.next_at["j"] = STARTED
    record = InputRecord(index=0, kind="image", content_hash="ab" * 32, size_bytes=10)
    store.jobs.records["j"] = Job(id="j", status="preprocessing", prompt="What is the order number?", inputs=[record])
    return "j"


def test_a_started_job_that_stopped_moving_is_sent_to_preprocessing_again(
    store: MemoryStore, outbox: RecordingOutbox
) -> None:
    job_id = _stalled_job(store)
    assert _reap(store, outbox, STALLED) == [job_id]
    assert store.watch.clocks[job_id].redrives == 1
    assert store.watch.next_at[job_id] == STALLED + 120  # looked at again, in case this try is lost too


def test_a_started_job_is_left_alone_until_its_messages_could_have_come_back(
    store: MemoryStore, outbox: RecordingOutbox
) -> None:
    job_id = _stalled_job(store)
    assert _reap(store, outbox, STALLED - 1) == []
    assert store.watch.next_at[job_id] == STALLED


def test_a_started_job_that_made_progress_lately_is_left_alone(store: MemoryStore, outbox: RecordingOutbox) -> None:
    job_id = _stalled_job(store, progressed=STARTED + 60)  # a stage wrote a record a minute in
    assert _reap(store, outbox, STALLED) == []
    assert store.watch.next_at[job_id] == STALLED + 60


def test_a_started_job_is_not_sent_again_while_a_cpu_queue_holds_messages(
    store: MemoryStore, outbox: RecordingOutbox
) -> None:
    job_id = _stalled_job(store)
    outbox.depths["ocr"] = 4  # its OCR message may be among them
    assert _reap(store, outbox, STALLED) == []
    assert store.watch.clocks[job_id].redrives == 0
    outbox.depths["ocr"] = 0  # the queues drained and the job still has not moved: now it is sent again
    assert _reap(store, outbox, STALLED + 120) == [job_id]


def test_a_started_job_is_sent_again_at_most_max_redrives_times(store: MemoryStore, outbox: RecordingOutbox) -> None:
    job_id = _stalled_job(store, redrives=3)
    assert _reap(store, outbox, STARTED + 5000) == []
    assert store.watch.next_at[job_id] == STARTED + 7000  # only the cut-off is left


def test_the_reaper_lifts_aged_stage_messages_of_every_cpu_queue_unless_the_bound_is_off(
    store: MemoryStore, outbox: RecordingOutbox
) -> None:
    lifted = lift_aged(WorkerContext(SETTINGS.model_copy(update={"small_first_max_age_s": 2.0}), outbox, store=store))
    assert lifted == {"lifted": 2}
    assert outbox.promoted == [(CPU_QUEUES, 2.0)]
    off = WorkerContext(SETTINGS.model_copy(update={"small_first_max_age_s": 0.0}), outbox, store=store)
    assert lift_aged(off) == {}
    assert len(outbox.promoted) == 1  # strict order by size: never asked
