"""The inference consumer at saturation and under overload, on the simulated device.

    .venv/bin/python -m bench.saturation [--seconds 30] [--base-ms 400] [--per-item-ms 50]

Starts its own API, CPU worker, inference worker (`STOKER_BACKEND=sim`: a batch takes base + per-item ms asleep,
so the device is busy while the CPUs are free) and reaper against Redis databases 5-7 of STOKER_BENCH_REDIS
(default redis://127.0.0.1:6379), then drives text-only jobs open-loop (Poisson arrivals) in two phases:

- saturation: 1.5x the device's capacity with admission limits out of the way: device busy fraction and
  throughput (in the steady state: after the first 5 s), mean batch size, latency, the device's idle gaps;
- overload: 3x capacity with tight queue limits: how many jobs are refused (429), and how accurate Retry-After
  is: each refused client comes back after Retry-After, and the predicted wait is compared with the time the
  refusing queue actually took to fall back under its resume threshold.

Writes bench/results/saturation.json and prints a markdown table. Capacity is max_batch_size / (base + per-item x
max_batch_size) jobs per second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.stack import wait_ready
from stoker.settings import BenchSettings
from workers.broker import free_port
from workers.procs import spawn

ROOT = Path(__file__).resolve().parent.parent
BATCH = 8
#: Device busy and throughput are measured in the steady state: from this long after the load starts (while
#: the first requests make their way through an empty pipeline) to its end.
WARM_UP_S = 5.0
#: Client threads sharing one connection pool.
CLIENTS = 64
#: As many connections kept alive as the pool may open: httpcore closes a surplus kept-alive connection that it has
#: already handed to another thread's request (encode/httpcore#1110), which that request sees as a `ReadError`
#: (EBADF) from the client, not from the server.
LIMITS = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)


@dataclass
class Phase:
    """One run of the load generator against a fresh stack."""

    name: str
    rate: float
    seconds: float
    limits: dict[str, str]
    accepted: list[str] = field(default_factory=list)
    refusals: list[tuple[float, str, int]] = field(default_factory=list)  # (when, queue, retry-after)
    retries: list[bool] = field(default_factory=list)  # accepted on the first retry after Retry-After?
    statuses: dict[str, int] = field(default_factory=dict)  # every answer (or exception), counted
    timers: list[threading.Timer] = field(default_factory=list)
    samples: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # /v1/stats over time
    lock: threading.Lock = field(default_factory=threading.Lock)


def start_stack(env: dict[str, str], port: int, logs: Path) -> list[subprocess.Popen[bytes]]:
    """API, CPU worker, simulated inference worker and reaper, each in its own session, logging into logs/."""
    logs.mkdir(parents=True, exist_ok=True)
    commands = {"api": ["api", "--port", str(port)], "cpu": ["worker", "cpu"], "infer": ["worker", "infer"]}
    commands["reaper"] = ["reaper"]
    return [spawn(tuple(args), env, logs / f"{name}.log") for name, args in commands.items()]


def run_phase(phase: Phase, sim: tuple[float, float], redis_base: str, seed: int) -> dict[str, Any]:
    """Fresh databases and processes, the load, then the facts."""
    urls = {f"STOKER_{k}_URL": f"{redis_base}/{db}" for k, db in (("BROKER", 5), ("RESULT", 6), ("CACHE", 7))}
    for url in urls.values():
        with redis.Redis.from_url(url) as client:
            client.flushdb()
    env = {
        **os.environ,
        **urls,
        **phase.limits,
        "STOKER_BACKEND": "sim",
        "STOKER_AUTH": "off",  # one client, no keys, and only the queue limits refuse work
        "STOKER_SIM_BASE_MS": str(sim[0]),
        "STOKER_SIM_PER_ITEM_MS": str(sim[1]),
        "STOKER_MAX_BATCH_SIZE": str(BATCH),
    }
    port = free_port()
    procs = start_stack(env, port, ROOT / "bench" / "results" / "logs" / phase.name.split()[0])
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base)
        time.sleep(5)  # workers connect and preload
        return _drive(phase, base, seed)
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=60)


def _drive(phase: Phase, base: str, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_stats, args=(phase, base, stop), daemon=True)
    sampler.start()
    started = time.monotonic()
    steady: list[tuple[float, tuple[float, float]]] = []  # when the measured window opens, and the counters then
    with (
        ThreadPoolExecutor(max_workers=CLIENTS) as pool,
        httpx.Client(base_url=base, timeout=30, limits=LIMITS) as http,
    ):
        n, next_at = 0, started
        while next_at - started < phase.seconds:
            time.sleep(max(next_at - time.monotonic(), 0))
            pool.submit(_client, phase, http, n, pool)
            n += 1
            next_at += rng.expovariate(phase.rate)
            if not steady and time.monotonic() - started >= WARM_UP_S:
                steady.append((time.monotonic(), _device_and_served(base)))
        window = _device_and_served(base)
        opened, before = steady[0]
        offered_s = time.monotonic() - started
        measured_s = time.monotonic() - opened
        for timer in list(phase.timers):  # every refused client has come back
            timer.join()
        time.sleep(1.0)
        jobs = [_finished(http, job_id) for job_id in list(phase.accepted)]
    busy, served = (w - b for w, b in zip(window, before, strict=True))
    stop.set()
    sampler.join(5)
    row = _summarise(phase, jobs, n, offered_s, busy / measured_s * offered_s, served / measured_s * offered_s)
    gap = httpx.get(f"{base}/v1/stats", timeout=5).json().get("device_idle_gap", {})
    return {**row, "idle_gap_p50_ms": gap.get("p50_ms"), "idle_gap_p99_ms": gap.get("p99_ms")}


def _client(phase: Phase, http: httpx.Client, n: int, pool: ThreadPoolExecutor, attempt: int = 0) -> None:
    """One client: submit; on 429 come back once after Retry-After (a timer, so no thread sits waiting)."""
    try:
        response = http.post("/v1/jobs", data={"prompt": f"Question {n}: what is {n} squared?"})
    except httpx.HTTPError as exc:
        _count(phase, type(exc).__name__)
        return
    _count(phase, str(response.status_code))
    with phase.lock:
        if attempt:
            phase.retries.append(response.status_code == 202)
        if response.status_code == 202:
            phase.accepted.append(response.json()["id"])
        elif response.status_code == 429 and not attempt:
            wait = int(response.headers["retry-after"])
            queue = response.json()["error"]["message"].split()[1]
            phase.refusals.append((time.monotonic(), queue, wait))
            timer = threading.Timer(wait, pool.submit, args=(_client, phase, http, n, pool, 1))
            phase.timers.append(timer)
            timer.start()


def _count(phase: Phase, what: str) -> None:
    with phase.lock:
        phase.statuses[what] = phase.statuses.get(what, 0) + 1


def _sample_stats(phase: Phase, base: str, stop: threading.Event) -> None:
    with httpx.Client(base_url=base, timeout=5) as http:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                phase.samples.append((time.monotonic(), http.get("/v1/stats").json()))
            stop.wait(0.25)


def _device_and_served(base: str) -> tuple[float, float]:
    """Device seconds busy and inference requests served, so far."""
    stats = httpx.get(f"{base}/v1/stats", timeout=5).json()
    return float(stats["device"].get("busy_s", 0.0)), float(stats["drained"].get("infer", 0.0))


def _finished(http: httpx.Client, job_id: str) -> dict[str, Any]:
    for _ in range(40):
        job: dict[str, Any] = http.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()
        if job["status"] in ("succeeded", "degraded", "failed"):
            return job
    raise SystemExit(f"job {job_id} never finished")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(int(len(ordered) * q), len(ordered) - 1)], 1) if ordered else 0.0


def _retry_after_error(phase: Phase, resume_ratio: float = 0.8) -> list[float]:
    """Per refusal: Retry-After minus the time its queue actually took to fall under its resume threshold."""
    errors = []
    for when, queue, predicted in phase.refusals:
        for at, stats in phase.samples:
            q = stats["queues"].get(queue)
            if at >= when and q and q["depth"] <= math.floor(q["limit"] * resume_ratio):
                errors.append(predicted - (at - when))
                break
    return errors


def _summarise(
    phase: Phase, jobs: list[dict[str, Any]], offered: int, offered_s: float, busy: float, served: float
) -> dict[str, Any]:
    """Throughput and device busy are over the load window; latencies over every accepted job."""
    done = [j for j in jobs if j["status"] == "succeeded"]
    sizes = {j["batch"]["id"]: j["batch"]["size"] for j in done if j.get("batch")}
    totals = [j["timings_ms"]["total"] for j in done]
    errors = _retry_after_error(phase)
    return {
        "phase": phase.name,
        "offered_per_s": round(offered / offered_s, 2),
        "offered": offered,
        "accepted": len(jobs),
        "succeeded": len(done),
        "refused_429": len(phase.refusals),
        "throughput_per_s": round(served / offered_s, 2),
        "device_busy": round(busy / offered_s, 3),
        "mean_batch": round(statistics.mean(sizes.values()), 2) if sizes else 0.0,
        "mean_ms": round(statistics.mean(totals), 1) if totals else 0.0,
        "p50_ms": _percentile(totals, 0.5),
        "p99_ms": _percentile(totals, 0.99),
        "max_ms": round(max(totals), 1) if totals else 0.0,
        "retry_accepted": round(sum(phase.retries) / len(phase.retries), 2) if phase.retries else None,
        "retry_after_error_s_p50": round(statistics.median(errors), 1) if errors else None,
        "answers": dict(sorted(phase.statuses.items())),
    }


def main() -> None:
    """Both phases, one table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--base-ms", type=float, default=400.0)
    parser.add_argument("--per-item-ms", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", choices=["saturation", "overload"], default=None)
    args = parser.parse_args()
    capacity = BATCH / ((args.base_ms + args.per_item_ms * BATCH) / 1000)
    redis_base = BenchSettings().bench_redis
    loose = {"STOKER_CPU_QUEUE_LIMIT": "100000", "STOKER_INFER_QUEUE_LIMIT": "100000"}
    tight = {
        "STOKER_CPU_QUEUE_LIMIT": "20",
        "STOKER_INFER_QUEUE_LIMIT": "40",
        "STOKER_INFER_HIGH_WATERMARK": "16",
        "STOKER_INFER_LOW_WATERMARK": "8",
    }
    sim = (args.base_ms, args.per_item_ms)
    phases = [Phase("saturation 1.5x", 1.5 * capacity, args.seconds, loose)]
    phases.append(Phase("overload 3x", 3 * capacity, args.seconds, tight))
    rows = [run_phase(p, sim, redis_base, args.seed) for p in phases if args.only in (None, p.name.split()[0])]
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    for row in rows:
        row["served_of_capacity"] = round(row["throughput_per_s"] / capacity, 3)
    report = {"capacity_per_s": round(capacity, 2), "sim_ms": sim, "batch": BATCH, "rows": rows}
    (ROOT / "bench" / "results" / "saturation.json").write_text(json.dumps(report, indent=2))
    print(f"device capacity {capacity:.1f} jobs/s (sim {args.base_ms:.0f} ms + {args.per_item_ms:.0f} ms/item)\n")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
