"""The largest page's latency, OCR'd whole vs in bands, measured.

    .venv/bin/python -m bench.bands [--pages 3] [--size 4000x3000]

One pipeline stack per setting (bench/stack.py, the simulated device): bands on (`STOKER_OCR_BAND_MIN_PIXELS` at
its default) and off (0). On each, the benchmark workload's largest dense page is submitted `--pages` times, one
after another on an otherwise idle stack, each page new (another seed: no stage result rides on the cache); the
latency is the client's, from the POST to the answer in hand. A dense page read in bands should finish in about
its OCR CPU time divided by the CPU children free to take its bands; read whole, it holds one child for all of it.

Printed and written to bench/results/bands.json: each setting's latencies, their median, and how long the OCR
stage took by the jobs' own records.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import httpx

from bench.stack import Device, bench_redis, bench_stack
from bench.workload import _page
from stoker.core.jobs import TERMINAL
from stoker.settings import WorkerSettings

RESULTS = Path(__file__).resolve().parent / "results"


def parser() -> argparse.ArgumentParser:
    """The benchmark's options."""
    args = argparse.ArgumentParser(prog="python -m bench.bands", description=__doc__.split("\n\n")[0])
    args.add_argument("--pages", type=int, default=3, help="pages submitted per setting, one after another")
    args.add_argument("--size", default="4000x3000", help="the page's width x height (the workload's largest)")
    args.add_argument("--seed", type=int, default=5)
    return args


def page(width: int, height: int, seed: int) -> bytes:
    """A dense page as the workload makes one, as JPEG."""
    out = io.BytesIO()
    _page(random.Random(seed), width, height).save(out, "JPEG", quality=88)
    return out.getvalue()


def one_page(http: httpx.Client, data: bytes) -> dict[str, Any]:
    """Submit a page and wait for its answer: the client's latency, the job's status and stage timings."""
    started = time.monotonic()
    files = {"image": ("page.jpg", data, "image/jpeg")}
    job = http.post("/v1/jobs", data={"prompt": "What does the page say?"}, files=files).json()
    while job.get("status") not in TERMINAL:
        job = http.get(f"/v1/jobs/{job['id']}", params={"wait": 30}).json()
    return {
        "latency_s": round(time.monotonic() - started, 3),
        "status": job["status"],
        "text_chars": len(next((i.get("text") or "" for i in job.get("inputs", [])), "")),
        "timings_ms": job.get("timings_ms", {}),
    }


def run_setting(name: str, band_min_pixels: int, pages: list[bytes], redis_base: str) -> dict[str, Any]:
    """Every page through a fresh stack with this band threshold, one after another."""
    # The cache stays on: each stack starts on flushed databases and every page is new, so no result rides on it;
    # the pipeline hands the decoded image to OCR and its bands through it (with the cache off, each band would
    # decode the whole page again).
    settings = {"STOKER_OCR_BAND_MIN_PIXELS": str(band_min_pixels)}
    with (
        tempfile.TemporaryDirectory(prefix="stoker-bands-") as scratch,
        bench_stack("pipeline", Device(), redis_base, Path(scratch) / "logs", **settings) as stack,
        httpx.Client(base_url=stack.base, timeout=120) as http,
    ):
        outcomes = [one_page(http, data) for data in pages]
    latencies = [o["latency_s"] for o in outcomes]
    return {"setting": name, "pages": outcomes, "median_s": round(median(latencies), 3), "max_s": max(latencies)}


def main(argv: list[str] | None = None) -> int:
    """Both settings, the same pages, and the report."""
    args = parser().parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))
    with bench_redis() as redis_base:
        results = [
            run_setting(name, threshold, [page(width, height, args.seed + n) for n in range(args.pages)], redis_base)
            for name, threshold in (("bands", WorkerSettings().ocr_band_min_pixels), ("whole", 0))
        ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bands.json").write_text(json.dumps(results, indent=2) + "\n")
    for result in results:
        shown = ", ".join(f"{o['latency_s']:.2f} s ({o['status']}, {o['text_chars']} chars)" for o in result["pages"])
        print(f"{result['setting']:>5}: median {result['median_s']:.2f} s, max {result['max_s']:.2f} s — {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
