"""The local model before and after the decode engine, and `transformers serve --continuous-batching`, under the same
load: N concurrent streams, each sending its next chat when the last one's answer ended (a closed loop).

    .venv/bin/python -m bench.engine                              # text, 1 / 4 / 16 streams, before and after
    .venv/bin/python -m bench.engine --pictures                   # the tiny VLM, one picture a chat
    .venv/bin/python -m bench.engine --pictures --picture-size 1280x960   # a photo's 5 tiles a chat
    .venv/bin/python -m bench.engine --peer --streams 1,4,16      # and transformers serve, over HTTP
    .venv/bin/python -m bench.engine --pictures --burst 15 --prefill-chunk 0,512   # 15 joining one running chat

Before and after run stoker's predictor in this process under a consumer loop of the shape of the inference
worker's (the batch is what waits, up to the batch size, with the answers that go on; a call yields to waiting
requests, `STOKER_YIELD_TOKENS`): before, batched `generate` restarted at each yield (every 16 tokens, its prompts
re-read); after, the decode engine (a yield at every step, nothing re-read). Neither the broker nor the store is in
the loop: what is measured is the model's side. The peer is driven over its OpenAI-compatible streaming chat
completions by the same streams. Per run: output tokens/s, time to first token and between tokens (p50, p99), and
for stoker the tokens the model was fed (prompts and answers) and output tokens per CPU second of its process (on
a host whose cores others share, steadier than tokens/s). `--prefill-chunk`: the engine's chunked prefill.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cost import tree
from stoker.adapters.backends.local import TransformersPredictor
from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.backends.tokenizer import PromptTokenizer, load_tokenizer
from stoker.core.model import Continued, GenerationParams, ModelRequest, Prediction, run_predictor
from stoker.core.prompting import build_prompt
from stoker.settings import WorkerSettings

PROMPTS = (
    "Write a long story about a dragon and a castle.",
    "Explain how a bicycle works.",
    "Describe the sea at night.",
    "Give me three ideas for a picnic.",
)


@dataclass
class Timing:
    """One chat as its client saw it: when it was sent, when each piece came, how many tokens it had."""

    sent: float
    pieces: list[float] = field(default_factory=list)
    tokens: int = 0


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summary(timings: list[Timing], wall_s: float) -> dict[str, Any]:
    """Output tokens/s over the run, time to first token and between pieces (p50, p99, ms)."""
    first = [(t.pieces[0] - t.sent) * 1000 for t in timings if t.pieces]
    gaps = [(b - a) * 1000 for t in timings for a, b in zip(t.pieces, t.pieces[1:], strict=False)]
    tokens = sum(t.tokens for t in timings)
    ms = {
        "ttft_p50_ms": _percentile(first, 50),
        "ttft_p99_ms": _percentile(first, 99),
        "itl_p50_ms": _percentile(gaps, 50),
        "itl_p99_ms": _percentile(gaps, 99),
    }
    rounded = {k: round(v, 1) if v is not None else None for k, v in ms.items()}
    return {"chats": len(timings), "tokens": tokens, "tokens_per_s": round(tokens / wall_s, 2), **rounded}


class MiniConsumer:
    """The inference worker's loop around a predictor, without broker or store: a batch of what waits (up to the
    batch size) and the answers that go on, one call after another; waiting chats counted for the call's yields."""

    def __init__(self, predictor: TransformersPredictor, batch_size: int) -> None:
        self.predictor = predictor
        self.batch_size = batch_size
        self.arrived: queue.Queue[tuple[ModelRequest, Callable[[Prediction], None]]] = queue.Queue()
        predictor.yield_to(self.arrived.qsize, batch_size)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        going: list[tuple[ModelRequest, Callable[[Prediction], None]]] = []
        while not self._stop.is_set():
            while len(going) < self.batch_size:
                try:
                    going.append(self.arrived.get(timeout=0.01 if not going else 0))
                except queue.Empty:
                    break
            if not going:
                continue
            outcomes = run_predictor(self.predictor, [r for r, _ in going])
            still = []
            for (request, done), outcome in zip(going, outcomes, strict=True):
                if isinstance(outcome, Continued):
                    still.append((request.continued(outcome), done))
                else:
                    assert isinstance(outcome, Prediction), outcome
                    done(outcome)
            going = still

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()


