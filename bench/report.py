"""What a run measured, from the job records and the client's clock; the comparison; the markdown and the plots."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.drive import Outcome, Run, Sample

ANSWERED = ("succeeded", "degraded")
#: One colour per mode in every plot.
COLOURS = {"pipeline": "tab:blue", "sync": "tab:orange", "sync-pool": "tab:green"}
#: Columns of the summary table, in order, with their headings.
COLUMNS = {
    "mode": "mode",
    "offered_per_s": "offered jobs/s",
    "throughput_per_s": "served jobs/s",
    "p50_s": "p50 s",
    "p95_s": "p95 s",
    "p99_s": "p99 s",
    "text_p50_s": "text-only p50 s",
    "device_busy": "device busy",
    "mean_batch": "mean batch",
    "preprocess_share": "preprocess share",
    "cache_hit_rate": "cache hit rate",
    "cpu_s_per_job": "CPU s/job",
    "succeeded": "succeeded",
    "degraded": "degraded",
    "failed": "failed",
    "refused_429": "429s",
    "unanswered": "unanswered",
}
#: The synchronous baselines; the pipeline is compared with each, and its claims hold against the better one.
BASELINES = ("sync", "sync-pool")
#: Ratios pipeline ÷ sync worth reading, and which way is better.
RATIOS = {"throughput_per_s": "higher", "p50_s": "lower", "p95_s": "lower", "p99_s": "lower", "device_busy": "higher"}
#: The latency ratios given with an interval (`ratio_intervals`), and the quantile each is of.
QUANTILES = {"p50_s": 0.50, "p95_s": 0.95, "p99_s": 0.99}
#: Resamples drawn for each interval, and the share of them the interval holds.
DRAWS = 2000
LEVEL = 0.9


def summarise(mode: str, rate: float, run: Run) -> dict[str, Any]:
    """The metrics of one run. Throughput and device busy are over the span from the first arrival to the last
    answer; latencies are the clients' (first try to answer, 429 waits included), over answered jobs."""
    answered = [o for o in run.outcomes if o.job and o.job["status"] in ANSWERED]
    finished = [o.done_at for o in run.outcomes if o.done_at is not None]
    span = max(max(finished, default=run.ended) - run.started, 1e-9)
    latencies = [o.latency_s for o in answered if o.latency_s is not None]
    text = [o.latency_s for o in answered if o.request.kind == "text" and o.latency_s is not None]
    jobs = [o.job for o in run.outcomes if o.job]
    return {
        "mode": mode,
        "offered_per_s": round(rate, 2),
        "jobs": len(run.outcomes),
        "throughput_per_s": round(len(answered) / span, 3),
        "p50_s": percentile(latencies, 0.50),
        "p95_s": percentile(latencies, 0.95),
        "p99_s": percentile(latencies, 0.99),
        "text_p50_s": percentile(text, 0.50),
        "device_busy": round(_busy_between(run.samples, run.started, run.started + span) / span, 3),
        "mean_batch": _mean_batch(jobs),
        "preprocess_share": _mean([j["preprocess_share"] for j in jobs if j.get("preprocess_share") is not None]),
        "cache_hit_rate": _cache_hit_rate(jobs),
        "cpu_s_per_job": round(run.cpu_s() / len(answered), 3) if answered and run.samples else None,
        **{status: sum(1 for j in jobs if j["status"] == status) for status in ("succeeded", "degraded", "failed")},
        "failure_codes": _codes(jobs),
        "refused_429": sum(o.refusals for o in run.outcomes),
        "unanswered": sum(1 for o in run.outcomes if o.job is None),
        "client_errors": _client_errors(run.outcomes),
        "latencies_s": [round(x, 3) for x in sorted(latencies)],
        "slowest": slowest(answered),
        "busy_over_time": busy_series(run.samples, run.started),
    }


def slowest(answered: Sequence[Outcome], count: int = 3) -> list[dict[str, Any]]:
    """Where the tail lives: the slowest answered jobs, what each carried and where its time went (with 90 jobs a
    run, its p99 is the slowest job)."""
    ranked = sorted(answered, key=lambda o: o.latency_s or 0.0, reverse=True)[:count]
    return [
        {
            "n": o.request.n,
            "at_s": round(o.request.at, 2),
            "carried": o.request.media.label if o.request.media else o.request.kind,
            "latency_s": round(o.latency_s or 0.0, 3),
            "timings_ms": (o.job or {}).get("timings_ms", {}),
            "inputs_ms": [i.get("timings_ms", {}) for i in (o.job or {}).get("inputs", [])],
        }
        for o in ranked
    ]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (nearest rank), in seconds to the millisecond; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)], 3)


