"""Redis repositories, one concern each, over one key layout (`keys`) and one client factory (`clients`)."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from stoker.adapters.store.answers import AnswerStreams
from stoker.adapters.store.blobs import BlobRepository
from stoker.adapters.store.callbacks import CallbackRepository
from stoker.adapters.store.clients import store_client
from stoker.adapters.store.consumers import ConsumerRegistry
from stoker.adapters.store.coordination import DeliveryCounter, HandoffHold, Leases
from stoker.adapters.store.idempotency import IdempotencyKeys
from stoker.adapters.store.jobs import JobRepository
from stoker.adapters.store.openai_batches import OPENAI_BATCH_TTL_S, FileRepository, OpenAIBatchRepository
from stoker.adapters.store.stats import StatsRepository
from stoker.adapters.store.tenants import TenantRepository
from stoker.adapters.store.watch import Watchlist
from stoker.core.jobs import MAX_RECORD_BYTES
from stoker.settings import CommonSettings


@dataclass(frozen=True)
class Store:
    """The job store's repositories over one connection pool: what a process opens once and passes around."""

    client: redis.Redis[bytes]
    jobs: JobRepository
    blobs: BlobRepository
    tenants: TenantRepository
    stats: StatsRepository
    watch: Watchlist
    deliveries: DeliveryCounter
    leases: Leases
    handoff_hold: HandoffHold
    consumers: ConsumerRegistry
    answers: AnswerStreams
    idempotency: IdempotencyKeys
    callbacks: CallbackRepository
    files: FileRepository
    openai_batches: OpenAIBatchRepository

    @classmethod
    def over(
        cls,
        client: redis.Redis[bytes],
        *,
        blob_ttl_s: int,
        job_ttl_s: int,
        max_record_bytes: int = MAX_RECORD_BYTES,
        max_result_bytes: int = MAX_RECORD_BYTES,
        batch_ttl_s: int = OPENAI_BATCH_TTL_S,
    ) -> Store:
        """Every repository over one client."""
        jobs = JobRepository(
            client, ttl_s=job_ttl_s, max_record_bytes=max_record_bytes, max_result_bytes=max_result_bytes
        )
        return cls(
            client=client,
            jobs=jobs,
            blobs=BlobRepository(client, ttl_s=blob_ttl_s),
            tenants=TenantRepository(client),
            stats=StatsRepository(client),
            watch=Watchlist(client),
            deliveries=DeliveryCounter(client, ttl_s=job_ttl_s),
            leases=Leases(client),
            handoff_hold=HandoffHold(client),
            consumers=ConsumerRegistry(client),
            answers=AnswerStreams(client, ttl_s=blob_ttl_s),
            idempotency=IdempotencyKeys(client),
            callbacks=CallbackRepository(client),
            files=FileRepository(client),
            openai_batches=OpenAIBatchRepository(client, ended_ttl_s=batch_ttl_s),
        )

    @classmethod
    def connect(cls, settings: CommonSettings, *, retries: int = 1) -> Store:
        """The store at `settings.result_url` (connected lazily); see `clients.store_client` for `retries`."""
        return cls.over(
            store_client(settings, retries=retries),
            blob_ttl_s=settings.blob_ttl_s,
            job_ttl_s=settings.job_ttl_s,
            max_record_bytes=settings.max_record_bytes,
            max_result_bytes=settings.max_result_bytes,
            batch_ttl_s=settings.batch_ttl_s,
        )

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()
