"""The canvas of a job: every input's branch in parallel (a chord header), then tokenize, which hands off to infer.

image  decode → ocr
audio  probe → transcribe
video  probe → transcribe, and per keyframe slot: keyframe → decode → ocr
url    fetch, then the branches of its kind (a video's in parallel: chain(fetch, group(...)))
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import redis.asyncio as aioredis
from celery import Celery, chain, chord, group
from celery.canvas import Signature, _chain

from stoker.adapters.broker import class_priority, queue_depths, stage_priority
from stoker.adapters.kombu_redis import promote_aged
from stoker.adapters.store.keys import frame_ref, input_ref
from stoker.core.jobs import InputRecord, Job, JobClass, renders_pictures
from stoker.core.queues import INFER_BATCH_QUEUE, QUEUES
from tasks.publish import DirectPublisher

#: Where a job enters the pipeline: from the start, at tokenize (inputs cached), at inference (prompt cached); a
#: render (`/v1/chat/completions/render`) has a canvas of its own (`render_branches`), and one whose every picture
#: is cached rendered has none: it is `ended` as it is taken in (no message is sent for it).
Start = Literal["preprocess", "tokenize", "infer", "render", "ended"]
#: Options of a message nobody waits on for a Celery result (stoker's results are in its job store). Without it,
#: Celery's Redis result backend subscribes the publishing process to the task's result channel at every publish
#: (and unsubscribes when the handle is collected): two commands and a result-consumer round per job in the API.
#: A chord's header tasks keep their results: the chord's counting is Celery's.
UNWAITED: dict[str, Any] = {"ignore_result": True}


class Submitter(Protocol):
    """Starts the processing of an accepted job. The API depends on this seam, not on Celery: it submits from its
    event loop (`submit_on`) and closes the submitter when it stops. A submitter that only has a blocking `submit`
    subclasses this and is given both: `submit` in a worker thread, and nothing to close."""

    #: The queues the jobs it submits wait in: the API's queue monitor samples them for admission.
    queues: tuple[str, ...] = QUEUES

    def submit(
        self,
        job_id: str,
        inputs: Sequence[InputRecord],
        start: Start = "preprocess",
        deadline: float | None = None,
        prompt_tokens: int | None = None,
        job_class: JobClass = "interactive",
    ) -> None:
        """Enqueue the job's work from `start` on (a batch line's behind every interactive job's); raises if the
        broker cannot take it."""

    async def submit_on(
        self,
        client: aioredis.Redis[bytes] | None,
        job_id: str,
        inputs: Sequence[InputRecord],
        start: Start = "preprocess",
        deadline: float | None = None,
        prompt_tokens: int | None = None,
        job_class: JobClass = "interactive",
    ) -> None:
        """`submit`, from an asyncio loop, which `client` (an asyncio client of the broker's Redis; None: there is
        none) may serve without leaving the loop; by default `submit` in a worker thread."""
        await asyncio.to_thread(self.submit, job_id, inputs, start, deadline, prompt_tokens, job_class)

    def close(self) -> None:
        """Let go of what the submitter holds open (by default nothing)."""
        return  # not abstract (mypy reads a body of a docstring alone as one): nothing to close


def job_canvas(
    job_id: str,
    inputs: Sequence[InputRecord],
    app: Celery,
    keyframes: int = 3,
    start: Start = "preprocess",
    deadline: float | None = None,
    prompt_tokens: int | None = None,
    job_class: JobClass = "interactive",
) -> Signature:
    """The Celery canvas for one job, from where it enters the pipeline.

    Stage messages expire at the job's deadline: a worker discards one still queued by then instead of running
    it for nobody. (The reaper has moved the job on by then; the inference consumer drops late jobs itself.) A
    batch line's messages carry the batch class's broker priority, every one of them (and what its tasks publish
    inherits it: `task_inherit_parent_priority`).
    """
    if start == "infer":
        return infer_signature(job_id, prompt_tokens, deadline, app, job_class)
    broker = app.conf.broker_url or ""
    # Explicit, so tokenize (and the inference message it sends) never inherits a large input's priority.
    tokenize = app.signature("stoker.tokenize", kwargs={"job_id": job_id}, priority=class_priority(broker, job_class))
    if start == "render":
        branches = render_branches(job_id, inputs, app, job_class)
    else:
        branches = preprocessing_branches(job_id, inputs if start == "preprocess" else [], app, keyframes, job_class)
    canvas: Signature
    if not branches:
        canvas = tokenize.clone(args=(None,), **UNWAITED)
    elif start == "render" and len(branches) == 1:
        canvas = branches[0].clone(**UNWAITED)
        canvas.link_error(app.signature("stoker.rescue", kwargs={"job_id": job_id}))
    else:
        # Stages catch their own errors; this errback covers what they cannot (a hard time limit, a killed child).
        tokenize.link_error(app.signature("stoker.rescue", kwargs={"job_id": job_id}))
        canvas = chord(group(branches), tokenize)
    options: dict[str, object] = {}
    if deadline is not None:
        options["expires"] = datetime.fromtimestamp(deadline, UTC)
    if options:
        _set_everywhere(canvas, options)
    return canvas


def _set_everywhere(canvas: Signature, options: dict[str, object]) -> None:
    """Set options (`expires`, `priority`) on every task of a canvas (chords, groups and chains are walked)."""
    if isinstance(canvas, chord):
        _set_everywhere(canvas.body, options)
        for task in canvas.tasks:
            _set_everywhere(task, options)
    elif isinstance(canvas, (group, _chain)):
        for task in canvas.tasks:
            _set_everywhere(task, options)
    else:
        canvas.set(**options)


def preprocessing_branches(
    job_id: str,
    inputs: Sequence[InputRecord],
    app: Celery,
    keyframes: int = 3,
    job_class: JobClass = "interactive",
) -> list[Signature]:
    """One chain of stage signatures per branch of every input (a video has a sound branch and one per keyframe),
    each message at its input's broker priority: a batch line's class, or an interactive input's size class."""
    broker = app.conf.broker_url or ""
    branches = []
    for record in inputs:
        priority = stage_priority(broker, job_class, record.size_class)
        for branch in _branches(app, job_id, record, keyframes):
            _set_everywhere(branch, {"priority": priority})
            branches.append(branch)
    return branches


