"""Image jobs at saturation: stoker's pipeline against the model's processor and model run in one process.

    .venv/bin/python -m bench.visionsat [--jobs 12] [--repeat 0.4] [--tokens 4] [--model DIR]

The same pictures (bench.vision's pictures of text, `--repeat` of them byte-identical repeats) and the same prompt
go through both, all at once, so work always waits:

- **in one process**, as a user of transformers would write it: for each picture, decode it, run the model's
  `AutoProcessor` on it and the prompt, then `generate` (greedy, `--tokens` new tokens); one job at a time;
- **the pipeline**: a stoker stack (API, CPU worker, inference worker and reaper, `STOKER_MODEL` the same model)
  takes every job over HTTP at once; the CPU workers prepare each picture with the model's image processor, the
  inference worker runs them in batches, encoding each distinct picture once.

Reported for each: jobs per second (all jobs over the wall time from the first submission to the last answer),
CPU seconds per job (the in-process run's own; the stack's over all its processes, from /proc), and
device busy (the share of the wall time the model ran: `generate`'s time in one process, the inference worker's
batch seconds in the pipeline). On this machine the "device" is the same two CPU cores the preprocessing runs on.
Writes bench/results/visionsat.json.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cost import tree
from bench.drive import Run, drive
from bench.stack import BenchStack, Device, bench_redis, bench_stack
from bench.vision import pictures
from bench.workload import Media, Request
from stoker.adapters.backends.tinyvlm import tiny_vlm_path
from stoker.settings import CommonSettings

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "What does the picture say?"


def in_one_process(model_dir: str, images: list[bytes], tokens: int) -> dict[str, Any]:
    """Each picture through the model's processor and `generate`, one after another, as a user would write it."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True)
    cpu, wall, generating = time.process_time(), time.perf_counter(), 0.0
    for data in images:
        picture = Image.open(io.BytesIO(data)).convert("RGB")
        inputs = processor(text=prompt, images=[picture], return_tensors="pt")
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
        generating += time.perf_counter() - started
    wall = time.perf_counter() - wall
    return _figures(len(images), wall, time.process_time() - cpu, generating)


def through_pipeline(model_dir: str, images: list[bytes], tokens: int) -> dict[str, Any]:
    """Every job submitted at once to a pipeline stack serving the model; answers awaited."""
    requests = [Request(n, 0.0, "image", PROMPT, Media("image", data, "800x200 text")) for n, data in enumerate(images)]
    device = Device("transformers", batch=4)
    settings = {"STOKER_MODEL": model_dir, "STOKER_MAX_NEW_TOKENS": str(tokens), "STOKER_MAX_TOKENS_CAP": str(tokens)}
    with (
        tempfile.TemporaryDirectory(prefix="stoker-visionsat-") as scratch,
        bench_redis() as redis_base,
        bench_stack("pipeline", device, redis_base, Path(scratch) / "logs", **settings) as stack,
    ):
        cpu = stack_cpu(stack)
        run = drive(stack.base, requests, give_up_s=1800)
        cpu = stack_cpu(stack) - cpu
    return _pipeline_figures(run, cpu)


def stack_cpu(stack: BenchStack) -> float:
    """CPU seconds every process of the stack spent so far (API, workers and their children, reaper; /proc)."""
    return sum(proc.cpu_s for root in stack.procs for proc in tree(root.pid))


def _pipeline_figures(run: Run, cpu_s: float) -> dict[str, Any]:
    answered = [o for o in run.outcomes if o.job is not None and o.job.get("status") == "succeeded"]
    if len(answered) != len(run.outcomes):
        others = [(o.error, o.job and o.job.get("status"), o.job and o.job.get("error")) for o in run.outcomes]
        others = [o for o in others if o[1] != "succeeded"]
        raise SystemExit(f"{len(others)} of {len(run.outcomes)} jobs did not succeed: {others[:3]}")
    done = max(o.done_at or 0.0 for o in answered)
    first, last = run.samples[0], run.samples[-1]
    figures = _figures(len(answered), done - run.started, cpu_s, last.busy_s - first.busy_s)
    encoder = [i.get("encoder") for o in answered for i in (o.job or {}).get("inputs", [])]
    figures["encoder_misses"] = encoder.count("miss")
    return figures


def _figures(jobs: int, wall_s: float, cpu_s: float, device_s: float) -> dict[str, Any]:
    return {
        "jobs": jobs,
        "wall_s": round(wall_s, 2),
        "jobs_per_s": round(jobs / wall_s, 3),
        "cpu_s_per_job": round(cpu_s / jobs, 2),
        "device_busy": round(device_s / wall_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    """Both runs, one after the other; the table."""
    args = argparse.ArgumentParser(prog="python -m bench.visionsat", description=__doc__.split("\n\n")[0])
    args.add_argument("--jobs", type=int, default=12)
    args.add_argument("--repeat", type=float, default=0.4, help="share of pictures that repeat an earlier one")
    args.add_argument("--tokens", type=int, default=4, help="new tokens per answer")
    args.add_argument("--model", default=str(tiny_vlm_path(CommonSettings().model_cache)))
    opts = args.parse_args(argv)
    images = pictures(opts.jobs, opts.repeat)
    results = {
        "jobs": opts.jobs,
        "distinct_pictures": len(set(images)),
        "tokens": opts.tokens,
        "in_one_process": in_one_process(opts.model, images, opts.tokens),
        "pipeline": through_pipeline(opts.model, images, opts.tokens),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "visionsat.json").write_text(json.dumps(results, indent=2) + "\n")
    print("| | jobs/s | CPU s/job | device busy |\n|---|---|---|---|")
    for name in ("in_one_process", "pipeline"):
        r = results[name]
        print(f"| {name.replace('_', ' ')} | {r['jobs_per_s']} | {r['cpu_s_per_job']} | {r['device_busy']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
