"""What every route of one API process works with, typed: built once by `create_app`, handed to routes by
FastAPI's dependency injection (`Context`), and passed on from there as plain parameters."""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import Annotated

from celery import Celery
from fastapi import Depends, FastAPI, Request
from prometheus_client import CollectorRegistry

from api.announcements import Announcements
from api.pressure import QueueMonitor
from api.prompts import PromptBuilder
from stoker.adapters.cache import StageCache
from stoker.adapters.files import DirectoryStorage, FileStorage
from stoker.adapters.metrics import BatchLines, JobCounts
from stoker.adapters.store import Store
from stoker.adapters.store.clients import async_request_client
from stoker.adapters.store.jobs import JobReads
from stoker.core.jobs import Job
from stoker.settings import ApiSettings
from tasks.app import make_app
from tasks.pipeline import CelerySubmitter, Submitter, SyncSubmitter


class LoopReads:
    """The job reads of requests, over an asyncio client of the serving loop's own (`JobReads`: a read from the
    thread pool costs the API about four times the CPU). An asyncio client belongs to the loop it first connects
    on, so each loop gets its own, made on first use there (one in a served process; a test client may run
    several loops); the app's shutdown closes its loop's."""

    def __init__(self, settings: ApiSettings) -> None:
        self.settings = settings
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, JobReads] = weakref.WeakKeyDictionary()

    @property
    def jobs(self) -> JobReads:
        """The running loop's reads (call it on the loop)."""
        loop = asyncio.get_running_loop()
        reads = self._per_loop.get(loop)
        if reads is None:
            reads = self._per_loop[loop] = JobReads(async_request_client(self.settings))
        return reads

    async def aclose(self) -> None:
        """Close the running loop's client, if it made one."""
        reads = self._per_loop.pop(asyncio.get_running_loop(), None)
        if reads is not None:
            await reads.aclose()


@dataclass(frozen=True)
class ApiContext:
    """The API process's settings and the clients and helpers its routes share."""

    settings: ApiSettings
    store: Store
    cache: StageCache
    #: The Celery producer, from these settings and nothing else.
    producer: Celery
    #: The seam to the queue: what publishes a job's first message.
    submitter: Submitter
    #: Queue depths and store memory, sampled in the background, for admission control.
    monitor: QueueMonitor
    #: Tokenizes a prompt here when a job may skip straight to inference.
    prompts: PromptBuilder
    #: Wakes the requests that wait on a job (long-polls, chats, idempotent retries).
    announcements: Announcements
    #: The deployment's job counts, served on `/metrics` beside this process's own metrics.
    metrics: CollectorRegistry
    #: Where the bytes of files (`/v1/files`, batches' output) live.
    files: FileStorage
    #: The job reads a request makes, on the serving loop.
    reads: LoopReads

    @classmethod
    def build(cls, settings: ApiSettings, submitter: Submitter | None = None) -> ApiContext:
        """The context for these settings; `submitter` replaces the one the settings would choose."""
        store = Store.connect(settings)
        producer = make_app(settings)
        metrics = CollectorRegistry()
        metrics.register(JobCounts(store.stats.job_counts))
        metrics.register(BatchLines(store.batches.line_stats))
        return cls(
            settings=settings,
            store=store,
            cache=StageCache.connect(settings),
            producer=producer,
            submitter=submitter or default_submitter(settings, producer),
            monitor=QueueMonitor(settings, store),
            prompts=PromptBuilder(settings),
            announcements=Announcements(settings.stop_grace_s),
            metrics=metrics,
            files=DirectoryStorage(settings.files_dir),
            reads=LoopReads(settings),
        )


def close_clients(context: ApiContext) -> None:
    """Close what the context holds open: the queue monitor's, the submitter's (its direct publisher's) and the
    store's connections, and the tokenizing threads."""
    context.monitor.close()
    context.prompts.close()
    if isinstance(context.submitter, CelerySubmitter):
        context.submitter.close()
    context.store.close()


async def reread(context: ApiContext, job_id: str) -> Job | None:
    """The job again, for a waiter that woke: as the announcement of its end carried it (no read), or from the
    store (woken by something else, or by its poll)."""
    ended = context.announcements.ended(job_id)
    if ended is not None:
        return ended
    return await context.reads.jobs.load_job(job_id)


def default_submitter(settings: ApiSettings, producer: Celery) -> Submitter:
    """Celery canvases per stage, or, for the synchronous baseline, one message per whole job."""
    if settings.pipeline_mode == "sync":
        return SyncSubmitter(producer)
    return CelerySubmitter(producer, keyframes=settings.video_keyframes)


def context_of(app: FastAPI) -> ApiContext:
    """The context `create_app` gave this app."""
    context = app.state.context
    assert isinstance(context, ApiContext), context
    return context


async def api_context(request: Request) -> ApiContext:
    """The context of the app serving this request: a FastAPI dependency (async: FastAPI runs a plain `def`
    dependency in its thread pool, a hop per request for one attribute read)."""
    return context_of(request.app)


#: A route parameter that receives the API's context.
Context = Annotated[ApiContext, Depends(api_context)]
