"""A stoker stack for one benchmark run: fresh Redis databases, the processes of one mode, stopped together.

pipeline:  API, CPU worker (2 children), ASR worker (1), inference worker, reaper and batch feeder (stoker as
           designed, as `stoker up` runs it).
sync:      API (`STOKER_PIPELINE_MODE=sync`) and one `stoker worker sync`: every stage and the model in one thread.
sync-pool: the same with as many sync workers as the pipeline has CPU processes (3), sharing one device.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import redis

from stoker.adapters.store.clients import redis_answers
from stoker.settings import BenchSettings
from workers.broker import free_port, start_embedded
from workers.procs import spawn, terminate

Mode = Literal["pipeline", "sync", "sync-pool"]
#: The pipeline's CPU processes: the CPU worker's pool children, every CPU stage on each (as `stoker up` runs it:
#: the CPU pool's 2 and the 1 an ASR worker would have). The sync-pool baseline gets as many synchronous workers,
#: so both designs have the same CPUs at their disposal.
CPU_PROCESSES = 2 + 1
PROCESSES: dict[str, tuple[tuple[str, ...], ...]] = {
    "pipeline": (("worker", "cpu", "--concurrency", str(CPU_PROCESSES)), ("worker", "infer"), ("reaper",)),
    "sync": (("worker", "sync"),),
    "sync-pool": tuple(("worker", "sync", "--hostname", f"sync{n}@%h") for n in range(CPU_PROCESSES)),
}
#: Databases the benchmarks flush and use on the benchmark Redis: broker, job store, cache.
DBS = (5, 6, 7)


@dataclass(frozen=True)
class Device:
    """The accelerator: `sim` sleeps base + per-item ms per batch (the CPU stays free, as with a GPU);
    `transformers` runs the real model."""

    backend: Literal["sim", "transformers"] = "sim"
    base_ms: float = 300.0
    per_item_ms: float = 40.0
    batch: int = 8
    #: A simulated call's decoding steps (0: it runs whole): a consumer that yields between steps lets a waiting
    #: request join the answers under way at the next one, as a server that schedules every step does.
    steps: int = 0

    def env(self) -> dict[str, str]:
        """The settings that make this device."""
        env = {"STOKER_BACKEND": self.backend, "STOKER_MAX_BATCH_SIZE": str(self.batch)}
        if self.backend == "sim":
            env |= {"STOKER_SIM_BASE_MS": str(self.base_ms), "STOKER_SIM_PER_ITEM_MS": str(self.per_item_ms)}
            env |= {"STOKER_SIM_STEPS": str(self.steps), "STOKER_YIELD_TOKENS": "1"}
        else:  # on a CPU the model shares the cores with preprocessing: a batch may take minutes, not a wedge
            env |= {"STOKER_INFER_BATCH_TIMEOUT_S": "600", "STOKER_VISIBILITY_TIMEOUT_S": "1200"}
        return env

    @property
    def capacity_per_s(self) -> float:
        """The most a simulated device serves: full batches back to back, jobs a second. No design serves more,
        which bounds any ratio of two designs' throughput on it."""
        return self.batch / ((self.base_ms + self.per_item_ms * self.batch) / 1000)

    def describe(self) -> str:
        """One line for the report."""
        if self.backend == "sim":
            return (
                f"simulated device: {self.base_ms:.0f} ms + {self.per_item_ms:.0f} ms per item, batch ≤ {self.batch} "
                f"(at most {self.capacity_per_s:.1f} jobs/s, in full batches)"
                + (f", in {self.steps} steps a request can join between" if self.steps else "")
            )
        return f"real model (transformers) on the CPU, batch ≤ {self.batch}"


@dataclass
class BenchStack:
    """The processes of one run and where their logs go."""

    mode: Mode
    base: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


