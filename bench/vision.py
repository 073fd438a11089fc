"""The vision encoder with and without the vision-embeddings cache, on the tiny VLM (or any SmolVLM / Idefics3).

    .venv/bin/python -m bench.vision [--jobs 20] [--repeat 0.4] [--tokens 2] [--model DIR] [--device cpu]

In one process, as the inference worker runs it (`VisionLanguagePredictor`, one job a batch): the pictures are
prepared first by the model's image processor (the CPU workers' part, not timed), then

1. the vision encoder's time for one picture on a miss (encoder and connector) and on a hit (this worker's memory;
   the shared store in Redis, read and decoded), in milliseconds of the device's clock (below);
2. a workload of `--jobs` image jobs where a `--repeat` share show a picture an earlier job showed, run twice,
   cache off and cache on: the device's time (everything the inference worker does per batch: on a CPU, this
   process's CPU seconds, which other work on the machine does not stretch), the encoder's part of it, and the
   encoder's share.

The shared store is Redis database 5 of STOKER_BENCH_REDIS (default redis://127.0.0.1:6379), flushed first. Prints
a markdown table and writes it as JSON to bench/results/vision.json.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from stoker.adapters.backends.tinyvlm import tiny_vlm_path
from stoker.adapters.backends.vision import ImagePreparer, PreparedImage
from stoker.adapters.backends.vlm import VisionLanguagePredictor
from stoker.adapters.embeddings import EmbeddingCache, SharedEmbeddings
from stoker.core.imaging import DecodeParams, decode_rgb
from stoker.core.model import GenerationParams, ModelRequest, run_predictor
from stoker.settings import BenchSettings, CommonSettings

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["shoe", "red", "size", "42", "invoice", "total", "blue", "order", "sale", "price"]


def pictures(jobs: int, repeat: float, seed: int = 11) -> list[bytes]:
    """Deterministic pictures of text: `round(jobs × repeat)` of them byte-identical repeats of earlier ones, spread
    through the workload."""
    from PIL import Image, ImageDraw, ImageFont

    rng = random.Random(seed)
    repeats = set(rng.sample(range(1, jobs), min(round(jobs * repeat), jobs - 1)))
    made: list[bytes] = []
    for n in range(jobs):
        if n in repeats:
            made.append(rng.choice(made))
            continue
        image = Image.new("RGB", (800, 200), "white")
        text = f"{n} " + " ".join(rng.choices(WORDS, k=4))
        ImageDraw.Draw(image).text((20, 60), text, fill="black", font=ImageFont.load_default(size=48))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        made.append(buffer.getvalue())
    return made


class Prepared:
    """The CPU workers' part, done once: each picture's tensors by its content hash."""

    def __init__(self, preparer: ImagePreparer, processor: Any, images: list[bytes]) -> None:
        import blake3

        self.tensors: dict[str, bytes] = {}
        self.ids: dict[str, list[int]] = {}
        self.order: list[str] = []
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
            add_generation_prompt=True,
        )
        for data in images:
            digest = blake3.blake3(data).hexdigest()
            self.order.append(digest)
            if digest not in self.tensors:
                rgb = decode_rgb(data, DecodeParams())
                self.tensors[digest] = preparer.prepare(rgb).to_bytes()
                self.ids[digest] = list(processor(text=prompt, images=[rgb])["input_ids"][0])

    def __call__(self, digest: str, scope: str) -> PreparedImage | None:
        raw = self.tensors.get(digest)
        return PreparedImage.from_bytes(raw) if raw is not None else None


#: The device's clock: on a CPU, this process's CPU seconds (other work on the machine stretches wall time, not
#: these); on a GPU, wall time (`--device cuda` synchronises around each measured part).
CLOCK = {"cpu": time.process_time}


def clock(device: str) -> Any:
    """The clock that measures device time on this device."""
    return CLOCK.get(device, time.perf_counter)


class Timed:
    """A predictor's encoder, timed: seconds spent in it."""

    def __init__(self, predictor: VisionLanguagePredictor) -> None:
        self.seconds = 0.0
        encoder = predictor.encoder
        run = encoder.encode
        now = clock(encoder.device)

        def encode(prepared: PreparedImage) -> Any:
            started = now()
            try:
                return _synced(run(prepared), encoder.device)
            finally:
                self.seconds += now() - started

        encoder.encode = encode  # type: ignore[method-assign]