def run_stoker(
    predictor: TransformersPredictor, requests: list[ModelRequest], streams: int, per: int
) -> dict[str, Any]:
    """`streams` closed-loop clients, each `per` chats, against the predictor under the mini consumer."""
    timings: dict[str, Timing] = {}
    lock = threading.Lock()

    def piece(job: str, text: str) -> None:
        with lock:
            timings[job].pieces.append(time.perf_counter())

    predictor.pieces = piece
    consumer = MiniConsumer(predictor, batch_size=max(streams, 1))
    consumer.thread.start()
    engine = getattr(predictor, "_engine", None)
    fed_before = engine.fed if engine is not None else 0

    def client(stream: int) -> None:
        for k in range(per):
            job = f"{stream}-{k}"
            ended = threading.Event()
            base = requests[(stream + k) % len(requests)]
            with lock:
                timings[job] = Timing(time.perf_counter())

            def done(answer: Prediction, job: str = job, ended: threading.Event = ended) -> None:
                timings[job].tokens = answer.completion_tokens
                ended.set()

            consumer.arrived.put(
                (ModelRequest(base.prompt_ids, images=base.images, params=base.params, stream_to=job), done)
            )
            ended.wait()

    started, cpu = time.perf_counter(), time.process_time()
    clients = [threading.Thread(target=client, args=(s,)) for s in range(streams)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    consumer.stop()
    engine = getattr(predictor, "_engine", None)
    result = summary(list(timings.values()), wall)
    # on a host whose cores others share, the CPU seconds the model's process spent move less than the wall time
    result = _per_cpu(result, cpu)
    if engine is not None:
        result["fed_tokens"] = engine.fed - fed_before
    return result


def run_burst(predictor: TransformersPredictor, requests: list[ModelRequest], joining: int) -> dict[str, Any]:
    """One picture chat running when `joining` more arrive at once, on the decode engine itself: how long the
    running row waits between its tokens while they are read (the longest gap), and until the last of them has
    its first token."""
    from stoker.adapters.backends.engine_rows import EngineRequest

    batch = predictor.batch(requests[:1])  # the picture's embeddings, once: every chat has the same picture
    features = batch.features[0] if hasattr(batch, "features") else ()
    engine = predictor._decode_engine(joining + 1)
    first = requests[0]
    engine.submit(EngineRequest("running", first.prompt_ids, limit=10_000, features=features, images=("p",)))
    engine.step()
    engine.step()
    for k in range(joining):
        request = requests[k % len(requests)]
        engine.submit(EngineRequest(k, request.prompt_ids, limit=1, features=features, images=("p",)))
    started, gaps, last, answered = time.perf_counter(), [], time.perf_counter(), 0
    while answered < joining:  # each ends at its first token, chosen once its prompt is read
        answered += sum(f.key != "running" for f in engine.step())
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    all_joined = time.perf_counter() - started
    engine.cancel("running")
    engine.step()
    return {
        "joining": joining,
        "steps": len(gaps),
        "longest_gap_ms": round(max(gaps) * 1000, 1),
        "all_joined_ms": round(all_joined * 1000, 1),
    }


def text_requests(path: str, max_tokens: int) -> list[ModelRequest]:
    prompts = PromptTokenizer(load_tokenizer(path))
    params = GenerationParams(max_tokens=max_tokens)
    return [ModelRequest(build_prompt(prompts, p, [], 512).ids, params=params) for p in PROMPTS]


def picture_predictor(
    path: Path, size: tuple[int, int] = (1000, 400), **options: Any
) -> tuple[TransformersPredictor, list[ModelRequest]]:
    """The tiny VLM with one prepared picture (no embeddings cache: the encoder runs for each chat, as on a
    worker's first sight of a picture), and chats about it."""
    from PIL import Image, ImageDraw
    from transformers import AutoProcessor

    from stoker.adapters.backends.vision import ImagePreparer
    from stoker.adapters.backends.vlm import VisionLanguagePredictor
    from stoker.core.imaging import DecodeParams, decode_rgb

    preparer = ImagePreparer.load(path)
    assert preparer is not None
    picture = Image.new("RGB", size, "white")
    ImageDraw.Draw(picture).text((40, 150), "HELLO", fill="black")
    encoded = io.BytesIO()
    picture.save(encoded, format="PNG")
    rgb = decode_rgb(encoded.getvalue(), DecodeParams())
    prepared = preparer.prepare(rgb)
    processor = AutoProcessor.from_pretrained(path)
    requests = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        ids = processor(text=text, images=[rgb], return_tensors="pt")["input_ids"][0].tolist()
        requests.append(
            ModelRequest(ids, images=["picture"], params=GenerationParams(max_tokens=options["max_tokens_cap"]))
        )
    predictor = VisionLanguagePredictor(
        str(path), prepared=lambda digest, scope: prepared, caches=lambda identity: None, **options
    )
    return predictor, requests


def _cpu_seconds(pid: int) -> float:
    """The CPU seconds a process and the processes under it have spent: the peer's server runs its model in a
    process of its own."""
    return sum(proc.cpu_s for proc in tree(pid))


def _per_cpu(result: dict[str, Any], cpu: float) -> dict[str, Any]:
    """A run's result with the CPU seconds it took and its output tokens per CPU second."""
    return result | {"cpu_s": round(cpu, 1), "tokens_per_cpu_s": round(result["tokens"] / cpu, 2)}


def run_peer(
    path: str, requests: list[str], streams: int, per: int, max_tokens: int, port: int, pid: int
) -> dict[str, Any]:
    """The same closed loop against `transformers serve --continuous-batching`, over streamed chat completions."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    timings: list[Timing] = []
    lock = threading.Lock()

    def one(stream: int) -> None:
        for k in range(per):
            timing = Timing(time.perf_counter())
            chunks = client.chat.completions.create(
                model=path,
                messages=[{"role": "user", "content": requests[(stream + k) % len(requests)]}],
                max_tokens=max_tokens,
                stream=True,
            )
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    timing.pieces.append(time.perf_counter())
                    timing.tokens += 1
            with lock:
                timings.append(timing)

    started, cpu = time.perf_counter(), _cpu_seconds(pid)
    threads = [threading.Thread(target=one, args=(s,)) for s in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result = summary(timings, time.perf_counter() - started)
    cpu = _cpu_seconds(pid) - cpu
    return _per_cpu(result, cpu)


def start_peer(path: str, port: int, threads: int) -> subprocess.Popen[bytes]:
    """`transformers serve --continuous-batching` on the model, answering once its models list does."""
    import httpx

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else dict(os.environ)
    binary = str(Path(sys.executable).parent / "transformers")
    command = [binary, "serve", path, "--continuous-batching", "--port", str(port)]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(1)
    server.kill()
    raise RuntimeError("transformers serve did not answer")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loaded(
    args: argparse.Namespace, settings: WorkerSettings, options: dict[str, Any]
) -> tuple[TransformersPredictor, list[ModelRequest]]:
    """The predictor the run asks for (the tiny VLM with pictures, else the text model), set up, and its chats:
    made on a thread of its own that ends. The model runs on the consumer's thread, and torch runs a thread's
    parallel operations on an OpenMP team of that thread's own, which stays with it: a team left on the main thread
    by the image processor (run here on the chats' picture) slows every parallel operation of the consumer's thread
    (on a 2-core host, the tiny VLM's 16-row steps 191-208 ms against 149-170 ms). In an inference worker no
    thread but the device thread runs the model's operations, and the pictures are prepared in other processes."""
    with ThreadPoolExecutor(1, thread_name_prefix="bench-load") as apart:
        return apart.submit(_loaded, args, settings, options).result()


def _loaded(
    args: argparse.Namespace, settings: WorkerSettings, options: dict[str, Any]
) -> tuple[TransformersPredictor, list[ModelRequest]]:
    if args.pictures:
        from stoker.adapters.backends.tinyvlm import tiny_vlm_path

        width, height = (int(side) for side in args.picture_size.split("x"))
        predictor, requests = picture_predictor(tiny_vlm_path(settings.model_cache), (width, height), **options)
    else:
        path = str(resolve_model(settings.model, settings.model_cache, fetch=False))
        predictor, requests = TransformersPredictor(path, **options), text_requests(path, args.max_tokens)
    predictor.setup("cpu")
    return predictor, requests


def bursts(args: argparse.Namespace, settings: WorkerSettings) -> list[dict[str, Any]]:
    """`--burst`: chats joining one running chat at once, at each `--prefill-chunk`."""
    results = []
    for chunk in [int(c) for c in args.prefill_chunk.split(",")]:
        options = {"max_new_tokens": args.max_tokens, "max_tokens_cap": args.max_tokens, "prefill_chunk": chunk}
        predictor, requests = loaded(args, settings, options | {"threads": settings.torch_threads})
        run_burst(predictor, requests, 1)  # warm up
        result = {"burst": True, "pictures": args.pictures and args.picture_size, "prefill_chunk": chunk}
        result |= run_burst(predictor, requests, args.burst)
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="1,4,16", help="concurrent streams to run at")
    p.add_argument("--per", type=int, default=2, help="chats per stream")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--pictures", action="store_true", help="the tiny VLM, one picture a chat")
    p.add_argument(
        "--picture-size",
        default="1000x400",
        help="the picture's width x height: 1000x400 is 3 tiles (192 image tokens), 1280x960 a photo's 5 (320)",
    )
    p.add_argument("--peer", action="store_true", help="also transformers serve --continuous-batching (text)")
    p.add_argument("--paths", default="before,after", help="stoker's paths to run")
    p.add_argument("--out", type=Path, help="append each run's JSON line here")
    p.add_argument(
        "--burst",
        type=int,
        default=0,
        help="instead: this many chats joining one running chat at once, on the engine (the running row's longest "
        "wait between tokens while they are read, at each --prefill-chunk given: comma-separated)",
    )
    p.add_argument(
        "--prefill-chunk",
        default=str(WorkerSettings().engine_prefill_chunk),
        help="after: the engine's prompt tokens read at most a step while rows generate (0: whole prompts)",
    )
    args = p.parse_args()
    settings = WorkerSettings()
    results = []
    if args.burst:
        results += bursts(args, settings)
        args.streams = ""
    for streams in [int(s) for s in args.streams.split(",") if s]:
        for name in args.paths.split(","):
            engine = name == "after"
            options = {"max_new_tokens": args.max_tokens, "max_tokens_cap": args.max_tokens, "engine": engine}
            options |= {"yield_tokens": 1 if engine else 16, "threads": settings.torch_threads}
            if engine:
                options["prefill_chunk"] = int(args.prefill_chunk)
            predictor, requests = loaded(args, settings, options)
            run_stoker(predictor, requests[:1], 1, 1)  # warm up: the first call's one-off costs
            result = {"path": name, "pictures": args.pictures and args.picture_size, "streams": streams}
            result |= {"prefill_chunk": int(args.prefill_chunk)} if engine else {}
            result |= run_stoker(predictor, requests, streams, args.per)
            results.append(result)
            print(json.dumps(result), flush=True)
        if args.peer and not args.pictures:
            path = str(resolve_model(settings.model, settings.model_cache, fetch=False))
            port = _free_port()
            server = start_peer(path, port, settings.torch_threads)
            try:
                run_peer(path, list(PROMPTS[:1]), 1, 1, args.max_tokens, port, server.pid)  # warm up
                result = {"path": "transformers serve --continuous-batching", "pictures": False, "streams": streams}
                result |= run_peer(path, list(PROMPTS), streams, args.per, args.max_tokens, port, server.pid)
            finally:
                server.terminate()
                server.wait(30)
            results.append(result)
            print(json.dumps(result), flush=True)
    if args.out is not None:
        with args.out.open("a") as out:
            for result in results:
                out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
