"""The benchmark's pure parts: the workload is deterministic and has the asked-for mix; the report's arithmetic."""

from __future__ import annotations

import contextlib
import itertools
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench import harness
from bench.costpair import Tally
from bench.costpair import markdown as pair_table
from bench.drive import Outcome, Run, Sample
from bench.harness import Regime, parser, regime, shortfalls, with_defaults
from bench.pool import pool
from bench.report import busy_series, compare, markdown, percentile, ratio_intervals, ratios, refusal, summarise
from bench.workload import WorkloadSpec, describe, generate

SMALL = WorkloadSpec(jobs=60, rate=2.0, seed=3, sizes=(((640, 480), 0.5), ((800, 600), 0.5)), bad=0.05)


def test_the_same_seed_gives_the_same_requests_and_another_seed_does_not() -> None:
    first, again, other = generate(SMALL), generate(SMALL), generate(replace(SMALL, seed=4))
    key = [(r.at, r.kind, r.prompt, r.media.data if r.media else None) for r in first]
    assert key == [(r.at, r.kind, r.prompt, r.media.data if r.media else None) for r in again]
    assert key != [(r.at, r.kind, r.prompt, r.media.data if r.media else None) for r in other]


def test_the_workload_mixes_kinds_repeats_and_bad_inputs() -> None:
    requests = generate(SMALL)
    counts = describe(requests)
    assert {"text", "image", "audio", "repeat", "bad"} <= set(counts)
    repeats = [r for r in requests if r.repeat]
    assert all(any(e.media == r.media for e in requests[: r.n]) for r in repeats)  # a repeat repeats earlier bytes
    assert all(r.media.label in ("corrupt", "bomb") for r in requests if r.bad and r.media)
    gaps = [b.at - a.at for a, b in itertools.pairwise(requests)]
    assert 0.3 < sum(gaps) / len(gaps) < 0.8  # Poisson arrivals at 2/s: mean gap about 0.5 s


def test_percentiles_and_ratios() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 3.0
    assert percentile([], 0.99) is None
    assert ratios({"throughput_per_s": 3.0, "p50_s": 1.0}, {"throughput_per_s": 2.0, "p50_s": 4.0})["p50_s"] == 0.25


def test_runs_that_left_jobs_unanswered_or_either_design_burning_cpu_are_not_compared() -> None:
    pipeline = {"mode": "pipeline", "jobs": 36, "unanswered": 0, "cpu_s_per_job": 0.63}
    fair = {"mode": "sync-pool", "jobs": 36, "unanswered": 0, "cpu_s_per_job": 0.7}
    assert refusal(pipeline, fair) is None
    lost = refusal(pipeline, {**fair, "unanswered": 13})
    assert lost == "sync-pool left 13 of 36 jobs unanswered"
    burning = refusal(pipeline, {**fair, "cpu_s_per_job": 4.5})
    assert burning is not None
    assert "sync-pool spent 4.5 CPU s per job, 7.1x pipeline's 0.63" in burning
    slowed = refusal({**pipeline, "cpu_s_per_job": 1.4}, fair)  # the pipeline's run, on a host slowed meanwhile
    assert slowed is not None
    assert "pipeline spent 1.4 CPU s per job, 2.0x sync-pool's 0.7" in slowed
    table = markdown([pipeline], [{"offered_per_s": 3.0, "baseline": "sync", "ratios": {}, "refused": lost}])
    assert "| 3.0 | sync | not compared: sync-pool left 13 of 36 jobs unanswered |" in table


def test_busy_series_is_the_busy_share_of_a_trailing_window() -> None:
    samples = [Sample(at=10 + t, busy_s=0.5 * t, depths={}) for t in range(6)]
    assert busy_series(samples, start=10)[-1] == (5.0, 0.5)