def run_workload(predictor: VisionLanguagePredictor, prepared: Prepared, tokens: int) -> dict[str, float]:
    """Every job, one a batch: device seconds, the encoder's part, and pictures encoded."""
    timed = Timed(predictor)
    calls = predictor.encoder.calls
    now = clock(predictor.encoder.device)
    started = now()
    for digest in prepared.order:
        request = ModelRequest(prepared.ids[digest], images=[digest], params=GenerationParams(max_tokens=tokens))
        run_predictor(predictor, [request])
    device = now() - started
    return {
        "device_s": round(device, 3),
        "encoder_s": round(timed.seconds, 3),
        "encoder_share": round(timed.seconds / device, 4),
        "encoded": predictor.encoder.calls - calls,
    }


def _synced(result: Any, device: str) -> Any:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    return result


def per_picture(predictor: VisionLanguagePredictor, prepared: Prepared, shared: SharedEmbeddings) -> dict[str, float]:
    """Milliseconds for one picture's embeddings: a miss, a hit in memory, a hit in the shared store."""
    encoder = predictor.encoder
    identity = uuid.uuid4().hex
    now = clock(encoder.device)
    timings: dict[str, list[float]] = {"miss_ms": [], "hit_local_ms": [], "hit_shared_ms": []}
    for digest in list(prepared.tensors)[:5]:
        encoder.cache = EmbeddingCache(identity, local_bytes=64 * 1024**2, shared=shared)
        for name in ("miss_ms", "hit_local_ms"):
            started = now()
            _synced(encoder.embeddings(digest, ""), encoder.device)
            timings[name].append((now() - started) * 1000)
        encoder.cache = EmbeddingCache(identity, local_bytes=0, shared=shared)  # a restarted worker
        started = now()
        _synced(encoder.embeddings(digest, ""), encoder.device)
        timings["hit_shared_ms"].append((now() - started) * 1000)
    return {name: round(statistics.median(values), 2) for name, values in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--repeat", type=float, default=0.4)
    parser.add_argument("--tokens", type=int, default=2, help="new tokens per answer")
    parser.add_argument("--model", default=str(tiny_vlm_path(CommonSettings().model_cache)))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    from transformers import AutoProcessor

    client = redis.Redis.from_url(f"{BenchSettings().bench_redis}/5")
    client.flushdb()
    shared = SharedEmbeddings(client, max_bytes=1024**3, ttl_s=3600)
    preparer = ImagePreparer.load(args.model)
    assert preparer is not None, f"{args.model} reads no images"
    prepared = Prepared(preparer, AutoProcessor.from_pretrained(args.model), pictures(args.jobs, args.repeat))
    identity = uuid.uuid4().hex
    # the cache is set on the encoder for each run below
    predictor = VisionLanguagePredictor(args.model, prepared=prepared, caches=_none, max_new_tokens=args.tokens)
    predictor.setup(args.device)
    run_predictor(predictor, [ModelRequest(prepared.ids[prepared.order[0]], images=[prepared.order[0]])])  # warm-up
    results: dict[str, Any] = {"jobs": args.jobs, "repeat": args.repeat, "distinct": len(prepared.tensors)}
    predictor.encoder.cache = None
    results["cache_off"] = run_workload(predictor, prepared, args.tokens)
    predictor.encoder.cache = EmbeddingCache(identity, local_bytes=256 * 1024**2, shared=shared)
    results["cache_on"] = run_workload(predictor, prepared, args.tokens)
    results["per_picture"] = per_picture(predictor, prepared, shared)
    off, on = results["cache_off"], results["cache_on"]
    results["share_fall"] = round(1 - on["encoder_share"] / off["encoder_share"], 3)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "vision.json").write_text(json.dumps(results, indent=2))
    print(report(results))


def _none(identity: str) -> EmbeddingCache | None:
    return None


def report(results: dict[str, Any]) -> str:
    """The results as markdown."""
    p = results["per_picture"]
    lines = [
        f"{results['jobs']} image jobs, {results['distinct']} distinct pictures ({results['repeat']:.0%} repeats)",
        "",
        "| per picture | miss (encoder) | hit (memory) | hit (shared store) |",
        "| --- | ---: | ---: | ---: |",
        f"| ms | {p['miss_ms']} | {p['hit_local_ms']} | {p['hit_shared_ms']} |",
        "",
        "| cache | pictures encoded | device s | encoder s | encoder share |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in ("cache_off", "cache_on"):
        r = results[name]
        lines.append(
            f"| {name.split('_')[1]} | {r['encoded']} | {r['device_s']} | {r['encoder_s']} | {r['encoder_share']:.1%} |"
        )
    lines.append(f"\nThe encoder's share fell by {results['share_fall']:.0%} with the cache on.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
