"""Where the broker, the job store and the stage cache are, how a process reaches them, and what the store keeps."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from pydantic import Field

from stoker.core.jobs import MAX_RECORD_BYTES
from stoker.settings.base import MiB, SettingsPart


class StoreSettings(SettingsPart):
    """Where the broker and the job store are, and how long input bytes live in the store."""

    broker_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="The Celery broker (`redis://`, `rediss://` for TLS, or `amqp://` for RabbitMQ).",
    )
    result_url: str = Field(
        "redis://127.0.0.1:6379/1",
        description="Job records, input bytes, stage artefacts and Celery results (must not evict: `noeviction`).",
    )
    blob_ttl_s: int = Field(
        3600,
        ge=60,
        description="How long input bytes and artefacts live in the store, at the longest (they are deleted when "
        "the last job that uses them ends).",
    )


class IdleSettings(SettingsPart):
    """How far background loops slow down while nothing happens."""

    idle_max_wait_s: float = Field(
        2.0,
        gt=0,
        le=4.0,
        description="While nothing happens, background loops (the API's queue monitor, the reaper, the inference "
        "consumer's heartbeat and the device monitor) slow down, each up to this many seconds between rounds; the "
        "first sign of work puts them back to their own pace. At most 4 s: the API acts on queue depths at most 5 s "
        "old.",
    )


class CacheSettings(SettingsPart):
    """The stage-result cache: where it is, what it keeps, for how long, and for whom."""

    cache_url: str = Field(
        "redis://127.0.0.1:6379/2",
        description="Stage-result cache; give it its own Redis with allkeys-lru (the broker and result store keep "
        "noeviction).",
    )
    cache_ttl_s: int = Field(3600, ge=1, description="How long a stage-cache entry lives, at the longest.")
    cache_max_value_bytes: int = Field(
        8 * MiB, ge=1024, description="A stage result bigger than this is not cached (and counted as oversize)."
    )
    cache_max_tensor_bytes: int = Field(
        64 * MiB,
        ge=1024,
        description="The same for a picture's model-ready tensors (a model that sees): float16 tiles are large "
        "(SmolVLM's 17 crops of 512×512 are 27 MB). Tensors over it are prepared again from the upload when needed.",
    )
    cache_enabled: bool = Field(True, description="The stage-result cache; `false` turns it off.")
    cache_shared: bool = Field(
        False,
        description="Off: each tenant's stage results are cached apart from everyone else's. On: a result computed "
        "for one tenant answers another's identical input, which saves work but lets a tenant learn, from how fast "
        "its job runs, that someone already sent the same content (a timing side channel; see the stage cache in "
        "docs/architecture.md). The API and the workers must agree.",
    )


class RedisTlsSettings(SettingsPart):
    """TLS for `rediss://` URLs: the broker's, the store's and the cache's."""

    redis_ca_file: Path | None = Field(
        None,
        description="For `rediss://` URLs (broker, store, cache): the CA bundle that signed the servers' "
        "certificates (unset: the system's). Certificates are always verified.",
    )
    redis_cert_file: Path | None = Field(
        None, description="For `rediss://` URLs: a client certificate, where the servers require one."
    )
    redis_key_file: Path | None = Field(None, description="For `rediss://` URLs: the client certificate's key.")

    def redis_tls(self, url: str) -> dict[str, Any]:
        """TLS options for a client of url: certificate verification against redis_ca_file for `rediss://`, nothing
        for any other scheme. Every Redis client takes them (redis-py keyword arguments, kombu's and Celery's ssl
        dicts), so no connection falls back to kombu's default for a bare `rediss://`: no verification at all."""
        if not url.startswith("rediss://"):
            return {}
        files = {
            "ssl_ca_certs": self.redis_ca_file,
            "ssl_certfile": self.redis_cert_file,
            "ssl_keyfile": self.redis_key_file,
        }
        return {"ssl_cert_reqs": ssl.CERT_REQUIRED, **{k: str(v) for k, v in files.items() if v is not None}}


class RecordSettings(SettingsPart):
    """What the job store keeps of a job and of a batch, for how long, and how long a process waits on it."""

    job_ttl_s: int = Field(86400, ge=60, description="How long a job record lives after it was accepted.")
    batch_ttl_s: int = Field(
        30 * 24 * 3600,
        ge=60,
        description="How long a batch's record is kept once the batch ended (as its output and error files are, "
        "`files_ttl_s`): then it is gone from `GET /v1/batches` and its id is 404.",
    )
    max_record_bytes: int = Field(
        MAX_RECORD_BYTES,
        ge=64 * 1024,
        description="The most a job's record may hold when it is created (prompt, chat, parameters, inputs' "
        "records): every field a client sends is stored with its job for `job_ttl_s`, so none may make the record "
        "big (413 `record_too_large` above it). Stop sequences are at most 4 of 256 characters.",
    )
    max_result_bytes: int = Field(
        MAX_RECORD_BYTES,
        ge=64 * 1024,
        description="The most a job's stored result may hold (its answers, their logprobs and tool calls), checked "
        "when it is written: a result over it is not stored and its job fails `result_too_large` (what a job may "
        "ask for is bounded at intake, `max_answer_entries`, so only an answer of unusually long tokens meets it).",
    )
    store_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds to wait for the job store to connect or to answer one command before giving up on it "
        "(a stopped or partitioned Redis). Workers (10 s) ride such an outage out with retries; the API (3 s, "
        "`ApiSettings`) answers 503 `broker_unavailable` instead.",
    )
