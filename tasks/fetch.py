"""The fetch stage of a URL input: a worker (never the API) downloads it without SSRF and sniffs it like an upload
(`stoker.runtime.stages.fetch`); a temporary failure is retried, and fails the input on the last try."""

from __future__ import annotations

from typing import Any

from stoker.runtime.stages.fetch import run_fetch
from tasks.lifecycle import context
from tasks.retry import RETRY
from tasks.worker import app


@app.task(name="stoker.fetch", **RETRY)
def fetch(job_id: str, ref: str) -> dict[str, Any]:
    """Download a URL input, check that its content is the declared kind, and store it for the stages after."""
    return run_fetch(context(), job_id, ref)
