"""A small HTTP client for stoker's API, and the terminal rendering of a finished job."""

from __future__ import annotations

import mimetypes
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from stoker.core.jobs import TERMINAL
from stoker.core.media import guess_kind


def submit_files(
    base_url: str, prompt: str, files: list[Path], timeout_s: float = 300.0, api_key: str | None = None
) -> dict[str, Any]:
    """Submit a job with these files and wait for it to end (in the POST itself, then long-polls), return the job
    JSON. An API that cannot be reached ends the command with one line saying so (SystemExit), not a traceback."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    parts = [_part(f) for f in files]
    try:
        with httpx.Client(base_url=base_url, timeout=60, headers=headers) as http:
            return _run_job(http, prompt, parts, timeout_s)
    except httpx.TransportError as exc:
        raise SystemExit(
            f"no stoker API answers at {base_url} ({type(exc).__name__}: {exc or 'no answer'}); start one with "
            "`stoker up`, or name it with --api URL or STOKER_API_URL"
        ) from None


def _run_job(http: httpx.Client, prompt: str, parts: list[Any], timeout_s: float) -> dict[str, Any]:
    response = http.post("/v1/jobs", params={"wait": min(30.0, timeout_s)}, data={"prompt": prompt}, files=parts)
    if response.status_code not in (200, 202):
        raise SystemExit(f"rejected ({response.status_code}): {response.text}")
    job: dict[str, Any] = response.json()
    deadline = time.monotonic() + timeout_s
    while job["status"] not in TERMINAL and time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job['id']}", params={"wait": 30}).json()
    return job


def _part(path: Path) -> tuple[str, tuple[str, bytes, str]]:
    data = path.read_bytes()
    kind = guess_kind(data, path.name)
    if kind is None:
        raise SystemExit(f"{path}: not an image, audio or video file stoker accepts")
    return kind, (path.name, data, mimetypes.guess_type(path.name)[0] or "application/octet-stream")


def render_job(job: dict[str, Any], console: Console | None = None) -> None:
    """Print a job's answer, its inputs and its stage timings."""
    console = console or Console()
    console.print(f"[bold]job[/] {job['id']}  [bold]status[/] {job['status']}")
    for item in job["inputs"]:
        head = f"input {item['index']} ({item['kind']}, {item['content_hash'][:12]}): {item['status']}"
        if item.get("error"):
            head += f" [red]{item['error']['code']}[/]: {item['error']['message']}"
        console.print(head)
        label = "transcript" if item["kind"] in ("audio", "video") else "text"
        if item.get("text"):
            console.print(f"  {label}: {item['text']!r}")
        for frame in item.get("frames") or []:
            console.print(f"  frame at {frame['time_s']:.1f}s: {frame.get('text') or ''!r}")
    if job.get("result"):
        console.print(f"[bold green]answer[/] ({job['result']['model']}):\n{job['result']['text']}")
    if job.get("error"):
        console.print(f"[red]error[/] {job['error']['code']}: {job['error']['message']}")
    console.print(_timings_table(job))


#: Job phases in the order they happen: (name in timings_ms, bar colour).
PHASES = (("queued", "grey50"), ("preprocess", "cyan"), ("infer_wait", "yellow"), ("infer", "green"))
BAR_WIDTH = 40


def waterfall(job: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(label, start ms, duration ms) per phase of the job, each starting where the previous ended, then each
    input's stages (queue wait and run) within preprocessing."""
    t = job.get("timings_ms", {})
    rows: list[tuple[str, float, float]] = []
    at = 0.0
    for name, _ in PHASES:
        if name not in t:
            continue
        span = t[name] - (t.get("queued", 0.0) if name == "preprocess" else 0.0)
        rows.append((name, at, max(span, 0.0)))
        at += max(span, 0.0)
    start = t.get("queued", 0.0)
    for item in job.get("inputs", []):
        offset = start
        for stage, ms in item.get("timings_ms", {}).items():
            rows.append((f"  input {item['index']} {stage.replace('_queue', ' (queue)')}", offset, ms))
            offset += ms
    return rows


def _bar(start: float, ms: float, scale: float, colour: str) -> str:
    lead = round(start * scale)
    width = max(round(ms * scale), 1 if ms > 0 else 0)
    return " " * min(lead, BAR_WIDTH) + f"[{colour}]" + "█" * min(width, BAR_WIDTH - min(lead, BAR_WIDTH)) + "[/]"


def _timings_table(job: dict[str, Any]) -> Table:
    """The job's waterfall: where its time went, as bars on one time axis."""
    total = float(job.get("timings_ms", {}).get("total") or 0.0)
    rows = waterfall(job)
    end = max([total, *(start + ms for _, start, ms in rows)], default=0.0)
    scale = BAR_WIDTH / end if end else 0.0
    colours = dict(PHASES)
    share = job.get("preprocess_share")
    title = f"timings: {total:.0f} ms total" + (f", preprocessing {share:.0%}" if share is not None else "")
    table = Table(title=title, box=None)
    table.add_column("stage")
    table.add_column("ms", justify="right")
    table.add_column("")
    for label, start, ms in rows:
        colour = colours.get(label, "magenta" if "(queue)" in label else "blue")
        table.add_row(label, f"{ms:.1f}", _bar(start, ms, scale, colour))
    return table
