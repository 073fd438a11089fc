"""Batch lines filling the device time interactive traffic leaves (OpenAI's Batch API), measured.

    .venv/bin/python -m bench.batchfill [--lines 2000] [--seconds 60] [--load 0.5]

One pipeline stack (bench/stack.py) on the simulated device. The device's capacity is what its batches can carry
(`batch` requests per `base + batch × per-item` ms); interactive text jobs arrive open-loop (Poisson) at `--load` of
it. Two phases on the same stack, each with fresh prompts (nothing rides on the cache) but the same arrival times
(one `--seed` for both), so the ratio compares the same traffic with and without the batch:

1. interactive alone for `--seconds`;
2. a `--lines`-line batch file submitted through `/v1/files` and `/v1/batches`, and the same interactive load again
   while it runs; then the batch is followed until it ends (`batch_outlasted_interactive` says whether it was still
   running when the interactive load ended: with too few lines, the end of the phase ran beside no batch).

A phase's p99 over a minute at 16.7 requests/s is its tenth slowest request, which moves with where the line
batches happen to fall among the arrivals (`bench.linepolicy --seconds 60 --schedules 40` shows the spread with no
overhead at all); longer phases (`--seconds 300`) give a steadier ratio.

Printed and written to bench/results/batchfill.json: interactive p50/p99 of each phase and their ratio (with ÷
without), the device's busy share while the batch ran (from `/v1/stats` device seconds), and batch lines per second.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.drive import Run, Sample, drive, sample
from bench.report import percentile
from bench.stack import Device, bench_redis, bench_stack
from bench.workload import Request
from stoker.adapters.openai_batch_client import ENDED, OpenAIBatchClient

RESULTS = Path(__file__).resolve().parent / "results"


def parser() -> argparse.ArgumentParser:
    """The benchmark's options."""
    args = argparse.ArgumentParser(prog="python -m bench.batchfill", description=__doc__.split("\n\n")[0])
    args.add_argument("--lines", type=int, default=2000, help="lines in the batch file")
    args.add_argument("--seconds", type=float, default=60.0, help="how long each phase's interactive load lasts")
    args.add_argument("--load", type=float, default=0.5, help="interactive arrivals, as a share of the capacity")
    args.add_argument("--base-ms", type=float, default=200.0, help="simulated device: ms per batch")
    args.add_argument("--per-item-ms", type=float, default=10.0, help="simulated device: ms per request in a batch")
    args.add_argument("--batch", type=int, default=8, help="requests per device batch")
    args.add_argument("--seed", type=int, default=11)
    args.add_argument(
        "--feeder-in-api", action="store_true", help="feed batches in the API process, not in a `stoker batch-feeder`"
    )
    return args


def interactive(rate: float, seconds: float, seed: int, tag: str) -> list[Request]:
    """Poisson arrivals of short text jobs, each prompt new (`tag` keeps the phases' prompts apart)."""
    rng, at = random.Random(seed), 0.0
    out: list[Request] = []
    while (at := at + rng.expovariate(rate)) < seconds:
        out.append(Request(len(out), at, "text", f"Say one word about item {tag}-{len(out)}-{rng.getrandbits(32)}."))
    return out


def batch_file(lines: int, model: str, tag: str) -> bytes:
    """A JSONL batch file of chat requests, each prompt new."""
    rows = (
        {
            "custom_id": f"line-{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"Caption {tag} {n}."}], "max_tokens": 8},
        }
        for n in range(lines)
    )
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def follow(client: OpenAIBatchClient, batch_id: str, samples: list[Sample], give_up_s: float) -> dict[str, Any]:
    """Poll the batch (and /v1/stats, into `samples`) every 0.5 s until it ends; the batch as it ended."""
    deadline = time.monotonic() + give_up_s
    while time.monotonic() < deadline:
        samples.append(sample(client.http))
        batch = client.retrieve(batch_id)
        if batch["status"] in ENDED:
            return batch
        time.sleep(0.5)  # polling an HTTP API: the status has no push channel
    raise SystemExit(f"batch {batch_id} did not end within {give_up_s:.0f} s")


def busy_share(samples: list[Sample], start: float, end: float) -> float | None:
    """Device busy seconds per wall second between the first and last samples inside [start, end]."""
    inside = [s for s in samples if start <= s.at <= end]
    if len(inside) < 2 or inside[-1].at <= inside[0].at:
        return None
    return round((inside[-1].busy_s - inside[0].busy_s) / (inside[-1].at - inside[0].at), 3)


