"""How long a chat waits for answers already on the device: streamed chats arrive one after another, short and long
answers mixed, against the real local model, with the consumer's calls yielding between decoding steps
(`STOKER_YIELD_TOKENS`) and without (a call runs until its longest answer ends).

    .venv/bin/python -m bench.joinwait                       # 12 chats, 0.25 s apart, yield every 0 and 16 tokens

Per setting: each chat's time to its first token and to its last, as the client sees them (p50 and the worst, for
the short answers and the long ones), and the time to serve them all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.stack import Device, bench_redis, bench_stack
from stoker.settings import ApiSettings

PROMPT = "Write a long story about a dragon and a castle."


def _chat(base: str, max_tokens: int, out: dict[str, Any]) -> None:
    """One streamed chat: when its first piece and its end came, from when it was sent."""
    body = {
        "model": ApiSettings().public_model_name,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    sent = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - sent
    out.update(max_tokens=max_tokens, first_s=first, total_s=time.perf_counter() - sent)


def run(yield_tokens: int, chats: int, gap_s: float, short: int, long: int) -> dict[str, Any]:
    """One setting: a fresh stack, the chats sent `gap_s` apart (every other one long), their times."""
    with bench_redis() as redis_base, tempfile.TemporaryDirectory() as logs:
        settings = {"STOKER_YIELD_TOKENS": str(yield_tokens), "STOKER_MAX_TOKENS_CAP": str(max(short, long))}
        device = Device(backend="transformers", batch=8)
        with bench_stack("pipeline", device, redis_base, Path(logs), **settings) as stack:
            results: list[dict[str, Any]] = [{} for _ in range(chats)]
            threads = []
            started = time.perf_counter()
            for n in range(chats):
                tokens = long if n % 2 == 0 else short
                thread = threading.Thread(target=_chat, args=(stack.base, tokens, results[n]))
                thread.start()
                threads.append(thread)
                time.sleep(gap_s)
            for thread in threads:
                thread.join()
            elapsed = time.perf_counter() - started
    return {"yield_tokens": yield_tokens, "all_served_s": round(elapsed, 2), **_summary(results, short, long)}


def _summary(results: list[dict[str, Any]], short: int, long: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, tokens in (("short", short), ("long", long)):
        mine = [r for r in results if r["max_tokens"] == tokens]
        for what in ("first_s", "total_s"):
            values = [r[what] for r in mine if r[what] is not None]
            out[f"{name}_{what}_p50"] = round(statistics.median(values), 2)
            out[f"{name}_{what}_max"] = round(max(values), 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=12)
    p.add_argument("--gap-s", type=float, default=0.25, help="between two chats' arrivals")
    p.add_argument("--short", type=int, default=8, help="max_tokens of the short answers")
    p.add_argument("--long", type=int, default=96, help="max_tokens of the long answers (every other chat)")
    p.add_argument("--yields", default="0,16", help="STOKER_YIELD_TOKENS settings to compare")
    args = p.parse_args()
    for setting in (int(v) for v in args.yields.split(",")):
        print(json.dumps(run(setting, args.chats, args.gap_s, args.short, args.long)), flush=True)


if __name__ == "__main__":
    main()
