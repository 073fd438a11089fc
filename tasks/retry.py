"""The retry options of every stage task: Celery's, so they live beside the tasks, not in the stages they run."""

from __future__ import annotations

from typing import Any

from stoker.core.errors import TransientError

#: Options of every stage task: a transient failure (the store away, a model not loaded yet) is retried with
#: exponential backoff a bounded number of times; permanent ones become the input's structured error.
RETRY: dict[str, Any] = {
    "autoretry_for": (TransientError,),
    "retry_backoff": 1,
    "retry_backoff_max": 30,
    "retry_jitter": True,
    "max_retries": 3,
}