def latencies(run: Run) -> dict[str, Any]:
    """The phase's interactive answers: p50/p99 and what did not come back."""
    answered = [o.latency_s for o in run.outcomes if o.latency_s is not None and o.job is not None]
    return {
        "requests": len(run.outcomes),
        "answered": len(answered),
        "refused_429": sum(o.refusals for o in run.outcomes),
        "p50_s": percentile(answered, 0.5),
        "p99_s": percentile(answered, 0.99),
        "phases_ms": phases(run),
    }


def phases(run: Run) -> dict[str, dict[str, float | None]]:
    """Where the answered jobs' time went, from their records' timings: p50 and p99 of each phase (queued before
    a stage started it, preprocessing, waiting for the device, on the device, the whole job in the store)."""
    timings = [o.job.get("timings_ms", {}) for o in run.outcomes if o.job is not None]
    return {
        name: {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99)}
        for name in ("queued", "preprocess", "infer_wait", "infer", "total")
        if (values := [t[name] for t in timings if name in t])
    }


def main(argv: list[str] | None = None) -> int:
    """Run both phases and report."""
    args = parser().parse_args(argv)
    device = Device("sim", args.base_ms, args.per_item_ms, args.batch)
    rate = args.load * device.capacity_per_s
    print(f"{device.describe()}; interactive {rate:.1f} requests/s for {args.seconds:.0f} s")
    with (
        tempfile.TemporaryDirectory(prefix="stoker-batchfill-") as scratch,
        bench_redis() as redis_base,
        bench_stack("pipeline", device, redis_base, Path(scratch) / "logs", **_settings(args, scratch)) as stack,
    ):
        alone = drive(stack.base, interactive(rate, args.seconds, args.seed, "alone"), give_up_s=60)
        client = OpenAIBatchClient(stack.base)
        model = client.http.get("/v1/models").json()["data"][0]["id"]
        lines = Path(scratch) / "lines.jsonl"
        lines.write_bytes(batch_file(args.lines, model, "fill"))
        batch_id = client.create(client.upload(lines)["id"])["id"]
        samples: list[Sample] = []
        ended: dict[str, Any] = {}
        follower = threading.Thread(
            target=lambda: ended.update(follow(client, batch_id, samples, give_up_s=3600)), daemon=True
        )
        follower.start()
        beside = drive(stack.base, interactive(rate, args.seconds, args.seed, "beside"), give_up_s=60)
        follower.join()
        client.close()
    result = report(args, device, device.capacity_per_s, rate, alone, beside, ended, samples)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "batchfill.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def _settings(args: argparse.Namespace, scratch: str) -> dict[str, str]:
    return {"STOKER_FILES_DIR": scratch, "STOKER_BATCH_FEEDER": "true" if args.feeder_in_api else "false"}


def report(
    args: argparse.Namespace,
    device: Device,
    capacity: float,
    rate: float,
    alone: Run,
    beside: Run,
    batch: dict[str, Any],
    samples: list[Sample],
) -> dict[str, Any]:
    """The numbers docs/benchmarks.md quotes."""
    started, done = batch.get("in_progress_at"), batch.get("completed_at") or batch.get("finalizing_at")
    counts = batch.get("request_counts", {})
    wall = (done - started) if started and done else None
    # The batch's run in this machine's monotonic clock: from the first sample to the last one before it ended.
    running = [s for s in samples if s.at >= beside.started]
    first, last = (running[0].at, running[-1].at) if running else (0.0, 0.0)
    without, with_ = latencies(alone), latencies(beside)
    ratio = {q: round(with_[q] / without[q], 2) if with_[q] and without[q] else None for q in ("p50_s", "p99_s")}
    return {
        "device": device.describe(),
        "feeder": "in the API" if args.feeder_in_api else "a process of its own",
        "capacity_per_s": round(capacity, 1),
        "interactive_rate_per_s": round(rate, 1),
        "interactive_alone": without,
        "interactive_beside_batch": with_,
        "ratio_with_over_without": ratio,
        "device_busy_alone": busy_share(alone.samples, alone.started, alone.ended),
        "device_busy_while_batch_ran": busy_share(samples, first, last),
        "device_busy_batch_and_interactive": busy_share(samples, first, beside.ended),
        "batch_outlasted_interactive": bool(running) and last >= beside.ended,
        "batch": {
            "status": batch.get("status"),
            "lines": args.lines,
            "completed": counts.get("completed"),
            "failed": counts.get("failed"),
            "seconds": wall,
            "lines_per_s": round(counts.get("completed", 0) / wall, 1) if wall else None,
        },
    }


if __name__ == "__main__":
    raise SystemExit(main())
