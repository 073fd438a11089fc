"""`stoker bench`: stoker's pipeline against the synchronous baseline, side by side in one invocation.

For each offered load the same deterministic workload (bench/workload.py) is driven open-loop through a fresh
stack of each mode (interleaved: the order flips from one load to the next, so drift on a noisy machine hits both),
then an overhead micro-benchmark times no-op jobs served from the cache. Writes results.json, results.md and PNG
plots into --out, and prints the tables.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from bench.drive import drive
from bench.report import compare, markdown, percentile, plot, summarise
from bench.stack import Device, Mode, bench_redis, bench_stack
from bench.workload import WORKLOADS, Request, WorkloadSpec, describe, generate, text_png
from workers.procs import ROOT

console = Console(soft_wrap=True)
MODES: tuple[Mode, ...] = ("pipeline", "sync", "sync-pool")
#: Where each run's process logs go (not with the results: those may be docs).
LOGS = ROOT / "bench" / "results" / "logs"


def parser() -> argparse.ArgumentParser:
    """The command line of `stoker bench` (also `python -m bench.harness`)."""
    p = argparse.ArgumentParser(prog="stoker bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a small run (< 4 min on 2 cores): one load, every mode")
    p.add_argument("--mode", choices=["all", *MODES], default="all")
    p.add_argument("--rates", default=None, help="offered loads, jobs/s (default 1,2,3,4; device-bound 32,64,96)")
    p.add_argument(
        "--workload",
        choices=["both", *WORKLOADS],
        default=None,
        help="the regimes to run: cpu-bound (today's mix), device-bound (light preprocessing; the device is the "
        "limit), or both (default; --quick: cpu-bound)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="requests per run (default 90; device-bound: 10 s of arrivals at its highest rate)",
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--repeat", type=float, default=0.4, help="share of media requests repeating earlier media")
    p.add_argument("--bad", type=float, default=0.01, help="share of requests with a corrupt image or a bomb")
    p.add_argument("--backend", choices=["sim", "transformers"], default="sim")
    p.add_argument("--sim-base-ms", type=float, default=None, help="the simulated device's ms per batch (300)")
    p.add_argument("--sim-per-item-ms", type=float, default=None, help="and per item in it (40; device-bound: 5)")
    p.add_argument("--batch", type=int, default=None, help="the most items a batch holds (8; device-bound: 32)")
    p.add_argument(
        "--sim-steps",
        type=int,
        default=SIM_STEPS,
        help=f"decoding steps a simulated call is made of, between which requests join ({SIM_STEPS}; 0: it runs whole)",
    )
    p.add_argument(
        "--queue-limit",
        type=int,
        default=None,
        help="admission limit of every queue, every mode (default: five batches of --batch, at least 40)",
    )
    p.add_argument("--drain-s", type=float, default=None, help="wait for answers after the last arrival (120 s)")
    p.add_argument("--overhead-jobs", type=int, default=None, help="no-op jobs per overhead case (40; 0: skip)")
    p.add_argument("--overhead-only", action="store_true", help="only the overhead micro-benchmark")
    p.add_argument("--target", default=None, help="drive a running stack at this URL instead (one run, --mode)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    return p


#: Defaults of a full run, and of --quick (one load, few jobs, a short drain and overhead run); options given
#: on the command line win over both.
FULL: dict[str, Any] = {"rates": "1,2,3,4", "jobs": 90, "drain_s": 120.0, "overhead_jobs": 40, "workload": "both"}
QUICK: dict[str, Any] = {"rates": "3", "jobs": 36, "drain_s": 45.0, "overhead_jobs": 10, "workload": "cpu-bound"}
#: Each regime's simulated device (ms per batch, ms per item, most items a batch), unless --sim-base-ms,
#: --sim-per-item-ms or --batch say otherwise. The device-bound regime's batch costs mostly the same whatever it
#: holds, as a large model's decoding step does up to its memory bandwidth: the device on which batching the whole
#: fleet's work matters (at 300 + 40 ms per item a batch of 8 costs twice a batch of one, and batching hardly does).
DEVICES = {"cpu-bound": (300.0, 40.0, 8), "device-bound": (300.0, 5.0, 32)}
#: Every regime's device is a call of 30 decoding steps (about 10 ms each, as a large model's are on a GPU), and
#: the pipeline's consumer lets waiting requests join between them, as it does with the local model
#: (`STOKER_YIELD_TOKENS`) and as servers that schedule every step do. A synchronous worker cannot: its one thread,
#: in the call, is the one that would prepare the joiner. Before 2026-12-05 20:20 UTC calls ran whole (0).
SIM_STEPS = 30
#: Offered loads of the device-bound regime (its device serves about 70 jobs/s in full batches of 32), unless
#: --rates names others.
DEVICE_BOUND_RATES = {"full": "32,64,96", "quick": "64"}
#: Seconds of arrivals a device-bound run has at its highest rate, unless --jobs says how many: over fewer, a pool
#: of synchronous workers has not settled into its cycle (a 6 s run showed 2.01x where 12 s showed 1.36x:
#: docs/bench/log/2026-12-02-device-bound-mix.md).
DEVICE_BOUND_ARRIVALS_S = 10
#: Batches the queues admit, waiting, before they refuse: a device that batches more needs more waiting to fill its
#: next batch while one runs (40 for batches of 8).
QUEUED_BATCHES = 5
#: The options whose defaults depend on the regime.
REGIME_OPTIONS = ("rates", "jobs", "sim_base_ms", "sim_per_item_ms", "batch", "queue_limit")


@dataclass(frozen=True)
class Regime:
    """One regime of a run: its workload, the loads it is offered, its device and its queues' limit."""

    name: str
    spec: WorkloadSpec
    rates: list[float]
    device: Device
    queue_limit: int


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left unset from the full or the quick defaults; those that depend on the regime stay unset
    (`regime` fills them)."""
    for key, value in (QUICK if args.quick else FULL).items():
        if key not in REGIME_OPTIONS and getattr(args, key) is None:
            setattr(args, key, value)
    return args


def regime(args: argparse.Namespace, name: str) -> Regime:
    """A regime's settings: the options given, else the regime's own defaults."""
    size = "quick" if args.quick else "full"
    defaults = QUICK if args.quick else FULL
    rates = args.rates or (DEVICE_BOUND_RATES[size] if name == "device-bound" else defaults["rates"])
    offered = [float(r) for r in str(rates).split(",")]
    jobs = args.jobs or defaults["jobs"]
    if name == "device-bound" and args.jobs is None:
        jobs = max(int(jobs), math.ceil(DEVICE_BOUND_ARRIVALS_S * max(offered)))
    base_ms, per_item_ms, batch = DEVICES[name]
    device = Device(
        args.backend,
        base_ms if args.sim_base_ms is None else args.sim_base_ms,
        per_item_ms if args.sim_per_item_ms is None else args.sim_per_item_ms,
        batch if args.batch is None else args.batch,
        args.sim_steps,
    )
    limit = args.queue_limit or max(40, QUEUED_BATCHES * device.batch)
    spec = WorkloadSpec(jobs=int(jobs), rate=1.0, seed=args.seed, repeat=args.repeat, bad=args.bad)
    spec = replace(spec, **WORKLOADS[name])  # type: ignore[arg-type]
    if args.quick and name == "cpu-bound":
        spec = replace(spec, sizes=spec.sizes[:3])
    return Regime(name, spec, offered, device, limit)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 when it has nothing to fail for (`shortfalls`: a quick run fails for more)."""
    args = with_defaults(parser().parse_args(argv))
    modes = MODES if args.mode == "all" else (args.mode,)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    names = list(WORKLOADS) if args.workload == "both" else [args.workload]
    regimes = [regime(args, name) for name in names]
    problems: list[str] = []
    with bench_redis() if not args.target else contextlib.nullcontext("") as base:
        for each in regimes:
            console.print(f"generating the {each.name} workload ({each.spec.jobs} requests, seed {args.seed})…")
            workload = generate(each.spec)
            console.print(f"[bold]{each.name}[/] workload: {describe(workload)}")
            rows = [] if args.overhead_only else _runs(args, each, modes, workload, base or None)
            for row in rows:
                row["workload"] = each.name
            first = each is regimes[0]
            overhead = _overhead(args, modes, each.device, base) if args.overhead_jobs and first and base else []
            pairs = _pairs(rows)
            _report(args, each, workload, rows, pairs, overhead, time.monotonic() - started)
            problems += shortfalls(rows, pairs, strict=args.quick)
    for problem in problems:
        console.print(f"[red]failed: {problem}[/]")
    return 1 if problems else 0


