"""The interactive latency the batch-line policy allows at best, with no overhead: a queueing model, not a run.

    .venv/bin/python -m bench.linepolicy [--load 0.5] [--base-ms 40] [--per-item-ms 25] [--batch 8]

The inference consumer's policy, modelled alone: interactive requests arrive open-loop (Poisson) at `--load` of the
device's capacity; a free device takes every interactive request waiting (up to `--batch`) into a batch of their
own; with none waiting, it takes a batch of `L` batch lines, which runs to the end (a batch is never preempted).
Each batch costs `base + n × per-item` ms. Printed: interactive p50/p99 alone and beside an endless batch for each
`L`, their ratios and the lines served per second: what `bench.batchfill` can measure at best, since the real stack
adds its own overheads.
"""

from __future__ import annotations

import argparse

from bench.batchfill import interactive
from bench.report import percentile


def latencies(
    line_batch: int, rate: float, seconds: float, cost: tuple[float, float], batch: int, seed: int
) -> tuple[list[float], float]:
    """Interactive latencies (s) over `seconds` of arrivals, and batch lines served per second; `line_batch` 0
    means no batch lines at all."""
    arrivals = [request.at for request in interactive(rate, seconds, seed, "model")]  # bench.batchfill's schedule
    base_s, per_item_s = cost
    now, taken, waited, lines = 0.0, 0, [], 0
    while taken < len(arrivals):
        waiting = [a for a in arrivals[taken : taken + batch] if a <= now]
        if waiting:
            now += base_s + per_item_s * len(waiting)
            waited += [now - a for a in waiting]
            taken += len(waiting)
        elif line_batch:
            now += base_s + per_item_s * line_batch  # lines fill the idle device; the batch runs to its end
            lines += line_batch
        else:
            now = arrivals[taken]
    return waited, lines / now


def main(argv: list[str] | None = None) -> int:
    """Print the model's percentiles for batches of 1, 2, 4 and `--batch` lines."""
    args = argparse.ArgumentParser(prog="python -m bench.linepolicy", description=__doc__.split("\n\n")[0])
    args.add_argument("--load", type=float, default=0.5, help="interactive arrivals, as a share of the capacity")
    args.add_argument("--base-ms", type=float, default=40.0)
    args.add_argument("--per-item-ms", type=float, default=25.0)
    args.add_argument("--batch", type=int, default=8, help="requests per device batch")
    args.add_argument("--seconds", type=float, default=20_000.0, help="arrivals modelled")
    args.add_argument("--seed", type=int, default=1)
    args.add_argument("--schedules", type=int, default=1, help="arrival schedules per ratio (min / median / max)")
    opts = args.parse_args(argv)
    cost = (opts.base_ms / 1000, opts.per_item_ms / 1000)
    rate = opts.load * opts.batch / (cost[0] + opts.batch * cost[1])
    alone, _ = latencies(0, rate, opts.seconds, cost, opts.batch, opts.seed)
    p50, p99 = percentile(alone, 0.5) or 0.0, percentile(alone, 0.99) or 0.0
    print(f"interactive {rate:.1f}/s alone: p50 {p50:.3f} s, p99 {p99:.3f} s")
    if opts.schedules > 1:
        print_spread(opts, rate, cost)
        return 0
    print("lines per batch | p50 s | p99 s | p50 with ÷ without | p99 with ÷ without | lines/s")
    for line_batch in sorted({1, 2, 4, opts.batch}):
        beside, lines_per_s = latencies(line_batch, rate, opts.seconds, cost, opts.batch, opts.seed)
        q50, q99 = percentile(beside, 0.5) or 0.0, percentile(beside, 0.99) or 0.0
        print(f"{line_batch} | {q50:.3f} | {q99:.3f} | {q50 / p50:.2f} | {q99 / p99:.2f} | {lines_per_s:.1f}")
    return 0


def print_spread(opts: argparse.Namespace, rate: float, cost: tuple[float, float]) -> None:
    """Min / median / max of the ratios over `opts.schedules` arrival schedules, each with and without lines."""
    print(f"{opts.schedules} schedules of {opts.seconds:.0f} s each (min / median / max)")
    print("lines per batch | p50 with ÷ without | p99 with ÷ without")
    seeds = range(opts.seed, opts.seed + opts.schedules)
    alone = {seed: latencies(0, rate, opts.seconds, cost, opts.batch, seed)[0] for seed in seeds}  # once per schedule
    for line_batch in sorted({1, 2, 4, opts.batch}):
        p50s, p99s = [], []
        for seed in seeds:
            beside, _ = latencies(line_batch, rate, opts.seconds, cost, opts.batch, seed)
            p50s.append((percentile(beside, 0.5) or 0.0) / (percentile(alone[seed], 0.5) or 1.0))
            p99s.append((percentile(beside, 0.99) or 0.0) / (percentile(alone[seed], 0.99) or 1.0))
        print(f"{line_batch} | {_spread(p50s)} | {_spread(p99s)}")


def _spread(values: list[float]) -> str:
    ordered = sorted(values)
    return f"{ordered[0]:.2f} / {ordered[len(ordered) // 2]:.2f} / {ordered[-1]:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
