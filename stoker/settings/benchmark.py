"""Knobs that exist for the benchmarks, apart from production's: the simulated device (the `sim` backend), the
synchronous baseline stoker is measured against, and the Redis the benchmarks' stacks use."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from stoker.settings.base import SettingsPart


class SimulatedDeviceSettings(SettingsPart):
    """The `sim` backend: a simulated accelerator, a batch takes base + per item (ms), asleep."""

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


class SyncBaselineApiSettings(SettingsPart):
    """Whether the API sends jobs down the pipeline or to the synchronous baseline."""

    pipeline_mode: Literal["pipeline", "sync"] = Field(
        "pipeline",
        description='"pipeline": stoker as designed. "sync": every job goes whole to the `sync` queue, where one '
        "worker (`stoker worker sync`) decodes, reads, tokenizes and infers it in one thread: the design stoker "
        "replaces, kept as the benchmark's baseline (`stoker bench`).",
    )


class SyncBaselineWorkerSettings(SettingsPart):
    """How the synchronous baseline's worker fills a batch."""

    sync_backlog_fill_ms: int = Field(
        50,
        ge=0,
        description="The synchronous baseline (`STOKER_PIPELINE_MODE=sync`) only: how long, after its last batch "
        "returned, a worker whose queue still holds messages waits for them before running a batch that is not "
        "full (its one thread ran the batch, so what queued meanwhile reaches it a few messages at a time); 0: "
        "it takes what it has.",
    )


class BenchSettings(BaseSettings):
    """The benchmarks: which Redis their stacks use (databases 5-7 of it, flushed per run)."""

    model_config = SettingsConfigDict(env_prefix="STOKER_", extra="ignore")

    bench_redis: str = Field(
        "redis://127.0.0.1:6379", description="The Redis the benchmarks' stacks use (databases 5-7, flushed per run)."
    )
