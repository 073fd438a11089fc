"""Soak: does a stack leak? An idle stack, then a mixed load, on a Valkey of its own; at the end the server must
hold as many clients as at the start, no new key without a TTL, memory within a few MB of the start, and every job
terminal. Each of the stack's processes' resident and proportional memory (RSS, PSS) is read before the load and after
each round.

    python -m bench.soak                          # 10 min idle, 5 min of load (the documented run)
    python -m bench.soak --idle-s 60 --load-s 60  # a quick look (about 3 minutes)

The load mixes pictures (a small pool, so repeats hit the cache), speech, text, jobs cancelled right after they
are accepted, and Idempotency-Key replays, at `--rate` jobs a second from a bounded number of requests. The
device is simulated (the soak is about the stack's bookkeeping, not the model).
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import redis

from bench.cost import proportional_mb, resident_mb, tree
from bench.stack import DBS, Device, bench_stack
from bench.workload import _audio, text_png
from workers.broker import start_embedded

TERMINAL = ("succeeded", "degraded", "failed", "cancelled")
MiB = 1 << 20


@dataclass(frozen=True)
class Reading:
    """The server at one moment: connected clients, used memory, and the keys that have no TTL."""

    at: float
    clients: int
    used_bytes: int
    untimed: frozenset[str]


@dataclass
class Load:
    """What the load sent and how it ended."""

    sent: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    job_ids: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, table: dict[str, int], what: str) -> None:
        with self.lock:
            table[what] = table.get(what, 0) + 1


def read(server: redis.Redis[bytes]) -> Reading:
    """Clients, memory and TTL-less keys (every database the stack uses)."""
    untimed = set()
    for db in DBS:
        client = _db(server, db)
        for key in client.scan_iter(count=1000):
            if client.ttl(key) == -1:
                untimed.add(f"db{db}:{_shape(key.decode(errors='replace'))}")
        client.close()
    info = server.info()
    return Reading(time.time(), int(info["connected_clients"]), int(info["used_memory"]), frozenset(untimed))


def _db(server: redis.Redis[bytes], db: int) -> redis.Redis[bytes]:
    kwargs = server.connection_pool.connection_kwargs
    return redis.Redis(host=kwargs["host"], port=kwargs["port"], db=db)


def _shape(key: str) -> str:
    """A key with its ids replaced, so that per-job keys show up as one shape, counted."""
    parts = [p if not (len(p) >= 16 and all(c in "0123456789abcdef-" for c in p)) else "<id>" for p in key.split(":")]
    return ":".join(parts)


def holders(port: int) -> dict[str, int]:
    """Connections to the server per process kind (from the socket table: who holds the clients)."""
    out = subprocess.run(["ss", "-tnpH", "dst", f"127.0.0.1:{port}"], capture_output=True, text=True).stdout
    counts: dict[str, int] = {}
    for pid in {m for line in out.splitlines() for m in re.findall(r"pid=(\d+)", line)}:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        names = [a.decode().split("@")[0] for a in argv if a in (b"api", b"reaper") or b"@%h" in a]
        kind = names[0] if names else "other"
        counts[kind] = counts.get(kind, 0) + out.count(f"pid={pid},")
    return dict(sorted(counts.items()))


def resident(procs: list[subprocess.Popen[bytes]]) -> dict[str, str]:
    """Resident and proportional MB (`rss/pss`) of each of the stack's processes with its children (a prefork
    worker's pool), by what it runs: the proportional figure counts what they share with each other once."""
    out = {}
    for proc in procs:
        pids = [c.pid for c in tree(proc.pid)]
        out[_runs(proc)] = f"{resident_mb(pids)}/{proportional_mb(pids)}"
    return out


def _runs(proc: subprocess.Popen[bytes]) -> str:
    """What a process of the stack runs: its `stoker` command, with a worker's kind (`api`, `worker cpu`, ...)."""
    args = [str(a) for a in cast(Sequence[str], proc.args)][3:]  # after `python -m stoker.cli`
    return " ".join(args[:2] if args[0] == "worker" else args[:1])


@contextmanager
def own_valkey(maxmemory_mb: int) -> Iterator[str]:
    """A Valkey for this soak alone: every client and byte on it is the stack's."""
    proc, port = start_embedded(maxmemory_mb=maxmemory_mb)
    try:
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def idle(server: redis.Redis[bytes], seconds: float, every_s: float = 10.0) -> list[Reading]:
    """Readings of an idle stack, every `every_s`."""
    readings = [read(server)]
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        time.sleep(min(every_s, left))
        readings.append(read(server))
    return readings


def drive(base: str, seconds: float, rate: float, seed: int, load: Load) -> None:
    """`rate` requests a second for `seconds`, each in a thread of its own (bounded), until every job ended."""
    rng = random.Random(seed)
    pictures = [text_png(f"SOAK {n}", size=(640, 200)) for n in range(6)]
    speech = [_audio(rng).data for _ in range(2)]
    kinds = ["image"] * 4 + ["audio"] * 2 + ["text"] * 2 + ["cancel", "replay"]
    with httpx.Client(base_url=base, timeout=60) as http, ThreadPoolExecutor(16) as pool:
        started = time.monotonic()
        for n in range(int(seconds * rate)):
            time.sleep(max(started + n / rate - time.monotonic(), 0.0))
            kind = rng.choice(kinds)
            pool.submit(_one, http, load, kind, rng.choice(pictures), rng.choice(speech), n)


