"""The Celery workers: `WorkerSettings`, composed of the common settings, the stages', inference's and the worker
processes' own."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from stoker.settings.base import SettingsPart
from stoker.settings.benchmark import SimulatedDeviceSettings, SyncBaselineWorkerSettings
from stoker.settings.common import CommonSettings
from stoker.settings.inference import (
    DeviceBatchSettings,
    InferenceConsumerSettings,
    OpenAIBackendSettings,
    VisionEmbeddingSettings,
    WatchdogSettings,
)
from stoker.settings.stages import (
    CallbackSettings,
    DecodeSettings,
    FetchSettings,
    HandoffSettings,
    MediaSettings,
    OcrSettings,
    StageTimeLimitSettings,
)


class DeliverySettings(SettingsPart):
    """How often a stage message is delivered, and how a worker rides out a lost Redis."""

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


class ReaperSettings(SettingsPart):
    """The reaper: finds jobs that stopped making progress and moves them on."""

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


class WorkerProcessSettings(SettingsPart):
    """Worker processes: pools, their children's limits, metrics."""

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


# Its parts, in the order docs/configuration.md lists their settings (after the class's own).
class WorkerSettings(
    CommonSettings,
    StageTimeLimitSettings,
    DecodeSettings,
    OcrSettings,
    MediaSettings,
    FetchSettings,
    CallbackSettings,
    DeviceBatchSettings,
    SyncBaselineWorkerSettings,
    InferenceConsumerSettings,
    HandoffSettings,
    VisionEmbeddingSettings,
    SimulatedDeviceSettings,
    OpenAIBackendSettings,
    DeliverySettings,
    ReaperSettings,
    WatchdogSettings,
    WorkerProcessSettings,
):
    """Celery workers: CPU preprocessing and the inference consumer."""

    worker_kind: str = Field(
        "worker", description="Which queue group this worker serves (`stoker worker KIND` sets it for its process)."
    )

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
