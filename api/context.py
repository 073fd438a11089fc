"""What every route of one API process works with, typed: built once by `create_app`, handed to routes by
FastAPI's dependency injection (`Context`), and passed on from there as plain parameters."""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import Annotated

import redis.asyncio as aioredis
from celery import Celery
from fastapi import Depends, FastAPI, Request
from prometheus_client import CollectorRegistry

from api.announcements import Announcements
from api.pressure import QueueMonitor
from api.prompts import PromptBuilder
from stoker.adapters.cache import LoopCache, StageCache
from stoker.adapters.files import DirectoryStorage, FileStorage
from stoker.adapters.metrics import JobCounts, OpenAIBatchLines
from stoker.adapters.store import Store
from stoker.adapters.store.clients import async_broker_client, async_cache_client, async_request_client
from stoker.adapters.store.jobs import LoopJobs
from stoker.adapters.store.tenants import LoopTenants
from stoker.core.jobs import Job
from stoker.settings import ApiSettings
from tasks.app import make_app
from tasks.baseline_submitter import SyncSubmitter
from tasks.pipeline import CelerySubmitter, Submitter


@dataclass(frozen=True)
class _OnLoop:
    jobs: LoopJobs
    tenants: LoopTenants
    cache: LoopCache
    broker: aioredis.Redis[bytes] | None


class LoopClients:
    """The job store's, the stage cache's and the broker's calls of requests, over asyncio clients of the serving
    loop's own (`LoopJobs`, `LoopTenants`, `LoopCache`, `DirectPublisher.send_on`: a call from the thread pool
    costs the API about four times the CPU). An asyncio client belongs to the loop it first connects on, so each
    loop gets its own, made on first use there (one in a served process; a test client may run several loops); the
    app's shutdown closes its loop's."""

    def __init__(self, settings: ApiSettings) -> None:
        self.settings = settings
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _OnLoop] = weakref.WeakKeyDictionary()

    @property
    def jobs(self) -> LoopJobs:
        """The running loop's job store calls (use it on the loop)."""
        return self._on_loop().jobs

    @property
    def tenants(self) -> LoopTenants:
        """The running loop's tenant calls (API keys on)."""
        return self._on_loop().tenants

    @property
    def cache(self) -> LoopCache:
        """The running loop's stage cache lookups."""
        return self._on_loop().cache

    @property
    def broker(self) -> aioredis.Redis[bytes] | None:
        """The running loop's client of the broker's Redis; None on a broker it cannot reach (RabbitMQ...)."""
        return self._on_loop().broker

    def _on_loop(self) -> _OnLoop:
        loop = asyncio.get_running_loop()
        clients = self._per_loop.get(loop)
        if clients is None:
            settings = self.settings
            store = async_request_client(settings)
            jobs = LoopJobs(store, ttl_s=settings.job_ttl_s, max_record_bytes=settings.max_record_bytes)
            cache = LoopCache(
                async_cache_client(settings), ttl_s=settings.cache_ttl_s, max_value_bytes=settings.cache_max_value_bytes
            )
            clients = _OnLoop(jobs, LoopTenants(store), cache, async_broker_client(settings))
            self._per_loop[loop] = clients
        return clients

    async def aclose(self) -> None:
        """Close the running loop's clients, if it made them."""
        clients = self._per_loop.pop(asyncio.get_running_loop(), None)
        if clients is not None:
            await clients.jobs.aclose()
            await clients.cache.aclose()
            if clients.broker is not None:
                await clients.broker.aclose(close_connection_pool=True)  # type: ignore[attr-defined]  # stubs lag


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
    #: The job store, stage cache and broker calls a request makes, on the serving loop.
    loop: LoopClients

    @classmethod
    def build(cls, settings: ApiSettings, submitter: Submitter | None = None) -> ApiContext:
        """The context for these settings; `submitter` replaces the one the settings would choose."""
        store = Store.connect(settings)
        producer = make_app(settings)
        metrics = CollectorRegistry()
        metrics.register(JobCounts(store.stats.job_counts))
        metrics.register(OpenAIBatchLines(store.openai_batches.line_stats))
        submitter = submitter or default_submitter(settings, producer)
        return cls(
            settings=settings,
            store=store,
            cache=StageCache.connect(settings),
            producer=producer,
            submitter=submitter,
            monitor=QueueMonitor(settings, store, queues=submitter.queues),
            prompts=PromptBuilder(settings),
            announcements=Announcements(settings.stop_grace_s),
            metrics=metrics,
            files=DirectoryStorage(settings.files_dir),
            loop=LoopClients(settings),
        )


def close_clients(context: ApiContext) -> None:
    """Close what the context holds open: the queue monitor's, the submitter's (its direct publisher's) and the
    store's connections, and the tokenizing threads."""
    context.monitor.close()
    context.prompts.close()
    context.submitter.close()
    context.store.close()


async def reread(context: ApiContext, job_id: str) -> Job | None:
    """The job again, for a waiter that woke: as the announcement of its end carried it (no read), or from the
    store (woken by something else, or by its poll)."""
    ended = context.announcements.ended(job_id)
    if ended is not None:
        return ended
    return await context.loop.jobs.load_job(job_id)


def default_submitter(settings: ApiSettings, producer: Celery) -> Submitter:
    """Celery canvases per stage, or, for the synchronous baseline, one message per whole job: the one place the
    baseline is chosen (its queue comes with its submitter)."""
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