def shortfalls(rows: Sequence[dict[str, Any]], pairs: Sequence[dict[str, Any]], strict: bool) -> list[str]:
    """Why the benchmark failed, if it did: a run that answered no job; and, `strict` (`--quick`, CI's check that
    the harness drives every mode end to end), a run that left any job unanswered or a comparison refused. A full
    sweep may offer loads that a baseline collapses under: it reports those ("not compared") and goes on."""
    where = [f"{row['mode']} at {row['offered_per_s']} jobs/s" for row in rows]
    problems = [f"{at} answered no job" for at, row in zip(where, rows, strict=True) if not _answered(row)]
    if strict:
        problems += [
            f"{at} left {row['unanswered']} of {row['jobs']} jobs unanswered"
            for at, row in zip(where, rows, strict=True)
            if row["unanswered"]
        ]
        problems += [
            f"pipeline vs {pair['baseline']} at {pair['offered_per_s']} jobs/s not compared: {pair['refused']}"
            for pair in pairs
            if pair["refused"]
        ]
    return problems


def _answered(row: dict[str, Any]) -> int:
    return int(row["succeeded"] + row["degraded"])


def _runs(
    args: argparse.Namespace, regime: Regime, modes: Sequence[Mode], workload: list[Request], base: str | None
) -> list[dict[str, Any]]:
    rows = []
    for i, rate in enumerate(regime.rates):
        requests = [replace(r, at=r.at / rate) for r in workload]
        for mode in modes if i % 2 == 0 else tuple(reversed(modes)):
            console.print(f"[bold]{mode}[/] at {rate} jobs/s: {len(requests)} requests…")
            rows.append(_one_run(args, regime, mode, rate, requests, base))
            _print_row(rows[-1])
    return rows