def _one(http: httpx.Client, load: Load, kind: str, picture: bytes, speech: bytes, n: int) -> None:
    try:
        job = _submit(http, load, kind, picture, speech, n)
        if job is not None:
            load.count(load.statuses, _ended(http, job)["status"])
    except Exception as exc:
        with load.lock:
            load.errors.append(f"{kind}: {exc!r}")


def _submit(http: httpx.Client, load: Load, kind: str, picture: bytes, speech: bytes, n: int) -> str | None:
    image = [("image", ("p.png", picture, "image/png"))]
    files = {"text": [], "audio": [("audio", ("s.wav", speech, "audio/wav"))]}.get(kind, image)
    headers = {"Idempotency-Key": str(uuid.uuid4())} if kind == "replay" else {}
    data = {"prompt": f"Question {n}: what does it say?"}
    answer = http.post("/v1/jobs", data=data, files=files, headers=headers)
    load.count(load.sent, f"{kind} {answer.status_code}")
    if answer.status_code not in (200, 202):
        return None
    job_id = str(answer.json()["id"])
    load.job_ids.add(job_id)
    if kind == "cancel":
        http.delete(f"/v1/jobs/{job_id}")
    if kind == "replay":  # the same request again: the same job back
        again = http.post("/v1/jobs", data=data, files=files, headers=headers)
        load.count(load.sent, f"replay again {again.status_code}")
    return job_id


def _ended(http: httpx.Client, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 300
    while True:
        job: dict[str, Any] = http.get(f"/v1/jobs/{job_id}", params={"wait": 20}).json()
        if job["status"] in TERMINAL or time.monotonic() > deadline:
            return job


def settle(server: redis.Redis[bytes], base: str, timeout_s: float = 120.0) -> Reading:
    """Once every queue is empty and the reaper has nothing left to watch: the reading to compare."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = httpx.get(f"{base}/v1/stats", timeout=10).json()
        if not any(q["depth"] for q in stats["queues"].values()):
            break
        time.sleep(1)
    time.sleep(15)  # Celery's result backend and kombu's unacked sweep settle on their own clock (5 s intervals)
    return read(server)


def report(
    idle_readings: list[Reading],
    before: Reading,
    after: Reading,
    load: Load,
    args: argparse.Namespace,
    memory: tuple[dict[str, str], dict[str, str]],
) -> str:
    """The soak's result, as a Markdown section."""
    clients = [r.clients for r in idle_readings]
    new_untimed = sorted(after.untimed - before.untimed)
    lines = [
        f"Idle {args.idle_s:.0f} s: Redis clients {min(clients)} to {max(clients)}"
        f" (start {clients[0]}, end {clients[-1]});"
        f" used memory {idle_readings[0].used_bytes / MiB:.1f} → {idle_readings[-1].used_bytes / MiB:.1f} MiB.",
        f"Load {args.load_s:.0f} s at {args.rate} jobs/s: sent {dict(sorted(load.sent.items()))};"
        f" jobs ended {dict(sorted(load.statuses.items()))} of {len(load.job_ids)}; client errors {len(load.errors)}.",
        f"After the load: clients {before.clients} → {after.clients}; used memory {before.used_bytes / MiB:.1f} →"
        f" {after.used_bytes / MiB:.1f} MiB; keys without a TTL {len(before.untimed)} → {len(after.untimed)}"
        f" (new: {new_untimed or 'none'}).",
        "Resident / proportional MB by process (RSS/PSS), before the load → after it: "
        + ", ".join(f"{name} {memory[0][name]} → {memory[1].get(name, '0/0')}" for name in memory[0])
        + ".",
    ]
    return "\n".join(lines)


def main() -> None:
    """Run the soak and print its result."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle-s", type=float, default=600.0)
    parser.add_argument("--load-s", type=float, default=300.0)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--maxmemory-mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="the load in this many equal rounds, read after each")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="stoker-soak-"))
    device = Device(base_ms=100.0, per_item_ms=20.0)
    with own_valkey(args.maxmemory_mb) as base_url:
        server = redis.Redis.from_url(f"{base_url}/0")
        with bench_stack("pipeline", device, base_url, logs) as stack:
            # Every kind of job once first: pool children open their connections when they first need them.
            drive(stack.base, 10.0, args.rate, args.seed - 1, Load())
            settle(server, stack.base)
            idle_readings = idle(server, args.idle_s)
            before = read(server)
            port = int(base_url.rsplit(":", 1)[1])
            resident_before = resident(stack.procs)
            print(
                f"before the load: {before.clients} clients, by process {holders(port)}; RSS/PSS MB {resident_before}"
            )
            load = Load()
            for round_ in range(args.rounds):  # pools stop growing once they reach the load's peak, a leak does not
                drive(stack.base, args.load_s / args.rounds, args.rate, args.seed + round_, load)
                after = settle(server, stack.base)
                resident_after = resident(stack.procs)
                print(
                    f"after load round {round_ + 1}: {after.clients} clients, by process {holders(port)};"
                    f" RSS/PSS MB {resident_after}"
                )
        print(report(idle_readings, before, after, load, args, (resident_before, resident_after)))
        print(f"(logs: {logs})")


if __name__ == "__main__":
    main()
