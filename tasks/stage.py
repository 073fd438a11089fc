"""How a stage task maps what happens to an input record: timing, structured errors, never a crashed chord."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded

from stoker.errors import StageTimeout, StokerError
from stoker.jobs import ErrorInfo, InputRecord

log = logging.getLogger(__name__)


@contextlib.contextmanager
def input_stage(record: InputRecord, stage: str) -> Iterator[InputRecord]:
    """Run one stage for one input: record its run time, and turn any failure into a failed input."""
    started = time.perf_counter()
    try:
        yield record
    except SoftTimeLimitExceeded:
        _fail(record, StageTimeout(f"{stage} exceeded its time limit", stage=stage))
    except StokerError as exc:
        exc.stage = exc.stage or stage
        _fail(record, exc)
    except Exception as exc:  # a stage bug must fail this input, not the whole job
        log.exception("stage %s crashed on input %s", stage, record.index)
        _fail(record, StokerError(f"{type(exc).__name__}: {exc}", stage=stage))
    finally:
        record.timings_ms[stage] = round((time.perf_counter() - started) * 1000, 2)


def _fail(record: InputRecord, exc: StokerError) -> None:
    record.status = "failed"
    record.error = ErrorInfo(**exc.to_dict())


def handoff(job_id: str, ref: str, record: InputRecord | None) -> dict[str, Any]:
    """What a stage passes to the next one in its chain: where the record is, and how it stands."""
    return {"job_id": job_id, "ref": ref, "status": record.status if record else "skipped"}


def runnable(record: InputRecord | None) -> bool:
    """Whether a stage still has work on this record (it exists, and nothing failed or skipped it)."""
    return record is not None and record.status not in ("failed", "skipped")