def _one_run(
    args: argparse.Namespace, regime: Regime, mode: Mode, rate: float, requests: list[Request], base: str | None
) -> dict[str, Any]:
    if args.target:
        return summarise(mode, rate, drive(args.target, requests, args.drain_s))
    limits = {f"STOKER_{q}_QUEUE_LIMIT": str(regime.queue_limit) for q in ("CPU", "INFER")}
    assert base is not None
    with bench_stack(mode, regime.device, base, LOGS / f"{mode}-{rate}", **limits) as stack:
        return summarise(mode, rate, drive(stack.base, requests, args.drain_s))


def _print_row(row: dict[str, Any]) -> None:
    console.print(
        f"  served {row['throughput_per_s']} jobs/s, p50 {row['p50_s']} s, p99 {row['p99_s']} s, "
        f"device busy {row['device_busy']}, mean batch {row['mean_batch']}, "
        f"{row['succeeded']} ok / {row['degraded']} degraded / {row['failed']} failed, "
        f"{row['refused_429']} × 429, {row['unanswered']} unanswered {row['client_errors'] or ''}"
    )


def _overhead(args: argparse.Namespace, modes: Sequence[Mode], device: Device, base: str) -> list[dict[str, Any]]:
    """No-op jobs on a device that takes no time, one at a time: what the orchestration itself costs."""
    free = replace(device, backend="sim", base_ms=0.0, per_item_ms=0.0)
    rows = []
    for mode in modes:
        console.print(f"overhead: [bold]{mode}[/], {args.overhead_jobs} no-op jobs per case…")
        with bench_stack(mode, free, base, LOGS / f"overhead-{mode}") as stack:
            rows += [_overhead_case(stack.base, mode, case, args.overhead_jobs) for case in _CASES]
    return rows