def test_summarise_counts_what_the_clients_saw() -> None:
    requests = generate(replace(SMALL, jobs=4, bad=0.0))
    run = Run(started=100.0, ended=104.0)
    for i, r in enumerate(requests):
        status = "failed" if i == 3 else "succeeded"
        job = {"status": status, "inputs": [{"cache_hit": {"decode": i == 1}}], "batch": {"id": "b", "size": 3}}
        run.outcomes.append(Outcome(r, first_try=100.0 + i, refusals=i % 2, job=job, done_at=101.0 + 2 * i))
    run.samples = [Sample(100.0, 0.0, {}), Sample(107.0, 3.5, {})]
    row = summarise("pipeline", 1.0, run)
    assert (row["succeeded"], row["failed"], row["refused_429"]) == (3, 1, 2)
    assert row["throughput_per_s"] == round(3 / 7, 3)  # answered jobs over first arrival → last answer
    assert row["device_busy"] == 0.5
    assert row["p50_s"] == 2.0
    assert row["mean_batch"] == 3
    assert row["cache_hit_rate"] == 0.25
    assert "| pipeline |" in markdown([row], [])
    # The tail named: answered jobs, slowest first (latencies 3, 2, 1 s; the failed one's 4 s is not an answer).
    assert [(j["n"], j["latency_s"]) for j in row["slowest"]] == [
        (requests[2].n, 3.0),
        (requests[1].n, 2.0),
        (requests[0].n, 1.0),
    ]


def test_cpu_per_job_counts_the_run_not_what_starting_the_workers_cost() -> None:
    requests = generate(replace(SMALL, jobs=4, bad=0.0))
    run = Run(started=100.0, ended=104.0, cpu_before_s=9.0)  # three processes' start-up: 9 CPU s before any job
    for i, r in enumerate(requests):
        job = {"status": "succeeded", "inputs": [], "batch": {"id": "b", "size": 1}}
        run.outcomes.append(Outcome(r, first_try=100.0 + i, job=job, done_at=101.0 + i))
    run.samples = [Sample(100.0, 0.0, {}, cpu_s=9.0), Sample(106.0, 3.0, {}, cpu_s=11.0)]
    assert summarise("sync-pool", 1.0, run)["cpu_s_per_job"] == 0.5  # 2 CPU s for 4 jobs


def test_batchfill_drives_both_phases_with_the_same_arrivals_and_new_prompts() -> None:
    """The ratio with ÷ without compares the same traffic: one schedule for both phases, prompts never shared."""
    from bench.batchfill import interactive

    alone, beside = interactive(16.7, 30, 11, "alone"), interactive(16.7, 30, 11, "beside")
    assert len(alone) > 400
    assert [r.at for r in alone] == [r.at for r in beside]
    assert not {r.prompt for r in alone} & {r.prompt for r in beside}


def test_the_line_policy_model_has_lines_cost_interactive_requests_a_wait() -> None:
    """The model of the consumer's policy: lines in the device's gaps make interactive requests wait longer, the
    more so the more lines a batch holds."""
    from bench.linepolicy import latencies
    from bench.report import percentile

    cost = (0.04, 0.025)
    medians = [percentile(latencies(n, 16.7, 300, cost, 8, 11)[0], 0.5) for n in (0, 1, 8)]
    low, mid, high = medians
    assert low is not None
    assert mid is not None
    assert high is not None
    assert low < mid < high


def _row(mode: str, latencies: list[float], rate: float = 2.0, **extra: Any) -> dict[str, Any]:
    """A run's summary row as `summarise` writes it, for the parts the comparison reads."""
    ordered = sorted(latencies)
    return {
        "mode": mode,
        "workload": "cpu-bound",
        "offered_per_s": rate,
        "jobs": len(ordered),
        "throughput_per_s": rate,
        "p50_s": percentile(ordered, 0.5),
        "p95_s": percentile(ordered, 0.95),
        "p99_s": percentile(ordered, 0.99),
        "device_busy": 0.5,
        "cpu_s_per_job": 0.5,
        "succeeded": len(ordered),
        "degraded": 0,
        "unanswered": 0,
        "latencies_s": ordered,
        **extra,
    }


def test_a_latency_ratios_interval_is_wide_where_one_job_decides_it_and_narrow_where_many_do() -> None:
    rng = random.Random(5)
    ours = [rng.uniform(0.9, 1.1) for _ in range(89)] + [6.0]  # one slow job: the run's p99
    theirs = [rng.uniform(1.8, 2.2) for _ in range(90)]
    spread = ratio_intervals(_row("pipeline", ours), _row("sync-pool", theirs))
    p50_low, p50_high = spread["p50_s"]
    assert 0.45 < p50_low < 0.5 < p50_high < 0.55  # ninety jobs decide a median: about 1 / 2
    p99_low, p99_high = spread["p99_s"]
    assert p99_low < 0.6
    assert p99_high > 2.5
    assert ratio_intervals(_row("pipeline", ours), _row("sync-pool", theirs)) == spread  # seeded: the same again
    assert ratio_intervals(_row("pipeline", []), _row("sync-pool", theirs)) == {}


