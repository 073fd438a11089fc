"""`python -m bench.pool RESULTS.json ...`: several runs of `stoker bench` pooled into one comparison per regime and
offered load, so a tail goal is judged on hundreds of jobs a design rather than ninety.

With 90 jobs a run, a run's p99 is its slowest job or two: one recording whose transcription fell back to sampling,
or one page that waited behind others, decides it, and the same commit's p99 ratio has moved between 0.56 and 1.07
from one run to the next (docs/bench/log/2026-12-06-goals-and-method.md). Runs of other seeds
(`stoker bench --seed N --out DIR`), or of the same one again, are pooled here: each design's answered latencies of
every run at an offered load are put together and its percentiles read from them; throughput and device busy are the
runs' means; a pooled pair is compared only where every run of it could be (`bench.report.refusal`: no job
unanswered, neither design burning CPU), with each latency ratio's bootstrap interval over the pooled jobs. Prints
the table; `--out FILE` writes it as JSON too.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.report import compare, markdown, percentile, refusal


def pooled(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One mode's runs at one offered load as one row: its latencies together, its means, its counts summed."""
    latencies = sorted(x for run in runs for x in run.get("latencies_s") or [])
    answered = [run["succeeded"] + run["degraded"] for run in runs]
    costs = [(run["cpu_s_per_job"], n) for run, n in zip(runs, answered, strict=True) if run.get("cpu_s_per_job")]
    first = runs[0]
    return {
        "mode": first["mode"],
        "workload": first.get("workload", "cpu-bound"),
        "offered_per_s": first["offered_per_s"],
        "runs": len(runs),
        "jobs": sum(run["jobs"] for run in runs),
        "throughput_per_s": round(statistics.mean(run["throughput_per_s"] for run in runs), 3),
        "p50_s": percentile(latencies, 0.50),
        "p95_s": percentile(latencies, 0.95),
        "p99_s": percentile(latencies, 0.99),
        "device_busy": round(statistics.mean(run["device_busy"] for run in runs), 3),
        "cpu_s_per_job": round(sum(c * n for c, n in costs) / sum(n for _, n in costs), 3) if costs else None,
        "succeeded": sum(run["succeeded"] for run in runs),
        "degraded": sum(run["degraded"] for run in runs),
        "unanswered": sum(run.get("unanswered", 0) for run in runs),
        "latencies_s": latencies,
    }


def pool(results: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Every regime's pooled rows (one per mode and offered load) and their pairs. A pair whose runs could not be
    compared one by one is refused whole: a collapse pooled with good runs is still a collapse."""
    runs = [run for result in results for run in result["runs"]]
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run.get("workload", "cpu-bound"), run["mode"], run["offered_per_s"]), []).append(run)
    rows = [pooled(group) for _, group in sorted(groups.items())]

    def refuse(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
        """The pooled pair's refusal, else the first of its runs' (pair by pair, in the files' order)."""
        workload, rate = ours["workload"], ours["offered_per_s"]
        alone = zip(groups[(workload, "pipeline", rate)], groups[(workload, theirs["mode"], rate)], strict=False)
        return refusal(ours, theirs) or next(filter(None, (refusal(*pair) for pair in alone)), None)

    pairs = []
    for workload in sorted({row["workload"] for row in rows}):
        mine = [row for row in rows if row["workload"] == workload]
        pairs += [{**pair, "workload": workload} for pair in compare(mine, refuse=refuse)]
    return {"rows": rows, "pairs": pairs}


def main(argv: Sequence[str] | None = None) -> int:
    """Pool the files named and print each regime's table; 1 when a file holds no runs."""
    p = argparse.ArgumentParser(prog="python -m bench.pool", description=__doc__)
    p.add_argument("results", nargs="+", type=Path, help="results*.json files of `stoker bench`")
    p.add_argument("--out", type=Path, default=None, help="write the pooled rows and pairs here as JSON")
    args = p.parse_args(argv)
    results = [json.loads(path.read_text()) for path in args.results]
    if not all(result.get("runs") for result in results):
        print("a results file holds no runs")
        return 1
    out = pool(results)
    for workload in sorted({row["workload"] for row in out["rows"]}):
        rows = [row for row in out["rows"] if row["workload"] == workload]
        pairs = [pair for pair in out["pairs"] if pair["workload"] == workload]
        runs = sorted({row["runs"] for row in rows})
        print(f"\n{workload}: {len(args.results)} files, {'/'.join(map(str, runs))} runs a mode and load\n")
        print(markdown(rows, pairs))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
