"""The batch feeder against hostile and unlucky batches, on a real stack (Valkey, CPU and inference workers, the
reaper, the device simulated) with two or more tenants: a line that cannot be read, a schema the grammar engine
cannot take, a line larger than a request may be, a storage error, an input file deleted mid-run and a cancel
before validation each end their own batch, never another tenant's; tenants' batches are fed in turn; and every
line of a batch ends in exactly one of its output and error files."""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletionFunctionToolParam

from stoker.core.openai_batches import OpenAIBatch
from stoker.core.tenancy import issue_key
from stoker.settings import ApiSettings
from tests.fleet import SIM_RECOVERY, Fleet, client_context, own_fleet
from tests.integration.test_batches import (
    API,
    DEVICE,
    MODEL,
    batch_errors,
    jsonl,
    line,
    read_lines,
    request_counts,
    run_batch,
    wait_batch,
)
from workers.procs import spawn, stop, wait_for

#: What the feeder holds a line to (a request's body limit, smaller than the default so a test's oversized line
#: stays small, and the JSON values a body may hold), the lines in flight at once (few, so a large batch keeps
#: feeding for seconds), and a tenant's stored-files quota.
LINE_BYTES = 256 * 1024
LINE_VALUES = ApiSettings().max_json_values
IN_FLIGHT = 8
QUOTA = 48_000_000
#: A line nested so deep that reading it overflows Python's parser.
POISON = b'{"custom_id": "poison", "method": "POST", "url": "/v1/chat/completions", "body": ' + b"[" * 5000
POISON += b"]" * 5000 + b"}"
#: A tool whose parameters carry llguidance options that are not an object.
BAD_TOOL: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {"name": "f", "parameters": {"x-guidance": [1]}},
}


