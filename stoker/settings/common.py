"""What every stoker process reads, composed in `CommonSettings` from the store's parts and the ones here."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from stoker.settings.base import SettingsPart
from stoker.settings.stages import VideoKeyframeSettings
from stoker.settings.store import CacheSettings, IdleSettings, RecordSettings, RedisTlsSettings, StoreSettings

#: The model shipped with stoker: SmolLM2-135M-Instruct, fetched from PyPI and cached as safetensors.
BUILTIN_MODEL = "smollm2-135m-instruct"


class ModelSettings(SettingsPart):
    """Which model serves, and where the built-in one is kept."""

    model: str = Field(BUILTIN_MODEL, description="Built-in model name, a local HF directory or a hub id.")
    model_cache: Path = Field(
        Path("~/.cache/stoker").expanduser(), description="Where the built-in model is converted and kept."
    )


class CallbackSecretSettings(SettingsPart):
    """The deprecated shared callback secret."""

    callback_secret: str | None = Field(
        None,
        description="Deprecated. Each tenant's callbacks are signed with a secret of its own (made on first use, "
        "shown by `stoker keys create`, replaced by `stoker keys rotate-callback-secret`); this one only stands in "
        "for the default tenant's (`local`, auth off), until that tenant's secret is rotated (`stoker keys "
        "rotate-callback-secret --tenant local`, signing with both for the grace), and never signs another "
        "tenant's callbacks.",
    )


class AnswerSettings(SettingsPart):
    """How long an answer may be, and the model's name to clients."""

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


class QueueLimitSettings(SettingsPart):
    """Queue limits, shared by the API (admission) and the tokenize stage (watermarks)."""

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


class HeapSettings(SettingsPart):
    """How much freed memory a process keeps for reuse."""

    heap_keep_mb: int = Field(
        512,
        ge=0,
        le=2047,
        description="Freed heap memory (MB) a process keeps for its next buffers instead of handing it back to the "
        "system at once, with buffers up to 32 MB served from the heap (glibc only). A picture's render moves tens of "
        "megabytes, and memory handed back faults on every page when touched again: most of the API's CPU per picture "
        "on a small VM. The embedded cache Valkey `stoker up` starts keeps as much (through glibc's environment). 0 "
        "leaves the C library's defaults.",
    )
    heap_arenas: int = Field(
        2,
        ge=0,
        le=1024,
        description="The most heaps (glibc's arenas) a process's threads share; the memory one keeps is kept for the "
        "threads of that heap only. glibc's default, eight a core, gives each thread of the API's pool a heap of its "
        "own, so a render's buffers, freed on one thread, are fresh memory again on the next (a fault every 4 KiB "
        "page). 0 leaves glibc's default; only with `heap_keep_mb` above 0.",
    )


class LoggingSettings(SettingsPart):
    """The processes' logs."""

    log_level: str = Field("INFO", description="The processes' log level.")


class BrokerTransportSettings(SettingsPart):
    """The broker transport options every process's Celery app is built with."""

    visibility_timeout_s: int = Field(
        300,
        ge=5,
        description="Unacknowledged messages of a worker that vanished come back after this long (workers check it "
        "outlasts every hard limit and the inference watchdog); part of the broker transport options every "
        "process's Celery app is built with.",
    )


class TelemetrySettings(SettingsPart):
    """Traces and metrics: where they go."""

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


class RedriveSettings(SettingsPart):
    """The reaper's patience (the API plans its first look at each job from it)."""

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


# Its parts, in the order docs/configuration.md lists their settings (after the class's own).
class CommonSettings(
    StoreSettings,
    IdleSettings,
    CacheSettings,
    RedisTlsSettings,
    RecordSettings,
    ModelSettings,
    CallbackSecretSettings,
    AnswerSettings,
    QueueLimitSettings,
    VideoKeyframeSettings,
    HeapSettings,
    LoggingSettings,
    BrokerTransportSettings,
    TelemetrySettings,
    RedriveSettings,
):
    """What every stoker process needs: where the broker and the job store are, and which model serves."""

    @property
    def public_model_name(self) -> str:
        """The model's name to clients (`served_model_name`, or the model setting's last path part)."""
        return self.served_model_name or Path(self.model).name