#: The overhead cases: what is sent each time, and what the cache already holds. `chat:` cases send the same job
#: through `/v1/chat/completions` (the connection held until the answer) instead of `/v1/jobs` and a long-poll.
_CASES = (
    "text only",
    "cached image, same prompt",
    "cached image, new prompt",
    "chat: text only",
    "chat: cached image, same prompt",
)


def _overhead_case(base: str, mode: str, case: str, n: int) -> dict[str, Any]:
    client, server = [], []
    with httpx.Client(base_url=base, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for i in range(n + 1):  # the first one fills the cache and is not counted
            began = time.perf_counter()
            total_ms = _chat_once(http, case, model) if case.startswith("chat:") else _job_once(http, case, i)
            if i:
                client.append(time.perf_counter() - began)
                server.append(total_ms / 1000)
    return {
        "mode": mode,
        "case": case,
        "jobs": n,
        "client_p50_ms": _ms(percentile(client, 0.5)),
        "client_p99_ms": _ms(percentile(client, 0.99)),
        "server_p50_ms": _ms(percentile(server, 0.5)),
        "server_p99_ms": _ms(percentile(server, 0.99)),
        "client_mean_ms": round(statistics.mean(client) * 1000, 1),
    }


def _job_once(http: httpx.Client, case: str, i: int) -> float:
    """One no-op job through the job API, answered by long-poll; its server-side total (ms)."""
    prompt = "ping" if case != "cached image, new prompt" else f"ping {i}"
    files = None if case == "text only" else [("image", ("input", text_png("stoker")))]
    job = http.post("/v1/jobs", data={"prompt": prompt}, files=files).json()
    while job["status"] not in ("succeeded", "degraded", "failed"):
        job = http.get(f"/v1/jobs/{job['id']}", params={"wait": 30}).json()
    return float(job["timings_ms"]["total"])


def _chat_once(http: httpx.Client, case: str, model: str) -> float:
    """The same no-op job as a chat completion; its server-side total (ms)."""
    content: Any = "ping"
    if "image" in case:
        url = "data:image/png;base64," + base64.b64encode(text_png("stoker")).decode()
        content = [{"type": "text", "text": "ping"}, {"type": "image_url", "image_url": {"url": url}}]
    answer = http.post(
        "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": content}]}
    )
    answer.raise_for_status()
    return float(answer.json()["stoker"]["timings_ms"]["total"])


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _report(
    args: argparse.Namespace,
    regime: Regime,
    workload: list[Request],
    rows: list[dict[str, Any]],
    pairs: list[dict[str, Any]],
    overhead: list[dict[str, Any]],
    wall_s: float,
) -> None:
    name, device, spec = regime.name, regime.device, regime.spec
    table = markdown(rows, pairs)
    over = _overhead_markdown(overhead) if overhead else ""
    head = f"{name}: {device.describe()}; workload {describe(workload)}; queue limits {regime.queue_limit}"
    suffix = "" if name == "cpu-bound" else f"-{name}"
    (args.out / f"results{suffix}.md").write_text(f"{head}\n\n{table}\n\n{over}\n")
    plots = plot(rows, args.out, "" if name == "cpu-bound" else name) if rows else []
    result = {
        "device": device.describe(),
        "backend": device.backend,
        "workload": {**asdict(spec), "counts": describe(workload)},
        "runs": rows,
        "ratios": pairs,
        "overhead": overhead,
        "wall_s": round(wall_s, 1),
    }
    (args.out / f"results{suffix}.json").write_text(json.dumps(result, indent=1))
    print(f"\n{head}\n\n{table}\n\n{over}")  # plain: markdown must not be wrapped
    console.print(f"results, plots ({', '.join(p.name for p in plots)}) in {args.out}; took {wall_s:.0f} s")


def _pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pairs = compare(rows)
    for pair in pairs:
        if pair["refused"]:
            where = f"offered {pair['offered_per_s']}/s, pipeline vs {pair['baseline']}"
            console.print(f"[yellow]{where}: not compared: {pair['refused']}[/]")
    return pairs


def _overhead_markdown(rows: list[dict[str, Any]]) -> str:
    keys = ["mode", "case", "jobs", "client_p50_ms", "client_p99_ms", "server_p50_ms", "server_p99_ms"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row[k]) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