@dataclass
class Stack:
    """Workers, an API with tenants in this process (which feeds no batch), and `stoker batch-feeder` beside it."""

    fleet: Fleet
    api: TestClient
    feeder: Any
    env: dict[str, str]
    files: Path

    @property
    def log(self) -> Path:
        return self.fleet.root / "batch-feeder.log"

    def start_feeder(self) -> None:
        """Start `stoker batch-feeder`, and wait until it has loaded its tokenizer (its memory steady from then)."""
        self.feeder = spawn(["batch-feeder"], self.env, self.log)
        wait_for(lambda: b"tokenizer loaded" in self.log.read_bytes(), 120, "the batch feeder", [self.feeder])

    @contextmanager
    def feeder_stopped(self) -> Iterator[None]:
        """No feeder runs inside the block (what it holds happens before any feeder sees it)."""
        assert stop(self.feeder) == 0
        try:
            yield
        finally:
            self.start_feeder()

    def tenant(self, name: str) -> openai.OpenAI:
        """The official client for a new tenant of this name (made unique)."""
        issued = issue_key(f"{name}-{uuid.uuid4().hex[:8]}", time.time())
        client_context(self.api).store.tenants.put_api_key(issued.record)
        return openai.OpenAI(base_url=API, api_key=issued.token, http_client=self.api, max_retries=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    files = tmp_path_factory.mktemp("files")
    settings = {**DEVICE, **SIM_RECOVERY, "STOKER_MAX_BATCH_SIZE": "8"}
    api = {"files_dir": files, "batch_feeder": False, "auth": True, "files_tenant_max_bytes": QUOTA}
    with own_fleet(settings, kinds=("cpu", "infer"), api=api) as fleet:
        env = {
            **fleet.env,
            "STOKER_FILES_DIR": str(files),
            "STOKER_BATCH_FEED_INTERVAL_S": "0.1",
            "STOKER_BATCH_MAX_IN_FLIGHT": str(IN_FLIGHT),
            "STOKER_MAX_BODY_BYTES": str(LINE_BYTES),
            "STOKER_FILES_TENANT_MAX_BYTES": str(QUOTA),
        }
        crew = Stack(fleet, fleet.client, None, env, files)
        crew.start_feeder()
        try:
            yield crew
        finally:
            stop(crew.feeder)


def small_batch(client: openai.OpenAI, prefix: str, count: int = 3) -> Any:
    return run_batch(client, jsonl([line(f"{prefix}{n}", f"Say {n}.") for n in range(count)]))


def every_line_once(client: openai.OpenAI, done: Any, ids: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The batch's output and error lines: together every custom_id, none in both, counted as the batch says."""
    outputs, errors = read_lines(client, done.output_file_id), read_lines(client, done.error_file_id)
    assert not set(outputs) & set(errors)
    assert set(outputs) | set(errors) == ids
    counts = request_counts(done)
    assert (counts.total, counts.completed, counts.failed) == (len(ids), len(outputs), len(errors))
    return outputs, errors


def test_a_line_that_cannot_be_read_fails_its_batch_alone(stack: Stack) -> None:
    """A line nested 5,000 deep is that batch's `invalid_json_line` (its number given); the other tenant's batch
    completes beside it."""
    alpha, beta = stack.tenant("alpha"), stack.tenant("beta")
    poisoned = run_batch(alpha, jsonl([line("fine", "Hello.")]) + POISON + b"\n")
    other = small_batch(beta, "b")
    failed = wait_batch(alpha, poisoned.id, ("failed", "completed", "cancelled"), timeout_s=60)
    assert failed.status == "failed"
    assert [(e.code, e.line) for e in batch_errors(failed)] == [("invalid_json_line", 2)]
    done = wait_batch(beta, other.id, ("completed", "failed"), timeout_s=60)
    assert done.status == "completed"
    assert request_counts(done).completed == 3


def test_a_batch_cancelled_before_it_was_validated_ends_with_nothing_run(stack: Stack) -> None:
    """Cancelled while `validating` (its poisoned line never read, and a plain one), each batch ends `cancelled`
    with counts of nothing run and no file, and the other tenant's batch completes."""
    alpha, beta = stack.tenant("alpha"), stack.tenant("beta")
    with stack.feeder_stopped():
        poisoned = run_batch(alpha, jsonl([line("fine", "Hello.")]) + POISON + b"\n")
        plain = small_batch(alpha, "p", count=8)
        for batch in (poisoned, plain):
            assert alpha.batches.cancel(batch.id).status == "cancelling"
        other = small_batch(beta, "b")
    for batch in (poisoned, plain):
        ended = wait_batch(alpha, batch.id, ("cancelled", "failed", "completed"), timeout_s=60)
        assert ended.status == "cancelled"
        assert ended.cancelled_at is not None
        counts = request_counts(ended)
        assert (counts.total, counts.completed, counts.failed) == (0, 0, 0)
        assert (ended.output_file_id, ended.error_file_id) == (None, None)
    assert wait_batch(beta, other.id, ("completed", "failed"), timeout_s=60).status == "completed"


def test_a_tool_schema_the_grammar_cannot_take_is_its_lines_error(stack: Stack) -> None:
    """A line whose tool's `x-guidance` is not an object is refused as `/v1/chat/completions` refuses it (400
    `unsupported_schema`, in the error file); its batch's other lines and the other tenant's batch run."""
    alpha, beta = stack.tenant("alpha"), stack.tenant("beta")
    tooled = line("tool", "What is f?")
    tooled["body"]["tools"] = [BAD_TOOL]
    batch = run_batch(alpha, jsonl([line("a", "Hello."), tooled, line("b", "Hi.")]))
    other = small_batch(beta, "b")
    done = wait_batch(alpha, batch.id, ("completed", "failed"), timeout_s=60)
    assert done.status == "completed"
    _, errors = every_line_once(alpha, done, {"a", "tool", "b"})
    assert set(errors) == {"tool"}
    response = errors["tool"]["response"]
    assert response["status_code"] == 400
    assert response["body"]["error"]["code"] == "unsupported_schema"
    assert wait_batch(beta, other.id, ("completed", "failed"), timeout_s=60).status == "completed"


def test_chat_completions_refuse_a_tool_schema_the_grammar_cannot_take(stack: Stack) -> None:
    client = stack.tenant("alpha")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is f?"}],
            tools=[BAD_TOOL],
            max_tokens=4,
        )
    assert refused.value.status_code == 400
    assert refused.value.code == "unsupported_schema"
    assert refused.value.param == "tools"


def test_a_line_over_a_requests_limits_fails_the_batch_by_its_number(stack: Stack) -> None:
    """A picture over the body limit, and a line of more JSON values than a body may hold, are each refused with
    their line number; a line of 30 MB is never held whole by the feeder."""
    client = stack.tenant("alpha")
    picture = base64.b64encode(os.urandom(LINE_BYTES)).decode()
    big = line("picture", [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{picture}"}}])
    many = line("values", "Count.")
    many["body"]["stoker_padding"] = [1] * (LINE_VALUES + 10)
    huge = json.dumps(line("huge", "x" * 30_000_000)).encode() + b"\n"
    uploaded = client.files.create(
        file=("in.jsonl", jsonl([line("fine", "Hello."), big, many]) + huge), purpose="batch"
    )
    Path(f"/proc/{stack.feeder.pid}/clear_refs").write_text("5")  # the feeder's peak memory counted from now
    before = _kib(stack.feeder.pid, "VmRSS")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_batch(client, batch.id, ("failed", "completed", "in_progress"), timeout_s=60)
    assert failed.status == "failed"
    assert [(e.code, e.line) for e in batch_errors(failed)] == [
        ("line_too_large", 2),
        ("line_too_large", 3),
        ("line_too_large", 4),
    ]
    growth_mib = (_kib(stack.feeder.pid, "VmHWM") - before) / 1024
    assert growth_mib < 16, growth_mib


def _kib(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(row.split()[1] for row in status.splitlines() if row.startswith(f"{field}:")))


#: Alpha's lines in the fairness test: enough that, fed first, they would hold beta back for many rounds of
#: `IN_FLIGHT` (beta's 3 lines end within about two).
ALPHA_LINES = 60


def test_tenants_batches_are_fed_in_turn(stack: Stack) -> None:
    """Beta's 3 lines run while most of alpha's 60 still wait, whichever batch the store lists first (alpha's is
    made to sort first: the order a feeder walks batches in must not decide)."""
    alpha, beta = stack.tenant("alpha"), stack.tenant("beta")
    store = client_context(stack.api).store
    records = {}
    with stack.feeder_stopped():
        for prefix, client, count, lead in (("a", alpha, ALPHA_LINES, "0"), ("b", beta, 3, "f")):
            uploaded = client.files.create(
                file=("in.jsonl", jsonl([line(f"{prefix}{n}", f"Say {n}.") for n in range(count)])), purpose="batch"
            )
            tenant = store.files.get(uploaded.id)
            assert tenant is not None
            now = int(time.time())
            records[prefix] = OpenAIBatch(
                id=f"batch_{lead}{uuid.uuid4().hex[1:]}",
                endpoint="/v1/chat/completions",
                input_file_id=uploaded.id,
                completion_window="24h",
                status="validating",
                created_at=now,
                expires_at=now + 3600,
                tenant=tenant.tenant,
            )
            store.openai_batches.create(records[prefix])
    small = wait_batch(beta, records["b"].id, ("completed", "failed"), timeout_s=60)
    assert small.status == "completed"
    large = alpha.batches.retrieve(records["a"].id)
    assert large.status == "in_progress"
    counts = request_counts(large)
    done = counts.completed + counts.failed
    assert done < ALPHA_LINES - 2 * IN_FLIGHT, done  # fed only after alpha's lines, beta's would end with its last
    assert wait_batch(alpha, records["a"].id, ("completed", "failed"), timeout_s=120).status == "completed"


def test_a_batch_whose_step_keeps_failing_fails_alone_and_is_logged_once(stack: Stack) -> None:
    """Its input file unreadable (a directory where its bytes should be): the batch fails after a few tries,
    saying why, with one traceback in the feeder's log, while the other tenant's batch completes."""
    alpha, beta = stack.tenant("alpha"), stack.tenant("beta")
    uploaded = alpha.files.create(file=("in.jsonl", jsonl([line("x", "Hello.")])), purpose="batch")
    path = stack.files / uploaded.id
    path.unlink()
    path.mkdir()
    broken = alpha.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    other = small_batch(beta, "b")
    assert wait_batch(beta, other.id, ("completed", "failed"), timeout_s=60).status == "completed"
    failed = wait_batch(alpha, broken.id, ("failed", "in_progress", "completed"), timeout_s=60)
    assert failed.status == "failed"
    assert [e.code for e in batch_errors(failed)] == ["internal_error"]
    message = batch_errors(failed)[0].message
    assert message is not None
    assert "IsADirectoryError" in message
    said = [row for row in stack.log.read_text().splitlines() if broken.id in row]
    assert len(said) == 2, said  # the first failure (with its traceback) and the end
    assert stack.log.read_text().count("IsADirectoryError") <= 3  # one traceback, the end's line and its error


def test_a_running_batch_whose_input_file_is_deleted_ends_promptly(stack: Stack) -> None:
    """What ran is kept; every line never fed is in the error file as `file_not_found`; the batch completes."""
    client = stack.tenant("alpha")
    ids = {f"d{n}" for n in range(200)}
    batch = run_batch(client, jsonl([line(i, f"Say {i}.") for i in sorted(ids)]))
    wait_for(lambda: request_counts(client.batches.retrieve(batch.id)).completed >= 5, 60, "the batch running", [])
    client.files.delete(batch.input_file_id)
    done = wait_batch(client, batch.id, ("completed", "failed", "expired"), timeout_s=30)
    assert done.status == "completed"
    outputs, errors = every_line_once(client, done, ids)
    assert len(outputs) >= 5
    assert len(errors) > 0
    assert {row["error"]["code"] for row in errors.values()} == {"file_not_found"}


def test_a_cancel_after_the_input_file_was_deleted_leaves_every_line_in_one_file(stack: Stack) -> None:
    client = stack.tenant("alpha")
    ids = {f"c{n}" for n in range(200)}
    batch = run_batch(client, jsonl([line(i, f"Say {i}.") for i in sorted(ids)]))
    wait_for(lambda: request_counts(client.batches.retrieve(batch.id)).completed >= 5, 60, "the batch running", [])
    with stack.feeder_stopped():
        client.files.delete(batch.input_file_id)
        assert client.batches.cancel(batch.id).status == "cancelling"
    done = wait_batch(client, batch.id, ("cancelled",), timeout_s=30)
    outputs, errors = every_line_once(client, done, ids)
    assert len(outputs) >= 5
    assert {row["error"]["code"] for row in errors.values()} == {"batch_cancelled"}


def test_a_tenant_past_its_quota_with_its_batches_files_runs_no_new_batch(stack: Stack) -> None:
    """Its files a little under its quota, a tenant creates a batch and cancels it: the error file counts against
    the quota, which it fills, and the next batch from the same input fails (`tenant_storage_full`), writing
    nothing."""
    client = stack.tenant("alpha")
    ids = {f"q{n}" for n in range(1000)}
    uploaded = client.files.create(
        file=("in.jsonl", jsonl([line(i, f"Say {i}.") for i in sorted(ids)])), purpose="batch"
    )
    store = client_context(stack.api).store
    tenant = store.files.get(uploaded.id)
    assert tenant is not None
    filler = (QUOTA - store.files.used(tenant.tenant) - 50_000) // 1000
    client.files.create(file=("filler.jsonl", (b"x" * 999 + b"\n") * filler), purpose="batch")

    def create() -> Any:
        made = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        return wait_batch(client, made.id, ("in_progress", "failed"), timeout_s=30)

    first = create()
    assert first.status == "in_progress"
    client.batches.cancel(first.id)
    every_line_once(client, wait_batch(client, first.id, ("cancelled",), timeout_s=30), ids)
    used = store.files.used(tenant.tenant)
    assert used >= QUOTA
    refused = create()
    assert refused.status == "failed"
    assert [e.code for e in refused.errors.data] == ["tenant_storage_full"]
    assert (refused.output_file_id, refused.error_file_id) == (None, None)
    assert store.files.used(tenant.tenant) == used