def test_the_comparison_gives_each_latency_ratio_its_interval_and_a_refused_pair_none() -> None:
    ours, theirs = _row("pipeline", [1.0] * 50 + [1.2] * 50), _row("sync-pool", [2.0] * 100)
    (pair,) = compare([ours, theirs], ["sync-pool"])
    assert pair["ratios"]["p50_s"] == 0.6
    assert pair["intervals"]["p50_s"] == [0.5, 0.6]
    assert "| 2.0 | sync-pool | 1.0 | 0.6 (0.5 to 0.6) |" in markdown([ours, theirs], [pair])
    (refused,) = compare([ours, {**theirs, "unanswered": 3}], ["sync-pool"])
    assert refused["intervals"] == {}
    assert refused["refused"] == "sync-pool left 3 of 100 jobs unanswered"


def test_pooled_runs_read_their_percentiles_from_every_runs_jobs_together() -> None:
    first = {"runs": [_row("pipeline", [1.0] * 99 + [9.0]), _row("sync-pool", [2.0] * 100)]}
    second = {"runs": [_row("pipeline", [1.0] * 100), _row("sync-pool", [2.0] * 99 + [3.0])]}
    out = pool([first, second])
    rows = {row["mode"]: row for row in out["rows"]}
    assert (rows["pipeline"]["jobs"], rows["pipeline"]["runs"]) == (200, 2)
    assert rows["pipeline"]["p99_s"] == 1.0  # its 9 s job is 1 of 200: above the 99th percentile, not it
    assert rows["sync-pool"]["p99_s"] == 2.0
    (pair,) = out["pairs"]
    assert pair["ratios"]["p99_s"] == 0.5
    assert pair["refused"] is None


def test_pooled_runs_are_refused_when_any_one_of_them_would_have_been() -> None:
    first = {"runs": [_row("pipeline", [1.0] * 100), _row("sync-pool", [2.0] * 100)]}
    burning = {"runs": [_row("pipeline", [1.0] * 100), _row("sync-pool", [2.0] * 100, cpu_s_per_job=0.8)]}
    out = pool([first, burning])
    assert refusal(*out["rows"]) is None  # pooled, the baseline's CPU per job (0.65) passes
    (pair,) = out["pairs"]
    assert pair["refused"] is not None
    assert "1.6x pipeline's 0.5" in pair["refused"]
    assert pair["ratios"]["p50_s"] is None
    assert pair["intervals"] == {}


def test_a_paired_cost_run_sums_every_burst_before_it_divides_by_the_jobs() -> None:
    before, after = Tally(), Tally()
    before.add({"API": 0.010, "Valkey": 0.002}, sleeps=50, jobs=4)
    before.add({"API": 0.020, "inference worker": 0.004}, sleeps=30, jobs=6)
    after.add({"API": 0.015}, sleeps=20, jobs=10)
    # every burst's CPU and sleeps summed, then divided by all their jobs: not the mean of the bursts' own means
    expected = {"API": 3.0, "Valkey": 0.2, "inference worker": 0.4, "stack": 3.6, "sleeps": 8.0}
    assert before.per_job() == pytest.approx(expected)
    table = pair_table({"text": {"before": before, "after": after}}, "abc123")
    assert "| text | 3.00 → 1.50 | 0.40 → 0.00 | 0.20 → 0.00 | 3.60 → 1.50 | 8.0 → 2.0 | 10 / 10 |" in table


def _regime(name: str, *argv: str) -> Regime:
    return regime(with_defaults(parser().parse_args(argv)), name)


