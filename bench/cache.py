"""Stage cache on vs off, side by side in one run: CPU seconds per job and preprocessing latency.

    .venv/bin/python -m bench.cache [--jobs 40] [--repeat 0.4] [--concurrency 4]

Starts its own API and workers (once with the cache off, once on) against Redis databases 5-7 of
STOKER_BENCH_REDIS (default redis://127.0.0.1:6379), submits the same deterministic workload to each, and prints
a markdown table (also written as JSON to bench/results/cache.json). Inference is cut to one token: this measures
preprocessing, not the model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import redis
from PIL import Image, ImageDraw, ImageFont

from bench.stack import wait_ready
from stoker.settings import BenchSettings
from workers.broker import free_port
from workers.procs import spawn, terminate

ROOT = Path(__file__).resolve().parent.parent
WORDS = [
    "invoice", "total", "amount", "due", "date", "order", "customer",
    "account", "number", "payment", "reference", "tax", "net", "gross",
]  # fmt: skip


def workload(jobs: int, repeat: float, seed: int = 7) -> list[bytes]:
    """Deterministic images of dense text; a `repeat` share are byte-identical repeats of earlier ones."""
    rng = random.Random(seed)
    images: list[bytes] = []
    for n in range(jobs):
        if images and rng.random() < repeat:
            images.append(rng.choice(images))
            continue
        image = Image.new("RGB", (1024, 768), "white")
        draw = ImageDraw.Draw(image)
        font = ImageFont.load_default(size=28)
        for line in range(14):
            text = " ".join(rng.choice(WORDS) for _ in range(6)) + f" {rng.randint(100, 99999)}"
            draw.text((30, 30 + line * 50), text, fill="black", font=font)
        path = ROOT / "bench" / "results" / f".img{n}.png"
        image.save(path)
        images.append(path.read_bytes())
        path.unlink()
    return images


def run_phase(cache_on: bool, images: list[bytes], concurrency: int, redis_base: str) -> dict[str, Any]:
    """Start API and workers with the cache on or off, push the workload through, collect per-job facts."""
    dbs = {"STOKER_BROKER_URL": f"{redis_base}/5", "STOKER_RESULT_URL": f"{redis_base}/6"}
    dbs["STOKER_CACHE_URL"] = f"{redis_base}/7"
    for url in dbs.values():
        with redis.Redis.from_url(url) as client:
            client.flushdb()
    port = free_port()
    env = {**os.environ, **dbs, "STOKER_CACHE_ENABLED": str(cache_on).lower(), "STOKER_MAX_NEW_TOKENS": "1"}
    env["STOKER_AUTH"] = "off"  # one client, no keys: the benchmark measures the cache, not tenancy
    logs = Path(tempfile.mkdtemp(prefix="stoker-bench-cache-"))
    commands = {"api": ["api", "--port", str(port)], "cpu": ["worker", "cpu"], "infer": ["worker", "infer"]}
    procs = [spawn(args, env, logs / f"{name}.log") for name, args in commands.items()]
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base)
        time.sleep(5)  # workers connect and preload
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            jobs = list(pool.map(lambda data: _run_job(base, data), images))
        wall = time.perf_counter() - started
    finally:
        terminate(procs, grace_s=30)
    return _summarise(cache_on, jobs, wall)


def _run_job(base: str, data: bytes) -> dict[str, Any]:
    with httpx.Client(base_url=base, timeout=60) as http:
        job: dict[str, Any] = http.post(
            "/v1/jobs", data={"prompt": "Total?"}, files=[("image", ("scan.png", data, "image/png"))]
        ).json()
        while job["status"] not in ("succeeded", "degraded", "failed"):
            job = http.get(f"/v1/jobs/{job['id']}", params={"wait": 30}).json()
        return job


def _summarise(cache_on: bool, jobs: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    cpu = [sum(i["timings_ms"].get(s, 0.0) for i in job["inputs"] for s in ("decode", "ocr")) / 1000 for job in jobs]
    pre = sorted(job["timings_ms"]["preprocess"] for job in jobs)
    hits = sum(1 for job in jobs for i in job["inputs"] if i["cache_hit"].get("ocr"))
    return {
        "cache": "on" if cache_on else "off",
        "jobs": len(jobs),
        "failed": sum(1 for job in jobs if job["status"] != "succeeded"),
        "cpu_s_per_job": round(statistics.mean(cpu), 3),
        "preprocess_p50_ms": round(pre[len(pre) // 2], 1),
        "preprocess_p95_ms": round(pre[int(len(pre) * 0.95) - 1], 1),
        "ocr_hit_rate": round(hits / max(len(jobs), 1), 3),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    """Run both phases and report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--repeat", type=float, default=0.4)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    images = workload(args.jobs, args.repeat)
    redis_base = BenchSettings().bench_redis
    rows = [run_phase(on, images, args.concurrency, redis_base) for on in (False, True)]
    (ROOT / "bench" / "results" / "cache.json").write_text(json.dumps(rows, indent=2))
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    off, on = rows
    print(
        f"\ncache on ÷ off: CPU s/job {on['cpu_s_per_job'] / max(off['cpu_s_per_job'], 1e-9):.2f}, "
        f"preprocess p50 {on['preprocess_p50_ms'] / max(off['preprocess_p50_ms'], 1e-9):.2f}"
    )


if __name__ == "__main__":
    main()
