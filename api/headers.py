"""What stoker says about an answer in its headers, where every client and every framework above it can read them
(LangChain's `response_metadata` and litellm keep an answer's headers, though they drop fields they do not know)."""

from __future__ import annotations

from stoker.core.errors import StokerError
from stoker.core.jobs import Job, degraded_codes

#: The job behind an answer (`GET /v1/jobs/{id}` shows it).
JOB_ID = "x-stoker-job-id"
#: The error codes of the job's inputs that could not be read, comma-separated: the answer is from what was left.
DEGRADED = "x-stoker-degraded"
#: `true` when the prompt was trimmed to fit the model's context (as the request or the deployment allowed).
TRUNCATED = "x-stoker-truncated"
#: Whether sending the same request again can help (the openai client obeys it): `false` where it would fail the
#: same way, `true` where the failure is of the moment (429, 503).
SHOULD_RETRY = "x-should-retry"


def job_headers(job: Job) -> dict[str, str]:
    """The job's id; when an input of it could not be read, those inputs' error codes; when its prompt was trimmed
    to fit the context, that it was."""
    headers = {JOB_ID: job.id}
    codes = degraded_codes(job.inputs)
    if codes:
        headers[DEGRADED] = ",".join(codes)
    if job.result is not None and job.result.truncated:
        headers[TRUNCATED] = "true"
    return headers


def retry_headers(exc: StokerError) -> dict[str, str]:
    """Whether a retry may help, and when to come back: a transient error's `Retry-After`."""
    if exc.permanent:
        return {SHOULD_RETRY: "false"}
    return {SHOULD_RETRY: "true", "Retry-After": str(getattr(exc, "retry_after_s", 5))}