def render_branches(
    job_id: str, inputs: Sequence[InputRecord], app: Celery, job_class: JobClass = "interactive"
) -> list[Signature]:
    """A render's pictures: one picture is one task that renders it and ends the job (`stoker.render`); several are
    rendered in parallel, one `stoker.decode` each (a render's decode renders), before tokenize ends the job. No OCR
    task follows: a render reads no text. A render of one picture is the tier's usual request, and its bookkeeping
    as a chord (a chain of two tasks, the chord's count, its body's message and result) cost the CPU worker about
    as much as the picture's decode."""
    broker = app.conf.broker_url or ""
    pictures = [record for record in inputs if record.kind == "image"]
    name = "stoker.render" if len(pictures) == 1 else "stoker.decode"
    return [
        app.signature(
            name,
            args=(job_id, input_ref(record.index)),
            immutable=True,
            priority=stage_priority(broker, job_class, record.size_class),
        )
        for record in pictures
    ]


def _branches(app: Celery, job_id: str, record: InputRecord, keyframes: int) -> list[Signature]:
    branches = _media_branches(app, job_id, record, keyframes)
    if record.url is None:
        return branches
    # Fetched once, before every branch that reads the bytes (a video's sound and keyframes alike).
    fetch = app.signature("stoker.fetch", args=(job_id, input_ref(record.index)), immutable=True)
    return [chain(fetch, branches[0] if len(branches) == 1 else group(branches))]


def _media_branches(app: Celery, job_id: str, record: InputRecord, keyframes: int) -> list[Signature]:
    ref = input_ref(record.index)
    if record.kind == "image":
        return [_image_branch(app, job_id, ref)]
    sound = chain(app.signature("stoker.probe", args=(job_id, ref), immutable=True), app.signature("stoker.transcribe"))
    if record.kind == "audio":
        return [sound]
    frames = [
        chain(
            app.signature("stoker.keyframe", args=(job_id, record.index, slot, keyframes), immutable=True),
            _image_branch(app, job_id, frame_ref(record.index, slot)),
        )
        for slot in range(keyframes)
    ]
    return [sound, *frames]


def _image_branch(app: Celery, job_id: str, ref: str) -> Signature:
    return chain(app.signature("stoker.decode", args=(job_id, ref), immutable=True), app.signature("stoker.ocr"))


def band_signatures(app: Celery, bands: Sequence[tuple[Any, ...]], deadline: float | None) -> list[Signature]:
    """The tasks that read a dense page's bands (`stoker.ocr_band`, one per band's arguments, as
    `stoker.runtime.stages.ocr.Spread` gives them), which join the job's chord and expire at its deadline."""
    signatures = [app.signature("stoker.ocr_band", args=args, immutable=True) for args in bands]
    if deadline is not None:
        for signature in signatures:
            signature.set(expires=datetime.fromtimestamp(deadline, UTC))
    return signatures


def infer_signature(
    job_id: str, prompt_tokens: int | None, deadline: float | None, app: Celery, job_class: JobClass = "interactive"
) -> Signature:
    """The inference message: the job, and what the batching policy needs without a store lookup. A batch line
    says so and goes to a queue of its own, which the inference consumer takes from only when no interactive
    request waits (`stoker.runtime.feeder`)."""
    kwargs: dict[str, object] = {"job_id": job_id, "prompt_tokens": prompt_tokens, "deadline": deadline}
    if job_class == "interactive":
        return app.signature("stoker.infer", kwargs=kwargs, **UNWAITED)
    kwargs["job_class"] = job_class
    priority = class_priority(app.conf.broker_url or "", job_class)
    return app.signature("stoker.infer", kwargs=kwargs, queue=INFER_BATCH_QUEUE, priority=priority, **UNWAITED)