@contextmanager
def bench_redis() -> Iterator[str]:
    """The benchmark's Redis: STOKER_BENCH_REDIS, else 127.0.0.1:6379, else an embedded Valkey for the duration."""
    base = BenchSettings().bench_redis
    if redis_answers(f"{base}/0"):
        yield base
        return
    proc, port = start_embedded()
    try:
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def bench_stack(
    mode: Mode,
    device: Device,
    base_url: str,
    logs: Path,
    on_flushed: Callable[[str], None] | None = None,
    api_key: str | None = None,
    /,
    **settings: str,
) -> Iterator[BenchStack]:
    """Flush the benchmark databases, start the mode's processes, wait until a job goes through; stop them after.
    `on_flushed` gets the job store's URL once it is flushed (to write API keys there for a stack with
    `STOKER_AUTH=on`); the warm-up job is sent with `api_key`."""
    urls = dict(zip(("STOKER_BROKER_URL", "STOKER_RESULT_URL", "STOKER_CACHE_URL"), _db_urls(base_url), strict=True))
    for url in urls.values():
        with redis.Redis.from_url(url) as client:
            client.flushdb()
    if on_flushed is not None:
        on_flushed(urls["STOKER_RESULT_URL"])
    env = {
        **os.environ,
        **urls,
        **device.env(),
        "STOKER_PIPELINE_MODE": "pipeline" if mode == "pipeline" else "sync",
        # One device for every mode: sync-pool's processes take turns on it (a lock in Redis), never one each.
        "STOKER_SIM_SHARED": "true",
        "STOKER_CPU_POOL": "2",
        "STOKER_ASR_CONCURRENCY": "1",
        # A fresh stack per run: its speech model is loaded as each process starts, not by the run's first
        # recordings (every mode alike: the baselines' worker loads it at setup).
        "STOKER_ASR_PRELOAD": "true",
        "STOKER_AUTH": "off",
        "STOKER_METRICS_PORT": "0",
        "STOKER_TRACE_EXPORTER": "none",
        "STOKER_BATCH_FEEDER": "false",  # the batch feeder runs as a process of its own, as `stoker up` runs it
        **settings,
    }
    port = free_port()
    stack = BenchStack(mode, f"http://127.0.0.1:{port}")
    logs.mkdir(parents=True, exist_ok=True)
    try:
        stack.procs.append(spawn(("api", "--port", str(port)), env, logs / "api.log"))
        feeder = (("batch-feeder",),) if mode == "pipeline" and env["STOKER_BATCH_FEEDER"] == "false" else ()
        for args in (*PROCESSES[mode], *feeder):  # the batch feeder where the API does not feed
            stack.procs.append(spawn(args, env, logs / f"{'-'.join(args)}.log"))
        _warm_up(stack, api_key)
        yield stack
    finally:
        terminate(stack.procs, grace_s=20.0)


def _db_urls(base: str) -> list[str]:
    return [f"{base}/{db}" for db in DBS]


def wait_ready(base: str, procs: list[subprocess.Popen[bytes]] | None = None, timeout_s: float = 90.0) -> None:
    """Until the API at base answers /readyz."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if procs and (dead := [p.args for p in procs if p.poll() is not None]):
            raise SystemExit(f"benchmark stack process exited: {dead}")
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("API did not become ready")


def _warm_up(stack: BenchStack, api_key: str | None, timeout_s: float = 120.0) -> None:
    """The API answers and one text job goes all the way through: every worker is up and has its models."""
    wait_ready(stack.base, stack.procs)
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=stack.base, timeout=40, headers=headers) as http:
        job = http.post("/v1/jobs", data={"prompt": "warm up"}).json()
        deadline = time.monotonic() + timeout_s
        while job.get("status") not in ("succeeded", "degraded", "failed"):
            if time.monotonic() > deadline or any(p.poll() is not None for p in stack.procs):
                raise SystemExit(f"the {stack.mode} stack did not serve its warm-up job: {job}")
            job = http.get(f"/v1/jobs/{job['id']}", params={"wait": 5}).json()
