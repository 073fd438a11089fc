"""Batch soak: do the Files and Batch APIs leak? Several tenants, each with its own API key, upload input files and
create batches for `--load-s` seconds: some run to completion, some are cancelled at once, some are too long for
their window and expire, some carry a poisoned line; every tenant lists its batches and files meanwhile. After the
load every batch must end, and once the ended batches' and files' time is up the server must hold no new key
without a TTL and its memory must be back within a few MB of where it was before the load.

    python -m bench.batch_soak                 # 10 min of load (the documented run)
    python -m bench.batch_soak --load-s 60     # a quick look (about 4 minutes, with the expiry wait)

The device is simulated: the soak is about the batch bookkeeping (records, working sets, output and error files,
the feeder's fairness and its failures), not the model.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.soak import MiB, Reading, own_valkey, read
from bench.stack import Device, bench_stack

ENDED = ("completed", "failed", "expired", "cancelled")
#: How long an ended batch's record and a file are kept in this soak (the shortest the settings allow for files),
#: so the soak sees them go.
KEEP_S = 60
#: The window every batch gets: a batch of `EXPIRING_LINES` lines cannot finish in it behind the others.
WINDOW_S = 20
EXPIRING_LINES = 600
#: The batch cancelled while it runs, to time a cancel (OpenAI's most lines a batch).
BIG_LINES = 50_000


@dataclass
class Tally:
    """What the soak did and saw, over every tenant."""

    created: Counter[str] = field(default_factory=Counter)
    ended: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, counter: Counter[str], what: str) -> None:
        """Count one event."""
        with self.lock:
            counter[what] += 1


def input_file(kind: str, lines: int, seed: int) -> bytes:
    """A batch input file of `lines` chat requests; a `poison` file's second line is nested 5,000 deep."""
    rows = []
    for n in range(lines):
        body: dict[str, Any] = {"model": "stoker", "messages": [{"role": "user", "content": f"Say {seed}-{n}."}]}
        rows.append(json.dumps({"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    if kind == "poison":
        rows[1] = '{"custom_id": "r1", "body": ' + "[" * 5000 + "]" * 5000 + "}"
    return ("\n".join(rows) + "\n").encode()


def one_batch(http: httpx.Client, kind: str, rng: random.Random, tally: Tally) -> None:
    """Upload a file, create a batch over it, cancel it if that is its kind, and poll it (and the lists) until it
    ends."""
    lines = {"complete": 12, "cancel": 80, "expire": EXPIRING_LINES, "poison": 12}[kind]
    upload = http.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": (f"{kind}.jsonl", input_file(kind, lines, rng.randrange(1 << 30)), "application/jsonl")},
    )
    tally.add(tally.answers, f"upload {upload.status_code}")
    if upload.status_code != 200:
        return
    spec = {"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    created = http.post("/v1/batches", json={**spec, "metadata": {"kind": kind}})
    tally.add(tally.answers, f"create {created.status_code}")
    if created.status_code != 200:
        return
    batch_id = created.json()["id"]
    tally.add(tally.created, kind)
    if kind == "cancel":
        tally.add(tally.answers, f"cancel {http.post(f'/v1/batches/{batch_id}/cancel').status_code}")
    status = _until_ended(http, batch_id, tally)
    tally.add(tally.ended, f"{kind} {status}")


def _until_ended(http: httpx.Client, batch_id: str, tally: Tally) -> str:
    deadline = time.monotonic() + WINDOW_S * 6
    while time.monotonic() < deadline:
        status = str(http.get(f"/v1/batches/{batch_id}").json()["status"])
        if status in ENDED:
            return status
        tally.add(tally.answers, f"list {http.get('/v1/batches', params={'limit': 3}).status_code}")
        time.sleep(1.0)  # a client's polling interval
    return "never ended"


def tenant_loop(base: str, token: str, until: float, seed: int, tally: Tally) -> None:
    """One tenant's batches, one after another, until `until`."""
    rng = random.Random(seed)
    kinds = ["complete"] * 4 + ["cancel"] * 3 + ["expire"] + ["poison"] * 2
    with httpx.Client(base_url=base, timeout=60, headers={"Authorization": f"Bearer {token}"}) as http:
        while time.monotonic() < until:
            try:
                one_batch(http, rng.choice(kinds), rng, tally)
            except httpx.HTTPError as exc:
                with tally.lock:
                    tally.errors.append(repr(exc))


def run_load(base: str, tokens: list[str], seconds: float, seed: int) -> Tally:
    """Every tenant's loop at once, for `seconds` (each finishes the batch it has under way)."""
    tally = Tally()
    until = time.monotonic() + seconds
    threads = [
        threading.Thread(target=tenant_loop, args=(base, token, until, seed + n, tally))
        for n, token in enumerate(tokens)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tally


def big_cancel(base: str, token: str, lines: int = BIG_LINES) -> str:
    """Cancel a batch of `lines` lines once it runs: how long the cancel took to end it, and whether every line is
    in exactly one of its two files."""
    with httpx.Client(base_url=base, timeout=120, headers={"Authorization": f"Bearer {token}"}) as http:
        data = input_file("complete", lines, 0)
        upload = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", data)}).json()
        spec = {"input_file_id": upload["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        batch_id = http.post("/v1/batches", json=spec).json()["id"]
        while http.get(f"/v1/batches/{batch_id}").json()["status"] == "validating":
            time.sleep(0.05)  # a client's polling interval
        started = time.monotonic()
        http.post(f"/v1/batches/{batch_id}/cancel")
        while (batch := http.get(f"/v1/batches/{batch_id}").json())["status"] != "cancelled":
            if time.monotonic() - started > 300:
                raise SystemExit(f"the cancelled batch {batch_id} did not end in 300 s: {batch['status']}")
            time.sleep(0.05)
        took = time.monotonic() - started
        named = [
            json.loads(row)["custom_id"]
            for file_id in (batch["output_file_id"], batch["error_file_id"])
            if file_id
            for row in http.get(f"/v1/files/{file_id}/content").content.splitlines()
        ]
    whole = len(named) == len(set(named)) == lines
    return f"A {lines}-line batch cancelled while it ran: `cancelled` {took:.2f} s after the cancel; every line in " + (
        "exactly one of its files." if whole else f"its files: {len(named)} lines, {len(set(named))} distinct (WRONG)."
    )


def settled(server: redis.Redis[bytes], wait_s: float, every_s: float = 5.0) -> Reading:
    """The reading once every ended batch's and file's time is up (and the feeder's sweep has run)."""
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(every_s, left))
    return read(server)


def report(before: Reading, after: Reading, tally: Tally, args: argparse.Namespace) -> str:
    """The soak's result, as a Markdown section."""
    new_untimed = sorted(after.untimed - before.untimed)
    return "\n".join(
        [
            f"Load {args.load_s:.0f} s, {args.tenants} tenants: batches created {dict(sorted(tally.created.items()))};"
            f" ended {dict(sorted(tally.ended.items()))}; answers {dict(sorted(tally.answers.items()))};"
            f" client errors {len(tally.errors)}.",
            f"{KEEP_S + WINDOW_S} s after the load: used memory {before.used_bytes / MiB:.1f} →"
            f" {after.used_bytes / MiB:.1f} MiB; keys without a TTL {len(before.untimed)} → {len(after.untimed)}"
            f" (new: {new_untimed or 'none'}).",
        ]
    )


def with_keys(tenants: int) -> tuple[list[str], Callable[[str], None]]:
    """API keys for `tenants` tenants, and what writes them into a store at a URL (once it is flushed)."""
    from stoker.adapters.store.tenants import TenantRepository
    from stoker.core.tenancy import issue_key

    issued = [issue_key(f"soak{n}", time.time()) for n in range(tenants)]

    def write(store_url: str) -> None:
        with redis.Redis.from_url(store_url) as client:
            repository = TenantRepository(client)
            for key in issued:
                repository.put_api_key(key.record)

    return [key.token for key in issued], write


def main() -> None:
    """Run the soak and print its result."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load-s", type=float, default=600.0)
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--maxmemory-mb", type=int, default=512)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="stoker-batch-soak-"))
    tokens, write_keys = with_keys(args.tenants)
    settings = {
        "STOKER_AUTH": "on",
        "STOKER_FILES_TTL_S": str(KEEP_S),
        "STOKER_BATCH_TTL_S": str(KEEP_S),
        "STOKER_BATCH_WINDOW_S": str(WINDOW_S),
    }
    device = Device(base_ms=100.0, per_item_ms=20.0)
    with own_valkey(args.maxmemory_mb) as base_url:
        server = redis.Redis.from_url(f"{base_url}/0")
        with bench_stack("pipeline", device, base_url, logs, write_keys, tokens[0], **settings) as s:
            run_load(s.base, tokens, 20.0, args.seed - 1)  # every kind once: the processes' first connections
            before = settled(server, KEEP_S + WINDOW_S)
            tally = run_load(s.base, tokens, args.load_s, args.seed)
            cancelled = big_cancel(s.base, tokens[0])
            after = settled(server, KEEP_S + WINDOW_S)
        print(report(before, after, tally, args))
        print(cancelled)
        print(f"(logs: {logs})")


if __name__ == "__main__":
    main()
