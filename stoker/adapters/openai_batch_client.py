"""`stoker batch`: a JSONL file of OpenAI batch lines submitted to stoker's `/v1/files` and `/v1/batches`, followed
with a progress bar until it ends, and its output (and error) file written next to the input."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

#: Statuses after which a batch does not change.
ENDED = ("completed", "failed", "expired", "cancelled")


class OpenAIBatchClient:
    """The Files and Batch endpoints of one stoker API, over httpx."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    def upload(self, path: Path) -> dict[str, Any]:
        """Upload a batch input file (streamed from disk)."""
        with path.open("rb") as handle:
            answer = self.http.post("/v1/files", data={"purpose": "batch"}, files={"file": (path.name, handle)})
        return _json(answer)

    def create(self, file_id: str, window: str = "24h") -> dict[str, Any]:
        """Start a batch over an uploaded file."""
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": window}
        return _json(self.http.post("/v1/batches", json=body))

    def retrieve(self, batch_id: str) -> dict[str, Any]:
        """A batch as it stands."""
        return _json(self.http.get(f"/v1/batches/{batch_id}"))

    def content(self, file_id: str) -> Iterator[bytes]:
        """A file's bytes, streamed."""
        with self.http.stream("GET", f"/v1/files/{file_id}/content") as answer:
            if answer.status_code != 200:
                raise SystemExit(f"cannot read file {file_id} ({answer.status_code})")
            yield from answer.iter_bytes()

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()


def _json(answer: httpx.Response) -> dict[str, Any]:
    if answer.status_code != 200:
        raise SystemExit(f"refused ({answer.status_code}): {answer.text}")
    body: dict[str, Any] = answer.json()
    return body


def follow(client: OpenAIBatchClient, batch: dict[str, Any], console: Console, poll_s: float = 1.0) -> dict[str, Any]:
    """Show the batch's progress (lines done of its total) until it ends; the batch as it ended."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(batch["status"], total=None)
        while batch["status"] not in ENDED:
            time.sleep(poll_s)  # polling an HTTP API: the status has no push channel
            batch = client.retrieve(batch["id"])
            counts = batch["request_counts"]
            failed = f" ({counts['failed']} failed)" if counts["failed"] else ""
            progress.update(
                task,
                description=f"{batch['status']}{failed}",
                total=counts["total"] or None,
                completed=counts["completed"] + counts["failed"],
            )
    return batch


def save_results(client: OpenAIBatchClient, batch: dict[str, Any], source: Path) -> list[Path]:
    """Write the batch's output and error files next to its input (`NAME.output.jsonl`, `NAME.errors.jsonl`)."""
    written = []
    for field, suffix in (("output_file_id", "output"), ("error_file_id", "errors")):
        file_id = batch.get(field)
        if not file_id:
            continue
        target = source.with_name(f"{source.stem}.{suffix}.jsonl")
        with target.open("wb") as handle:
            for chunk in client.content(file_id):
                handle.write(chunk)
        written.append(target)
    return written


def describe(batch: dict[str, Any], console: Console) -> None:
    """A batch's status, counts, files and errors, for the terminal."""
    counts = batch["request_counts"]
    console.print(f"[bold]{batch['id']}[/] {batch['status']}")
    console.print(f"  requests: {counts['total']} total, {counts['completed']} completed, {counts['failed']} failed")
    for field in ("output_file_id", "error_file_id"):
        if batch.get(field):
            console.print(f"  {field}: {batch[field]}")
    for error in (batch.get("errors") or {}).get("data", []):
        where = f"line {error['line']}: " if error.get("line") else ""
        console.print(f"  [red]{error['code']}[/] {where}{error['message']}")
