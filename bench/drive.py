"""The load generator: open loop (each request at its arrival time, whatever the stack is doing), clients that
come back after Retry-After when refused, long-polling for the answer; and a sampler of /v1/stats."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httptools
import httpx

from bench import rawload
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
    """Send every request at its time; wait for every answer, or until give_up_s after the last arrival.

    The clients are coroutines on one event loop (`bench.rawload.Connections`: requests built as bytes before the
    clock starts, responses parsed by httptools), so the load generator takes little of the cores it shares with
    the stack it measures: httpx, a thread per client, cost about 0.8 ms of CPU per request here, and a job is two
    requests or more, which at a hundred jobs a second was a sixth of the machine taken from whichever design the
    cores hold back (docs/bench/log/2026-12-05-cheaper-load-generator-and-backlog-baseline.md)."""
    time.sleep(CPU_SETTLE_S)  # every worker has counted what starting it cost
    with httpx.Client(base_url=base, timeout=5) as http:
        before = sample(http).cpu_s
    connections = rawload.Connections(base)
    posts = [_post(connections, request) for request in requests]
    run = Run(started=time.monotonic(), cpu_before_s=before)
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(base, run, stop), daemon=True)
    sampler.start()
    until = run.started + (requests[-1].at if requests else 0.0) + give_up_s
    asyncio.run(_arrivals(connections, run, list(zip(requests, posts, strict=True)), until, max_refusals))
    run.ended = time.monotonic()
    stop.set()
    sampler.join(5)
    time.sleep(CPU_SETTLE_S)  # every worker has counted its CPU up to the last answer
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError), httpx.Client(base_url=base, timeout=5) as http:
        run.samples.append(sample(http))
    return run


def _post(connections: rawload.Connections, request: Request) -> bytes:
    """The request's submission as the bytes httpx would send: its prompt as a form, its media as a file (a
    multipart form, encoded by httpx itself)."""
    files = [(request.media.kind, ("input", request.media.data))] if request.media else None
    built = httpx.Request("POST", "http://stoker/v1/jobs", data={"prompt": request.prompt}, files=files)
    return connections.request("POST", "/v1/jobs", built.read(), built.headers["content-type"])


async def _arrivals(
    connections: rawload.Connections,
    run: Run,
    requests: list[tuple[Request, bytes]],
    until: float,
    max_refusals: int,
) -> None:
    """Start a client for each request at its arrival time (open loop), then wait for all of them."""
    clients = []
    for request, post in requests:
        await asyncio.sleep(max(run.started + request.at - time.monotonic(), 0.0))
        outcome = Outcome(request, time.monotonic())
        run.outcomes.append(outcome)
        clients.append(asyncio.create_task(_client(connections, outcome, post, until, max_refusals)))
    await asyncio.gather(*clients)
    connections.close()


async def _client(
    connections: rawload.Connections, outcome: Outcome, post: bytes, until: float, max_refusals: int
) -> None:
    try:
        job_id = await _submit(connections, outcome, post, until, max_refusals)
        if job_id is not None:
            await _await(connections, outcome, job_id, until)
    except (OSError, TimeoutError, httptools.HttpParserError) as exc:  # ConnectionError is an OSError
        outcome.error = type(exc).__name__


async def _submit(
    connections: rawload.Connections, outcome: Outcome, post: bytes, until: float, max_refusals: int
) -> str | None:
    """POST until accepted, sleeping Retry-After after each 429; None if refused for good or out of time."""
    while True:
        reply = await connections.exchange(post, timeout_s=60)
        if reply.status == 202:
            return str(json.loads(reply.body)["id"])
        if reply.status != 429:
            outcome.error = f"HTTP {reply.status}"
            return None
        outcome.refusals += 1
        wait = float(reply.retry_after or b"1")
        if outcome.refusals > max_refusals or time.monotonic() + wait > until:
            outcome.error = "refused"
            return None
        await asyncio.sleep(wait)


async def _await(connections: rawload.Connections, outcome: Outcome, job_id: str, until: float) -> None:
    """Long-poll the job until it has ended, or until `until`."""
    while time.monotonic() < until:
        wait = min(30.0, max(until - time.monotonic(), 0.1))
        reply = await connections.exchange(connections.request("GET", f"/v1/jobs/{job_id}?wait={wait:.3f}"), wait + 30)
        if reply.status != 200:
            outcome.error = f"HTTP {reply.status}"
            return
        job: dict[str, Any] = json.loads(reply.body)
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