def _mean(values: Sequence[float]) -> float | None:
    return round(statistics.mean(values), 3) if values else None


def _mean_batch(jobs: list[dict[str, Any]]) -> float | None:
    sizes = {j["batch"]["id"]: j["batch"]["size"] for j in jobs if j.get("batch")}
    return _mean(list(sizes.values()))


def _cache_hit_rate(jobs: list[dict[str, Any]]) -> float | None:
    """Share of stage-cache lookups that hit, over every input of every job (keyframes included)."""
    lookups = [hit for j in jobs for i in _all_inputs(j["inputs"]) for hit in i.get("cache_hit", {}).values()]
    return round(sum(lookups) / len(lookups), 3) if lookups else None


def _all_inputs(inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [x for i in inputs for x in (i, *(i.get("frames") or []))]


def _codes(jobs: list[dict[str, Any]]) -> dict[str, int]:
    """Error codes of failed inputs and failed jobs, counted."""
    codes: dict[str, int] = {}
    errors = [i.get("error") for j in jobs for i in _all_inputs(j["inputs"])] + [j.get("error") for j in jobs]
    for error in errors:
        if error:
            codes[error["code"]] = codes.get(error["code"], 0) + 1
    return dict(sorted(codes.items()))


def _client_errors(outcomes: list[Outcome]) -> dict[str, int]:
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
    return errors


def _busy_between(samples: list[Sample], start: float, end: float) -> float:
    inside = [s for s in samples if start <= s.at <= end]
    return inside[-1].busy_s - inside[0].busy_s if len(inside) >= 2 else 0.0


def busy_series(samples: list[Sample], start: float, window_s: float = 2.0) -> list[tuple[float, float]]:
    """Device busy fraction over time: (seconds since start, busy share of the trailing window)."""
    series, j = [], 0
    for sample in samples:
        while sample.at - samples[j].at > window_s:
            j += 1
        dt = sample.at - samples[j].at
        if dt > 0:
            series.append((round(sample.at - start, 2), round((sample.busy_s - samples[j].busy_s) / dt, 3)))
    return series


#: A run that spent more CPU per job than this many times the other run of its pair did work the other did not
#: (oversubscribed threads, a spinning lock) or ran on a host slowed meanwhile: its ratios would compare a broken
#: run, not a design.
MAX_CPU_RATIO = 1.5


def refusal(pipeline: dict[str, Any], baseline: dict[str, Any]) -> str | None:
    """Why the two runs must not be compared (None: they may): a run that left jobs unanswered measured a
    collapse, not a throughput; a run far costlier in CPU per job than the other, either way round, measured a
    fault or a slower host (the same jobs cost both designs about the same CPU), not a design."""
    for row in (pipeline, baseline):
        if row.get("unanswered"):
            return f"{row['mode']} left {row['unanswered']} of {row.get('jobs', '?')} jobs unanswered"
    for costly, other in ((baseline, pipeline), (pipeline, baseline)):
        theirs, ours = costly.get("cpu_s_per_job"), other.get("cpu_s_per_job")
        if ours and theirs and theirs > MAX_CPU_RATIO * ours:
            return (
                f"{costly['mode']} spent {theirs} CPU s per job, {theirs / ours:.1f}x {other['mode']}'s {ours}"
                f" (more than {MAX_CPU_RATIO}x): a fault in its run or a slowed host, not its design"
            )
    return None


def ratios(pipeline: dict[str, Any], sync: dict[str, Any]) -> dict[str, float | None]:
    """pipeline ÷ sync for the headline metrics."""
    out: dict[str, float | None] = {}
    for key in RATIOS:
        a, b = pipeline.get(key), sync.get(key)
        out[key] = round(a / b, 2) if a is not None and b else None
    return out


def compare(
    rows: list[dict[str, Any]],
    baselines: Sequence[str] = BASELINES,
    refuse: Callable[[dict[str, Any], dict[str, Any]], str | None] = refusal,
) -> list[dict[str, Any]]:
    """Per offered load, the pipeline's run against each baseline's: the ratios and their intervals, or why the
    two runs must not be compared (`refuse`: `refusal` unless the caller knows more, as `bench.pool` does)."""
    pairs = []
    for rate in sorted({r["offered_per_s"] for r in rows}):
        by_mode = {r["mode"]: r for r in rows if r["offered_per_s"] == rate}
        for baseline in baselines:
            if {"pipeline", baseline} <= set(by_mode):
                ours, theirs = by_mode["pipeline"], by_mode[baseline]
                why = refuse(ours, theirs)
                pairs.append(
                    {
                        "offered_per_s": rate,
                        "baseline": baseline,
                        "ratios": ratios(ours, theirs) if why is None else dict.fromkeys(RATIOS),
                        "intervals": ratio_intervals(ours, theirs) if why is None else {},
                        "refused": why,
                    }
                )
    return pairs


def ratio_intervals(pipeline: dict[str, Any], baseline: dict[str, Any], seed: int = 0) -> dict[str, list[float]]:
    """How far each latency ratio could move with the luck of which jobs came out slow: a percentile bootstrap.

    Each run's answered latencies are drawn again with replacement (`DRAWS` times, the same count as it has), the
    quantile taken as `percentile` takes it, and the ratio of the two draws' quantiles kept; the interval holds the
    middle `LEVEL` of those ratios. It is the spread of one pair of runs' own sampling, not of the host's drift
    from one run to the next. With 90 jobs a run, p99 is its slowest job or two and the bootstrap of so extreme a
    quantile is crude: the interval says that one such pair cannot settle a p99 goal (`bench.pool` pools runs).
    """
    ours, theirs = (np.asarray(row.get("latencies_s") or [], dtype=float) for row in (pipeline, baseline))
    if not len(ours) or not len(theirs):
        return {}
    rng = np.random.default_rng(seed)
    drawn = [np.sort(rng.choice(values, size=(DRAWS, len(values))), axis=1) for values in (ours, theirs)]
    out = {}
    for key, q in QUANTILES.items():
        a, b = (d[:, min(int(q * d.shape[1]), d.shape[1] - 1)] for d in drawn)
        spread = np.quantile(a / np.maximum(b, 1e-9), [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
        out[key] = [round(float(x), 2) for x in spread]
    return out


def markdown(rows: list[dict[str, Any]], pairs: list[dict[str, Any]]) -> str:
    """The summary table of every run, and the ratio table per offered load (a latency ratio with its interval,
    `ratio_intervals`, where the pair has one)."""
    lines = ["| " + " | ".join(COLUMNS.values()) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(row.get(key)) for key in COLUMNS) + " |" for row in rows]
    heads = " | ".join(f"{k} ({v} is better)" for k, v in RATIOS.items())
    lines += ["", f"| offered jobs/s | pipeline ÷ | {heads} |", "|" + "---|" * (len(RATIOS) + 2)]
    for pair in pairs:
        values = " | ".join(_ratio_cell(pair, k) for k in RATIOS)
        if pair.get("refused"):
            values = f"not compared: {pair['refused']}" + " |" * (len(RATIOS) - 1)
        lines.append(f"| {pair['offered_per_s']} | {pair['baseline']} | {values} |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _ratio_cell(pair: dict[str, Any], key: str) -> str:
    value, interval = pair["ratios"].get(key), (pair.get("intervals") or {}).get(key)
    return _cell(value) if value is None or not interval else f"{value} ({interval[0]} to {interval[1]})"


def plot(rows: list[dict[str, Any]], out: Path, name: str = "") -> list[Path]:
    """Latency CDFs of every mode (per offered load), throughput against offered load, device busy over time;
    `name` (a workload's) prefixes the files."""
    import matplotlib  # heavy: only a run that draws its plots loads it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({row["offered_per_s"] for row in rows})
    prefix = f"{name}-" if name else ""
    paths = [out / f"{prefix}{plot}.png" for plot in ("latency_cdf", "throughput", "device_busy")]
    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        for row in (r for r in rows if r["offered_per_s"] == rate):
            xs = row["latencies_s"]
            shares = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, shares, where="post", label=row["mode"], color=COLOURS.get(row["mode"]))
        ax.set(title=f"offered {rate} jobs/s", xlabel="latency (s)", ylabel="share of answered jobs", xscale="log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, paths[0])
    fig, ax = plt.subplots(figsize=(5, 4))
    for mode in COLOURS:
        points = sorted((r["offered_per_s"], r["throughput_per_s"]) for r in rows if r["mode"] == mode)
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=mode, color=COLOURS[mode])
    ax.plot(rates, rates, linestyle=":", color="grey", label="offered")
    ax.set(xlabel="offered load (jobs/s)", ylabel="served (jobs/s)", title="throughput vs offered load")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, paths[1])
    top = [r for r in rows if r["offered_per_s"] == rates[-1]]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for row in top:
        if row["busy_over_time"]:
            ax.plot(*zip(*row["busy_over_time"], strict=True), label=row["mode"], color=COLOURS.get(row["mode"]))
    ax.set(xlabel="seconds into the run", ylabel="device busy (2 s window)", ylim=(0, 1.05))
    ax.set_title(f"device busy over time at {rates[-1]} jobs/s offered")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, paths[2])
    return paths


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
