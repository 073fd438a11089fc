"""OpenAI's Files and Batch APIs (`/v1/files`, `/v1/batches`): the limits are OpenAI's own by default."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from stoker.settings.base import SettingsPart


class BatchApiSettings(SettingsPart):
    """Files and batches: where files are kept, how many and how large, and how the batch feeder runs."""

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