def test_each_regime_has_its_own_device_loads_and_queue_limit_unless_told() -> None:
    """The device-bound regime runs on a device whose batches cost mostly the same whatever they hold, long enough
    at its highest load for a pool of synchronous workers to settle; its queues admit five of its batches."""
    cpu, device = _regime("cpu-bound"), _regime("device-bound")
    assert (cpu.device.base_ms, cpu.device.per_item_ms, cpu.device.batch) == (300.0, 40.0, 8)
    assert (cpu.device.steps, device.device.steps, _regime("cpu-bound", "--sim-steps", "0").device.steps) == (30, 30, 0)
    assert cpu.device.env()["STOKER_SIM_STEPS"] == "30"
    assert (cpu.rates, cpu.spec.jobs, cpu.queue_limit) == ([1.0, 2.0, 3.0, 4.0], 90, 40)
    assert (device.device.base_ms, device.device.per_item_ms, device.device.batch) == (300.0, 5.0, 32)
    assert (device.rates, device.spec.jobs, device.queue_limit) == ([32.0, 64.0, 96.0], 960, 160)
    assert (device.spec.text, device.spec.repeat) == (0.7, 0.9)  # its workload: mostly text, repeated media
    told = _regime("device-bound", "--batch", "8", "--sim-per-item-ms", "40", "--rates", "12", "--jobs", "100")
    assert (told.device.per_item_ms, told.device.batch, told.rates, told.spec.jobs) == (40.0, 8, [12.0], 100)
    assert told.queue_limit == 40
    assert _regime("device-bound", "--queue-limit", "64").queue_limit == 64
    quick = _regime("device-bound", "--quick")
    assert (quick.rates, quick.spec.jobs) == ([64.0], 640)


def _summary(mode: str, unanswered: int = 0, answered: int = 4, cpu_s: float = 2.0) -> dict[str, Any]:
    """A run's summary as `summarise` makes it: `answered` jobs succeeded, `unanswered` never got a job."""
    requests = generate(replace(SMALL, jobs=answered + unanswered, bad=0.0, text=1.0))
    run = Run(started=100.0, ended=110.0)
    for i, r in enumerate(requests):
        job = {"status": "succeeded", "inputs": [], "batch": {"id": "b", "size": 1}} if i < answered else None
        run.outcomes.append(Outcome(r, first_try=100.0 + i, job=job, done_at=101.0 + i if job else None))
    run.samples = [Sample(100.0, 0.0, {}, cpu_s=0.0), Sample(110.0, 5.0, {}, cpu_s=cpu_s)]
    return summarise(mode, 3.0, run)


def test_a_quick_run_fails_for_jobs_left_unanswered_or_a_refused_comparison() -> None:
    """`make bench-quick` is CI's check that the harness drives every mode: one answered job is not enough."""
    fine = [_summary("pipeline"), _summary("sync"), _summary("sync-pool")]
    assert shortfalls(fine, compare(fine), strict=True) == []
    lost = [_summary("pipeline"), _summary("sync", unanswered=3), _summary("sync-pool")]
    assert shortfalls(lost, compare(lost), strict=True) == [
        "sync at 3.0 jobs/s left 3 of 7 jobs unanswered",
        "pipeline vs sync at 3.0 jobs/s not compared: sync left 3 of 7 jobs unanswered",
    ]
    burning = [_summary("pipeline"), _summary("sync"), _summary("sync-pool", cpu_s=8.0)]  # 2.0 CPU s a job against 0.5
    (refused,) = shortfalls(burning, compare(burning), strict=True)
    assert refused.startswith("pipeline vs sync-pool at 3.0 jobs/s not compared: sync-pool spent 2.0 CPU s per job")
    # A full sweep reports such loads ("not compared") and fails only for a run that answered nothing.
    assert shortfalls(lost, compare(lost), strict=False) == []
    dead = [_summary("pipeline", unanswered=5, answered=0), _summary("sync")]
    assert shortfalls(dead, compare(dead), strict=False) == ["pipeline at 3.0 jobs/s answered no job"]


def test_bench_quick_exits_non_zero_when_a_mode_leaves_jobs_unanswered(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`stoker bench --quick` as `make bench-quick` runs it, its stacks replaced by the runs they would have made."""
    outcomes = {"pipeline": 0, "sync": 2, "sync-pool": 0}  # jobs each mode leaves unanswered
    monkeypatch.setattr(harness, "bench_redis", lambda: contextlib.nullcontext("redis://127.0.0.1:1"))
    monkeypatch.setattr(harness, "generate", lambda spec: [])
    monkeypatch.setattr(harness, "plot", lambda rows, out, name="": [])
    monkeypatch.setattr(
        harness, "_runs", lambda args, regime, modes, workload, base: [_summary(m, outcomes[m]) for m in modes]
    )
    argv = ["--quick", "--overhead-jobs", "0", "--out", str(tmp_path)]
    assert harness.main(argv) == 1
    assert "not compared: sync left 2 of 6 jobs unanswered" in (tmp_path / "results.md").read_text()
    outcomes["sync"] = 0
    assert harness.main(argv) == 0
    outcomes["sync"] = 2
    assert harness.main([*argv[1:], "--rates", "3"]) == 0  # not --quick: a load a baseline collapses under is reported