def enqueue_inference(
    job_id: str, prompt_tokens: int | None, deadline: float | None, app: Celery, job_class: JobClass = "interactive"
) -> None:
    """Put a tokenized job on the inference queue."""
    infer_signature(job_id, prompt_tokens, deadline, app, job_class).apply_async()


class CeleryOutbox:
    """The runtime's `Outbox` over a Celery app: its messages by task name, queue depths over its broker pool."""

    def __init__(self, app: Celery, keyframes: int = 3) -> None:
        self.app = app
        self.keyframes = keyframes
        self._submitter = CelerySubmitter(app, keyframes)  # one for the process: it may hold a broker connection

    def enqueue_inference(
        self, job_id: str, prompt_tokens: int | None, deadline: float | None, job_class: JobClass = "interactive"
    ) -> None:
        """Put a tokenized job on the inference queue."""
        enqueue_inference(job_id, prompt_tokens, deadline, self.app, job_class)

    def send_callback(self, job_id: str) -> None:
        """Hand an ended job's completion callback to a CPU worker (`stoker.callback`)."""
        self.app.signature("stoker.callback", args=(job_id,), **UNWAITED).apply_async()

    def resubmit(self, job: Job, deadline: float | None) -> None:
        """The job's canvas from preprocessing (a render's from its rendering), again (its stages skip what a first
        run already did)."""
        start: Start = "render" if renders_pictures(job.chat, job.inputs) else "preprocess"
        self._submitter.submit(job.id, job.inputs, start, deadline=deadline, job_class=job.job_class)

    def queue_depths(self, queues: Iterable[str], timeout_s: float | None = None) -> dict[str, int]:
        """Each queue's depth; a connection that failed is closed, so the pool hands out a fresh one next time
        instead of the same dead one."""
        with self.app.pool.acquire(block=True, timeout=timeout_s) as connection:
            try:
                return queue_depths(connection, queues)
            except Exception:
                connection.close()
                raise

    def promote_aged(self, queues: Iterable[str], max_age_s: float) -> int:
        """Lift stage messages that waited `max_age_s` behind smaller inputs' to the front of their queues."""
        with self.app.pool.acquire(block=True) as connection:
            return promote_aged(connection, queues, max_age_s, time.time())


class CelerySubmitter(Submitter):
    """Submits jobs to the broker as Celery canvases.

    A job's chord publishes through two of the app's pooled producers at once: its header group takes one and
    hands it down, but Celery's chain drops it (`_chain.run` does not pass `producer` on), so each input's chain
    takes a second. With more threads publishing at once than half the pool (`broker_pool_limit`, 10), every
    producer was held by a thread waiting for its second: the API's publishes hung for good after a burst of
    eleven media jobs. At most half the pool's worth of canvases are published at once.

    A job that enters at inference is one plain message: on a Redis broker it goes out through a
    `DirectPublisher` (one `LPUSH`, none of the producer pool's machinery).
    """

    def __init__(self, app: Celery, keyframes: int = 3) -> None:
        self.app = app
        self.keyframes = keyframes
        limit = app.conf.broker_pool_limit
        self._publishing = threading.BoundedSemaphore(max(limit // 2, 1)) if limit else contextlib.nullcontext()
        self._direct = DirectPublisher(app) if DirectPublisher.serves(app) else None

    def submit(
        self,
        job_id: str,
        inputs: Sequence[InputRecord],
        start: Start = "preprocess",
        deadline: float | None = None,
        prompt_tokens: int | None = None,
        job_class: JobClass = "interactive",
    ) -> None:
        """Publish the job's canvas."""
        self._publish(job_canvas(job_id, inputs, self.app, self.keyframes, start, deadline, prompt_tokens, job_class))

    async def submit_on(
        self,
        client: aioredis.Redis[bytes] | None,
        job_id: str,
        inputs: Sequence[InputRecord],
        start: Start = "preprocess",
        deadline: float | None = None,
        prompt_tokens: int | None = None,
        job_class: JobClass = "interactive",
    ) -> None:
        """`submit`, from an asyncio loop: a plain message pushed over `client` (an asyncio client of the broker's
        Redis; None: there is none) on the loop, anything else published from a thread."""
        canvas = job_canvas(job_id, inputs, self.app, self.keyframes, start, deadline, prompt_tokens, job_class)
        if client is not None and self._direct is not None and DirectPublisher.plain(canvas):
            await self._direct.send_on(canvas, client)
        else:
            await asyncio.to_thread(self._publish, canvas)

    def _publish(self, canvas: Signature) -> None:
        if self._direct is not None and DirectPublisher.plain(canvas):
            self._direct.send(canvas)
            return
        with self._publishing:
            canvas.apply_async()

    def close(self) -> None:
        """Close the direct publisher's broker connection, if it opened one."""
        if self._direct is not None:
            self._direct.close()
