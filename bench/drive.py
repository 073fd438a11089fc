"""The load generator: open loop (each request at its arrival time, whatever the stack is doing), clients that
come back after Retry-After when refused, long-polling for the answer; and a sampler of /v1/stats."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.workload import Request

TERMINAL = ("succeeded", "degraded", "failed")


@dataclass
class Outcome:
    """What one client saw: when it first tried, how often it was refused, the job as it ended."""

    request: Request
    first_try: float
    refusals: int = 0
    job: dict[str, Any] | None = None
    done_at: float | None = None
    error: str | None = None

    @property
    def latency_s(self) -> float | None:
        """From the client's first try to the answer in its hands (refusals and waits included)."""
        return self.done_at - self.first_try if self.done_at is not None else None


@dataclass
class Sample:
    """/v1/stats at one moment: device busy seconds so far and the depth of every queue."""

    at: float
    busy_s: float
    depths: dict[str, int]
    #: CPU seconds every worker process counted so far (all kinds together).
    cpu_s: float = 0.0


@dataclass
class Run:
    """Everything one run of the load collected."""

    started: float
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    ended: float = 0.0
    #: The workers' CPU count when the load began: what starting them cost (models and processors loaded, one
    #: process or three) is not a cost of the run's jobs.
    cpu_before_s: float = 0.0

    def cpu_s(self) -> float:
        """CPU seconds the workers spent during the run (from the last sample, taken after it settled)."""
        return self.samples[-1].cpu_s - self.cpu_before_s if self.samples else 0.0


#: Workers add their CPU time to the count every second: wait this long after the last answer before reading it.
CPU_SETTLE_S = 2.5


def drive(base: str, requests: list[Request], give_up_s: float, max_refusals: int = 20) -> Run:
    """Send every request at its time; wait for every answer, or until give_up_s after the last arrival."""
    time.sleep(CPU_SETTLE_S)  # every worker has counted what starting it cost
    with httpx.Client(base_url=base, timeout=5) as http:
        before = sample(http).cpu_s
    run = Run(started=time.monotonic(), cpu_before_s=before)
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(base, run, stop), daemon=True)
    sampler.start()
    until = run.started + (requests[-1].at if requests else 0.0) + give_up_s
    # Every connection the pool opens may be kept alive: httpcore closes a surplus kept-alive connection it has
    # already handed to another thread's request (encode/httpcore#1110), a client-side ReadError.
    connections = len(requests) + 8
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    with (
        httpx.Client(base_url=base, timeout=60, limits=limits) as http,
        ThreadPoolExecutor(max_workers=max(len(requests), 1)) as pool,
    ):
        for request in requests:
            time.sleep(max(run.started + request.at - time.monotonic(), 0.0))
            outcome = Outcome(request, time.monotonic())
            run.outcomes.append(outcome)
            pool.submit(_client, http, outcome, until, max_refusals)
    run.ended = time.monotonic()
    stop.set()
    sampler.join(5)
    time.sleep(CPU_SETTLE_S)  # every worker has counted its CPU up to the last answer
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError), httpx.Client(base_url=base, timeout=5) as http:
        run.samples.append(sample(http))
    return run


def _client(http: httpx.Client, outcome: Outcome, until: float, max_refusals: int) -> None:
    try:
        job_id = _submit(http, outcome, until, max_refusals)
        if job_id is not None:
            _await(http, outcome, job_id, until)
    except httpx.HTTPError as exc:
        outcome.error = type(exc).__name__


def _submit(http: httpx.Client, outcome: Outcome, until: float, max_refusals: int) -> str | None:
    """POST until accepted, sleeping Retry-After after each 429; None if refused for good or out of time."""
    request = outcome.request
    files = [(request.media.kind, ("input", request.media.data))] if request.media else None
    while True:
        response = http.post("/v1/jobs", data={"prompt": request.prompt}, files=files)
        if response.status_code == 202:
            return str(response.json()["id"])
        if response.status_code != 429:
            outcome.error = f"HTTP {response.status_code}"
            return None
        outcome.refusals += 1
        wait = float(response.headers.get("retry-after", "1"))
        if outcome.refusals > max_refusals or time.monotonic() + wait > until:
            outcome.error = "refused"
            return None
        time.sleep(wait)


def _await(http: httpx.Client, outcome: Outcome, job_id: str, until: float) -> None:
    while time.monotonic() < until:
        wait = min(30.0, max(until - time.monotonic(), 0.1))
        job: dict[str, Any] = http.get(f"/v1/jobs/{job_id}", params={"wait": wait}).json()
        if job.get("status") in TERMINAL:
            outcome.job, outcome.done_at = job, time.monotonic()
            return
    outcome.error = "unfinished"


def _sample(base: str, run: Run, stop: threading.Event, every_s: float = 0.5) -> None:
    with httpx.Client(base_url=base, timeout=5) as http:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                run.samples.append(sample(http))
            stop.wait(every_s)


def sample(http: httpx.Client) -> Sample:
    """/v1/stats now."""
    stats = http.get("/v1/stats").json()
    depths = {name: int(q["depth"]) for name, q in stats["queues"].items()}
    cpu = sum(float(v) for v in stats.get("cpu_s", {}).values())
    return Sample(time.monotonic(), float(stats["device"].get("busy_s", 0.0)), depths, cpu)
