"""Celery configuration (`celeryconfig`, as Celery users expect it): flat, lowercase Celery settings. Queues and
routes live here.

What depends on a deployment is computed from the process's one settings object, never read here from the
environment: `connection(settings)` (broker, result backend, TLS, queues) for every process that sends or runs
tasks, `limits(settings)` (each stage's soft and hard time limits) for workers. `tasks.app.configure` applies them.
"""

from __future__ import annotations

from typing import Any

from stoker.adapters.broker import class_priority, declare_queues, is_amqp, redis_transport, transport_options
from stoker.core.queues import CALLBACK_QUEUE, OCR_BANDS_QUEUE
from stoker.settings import ApiSettings, CommonSettings, WorkerSettings

# JSON only: a pickled message is refused, and messages carry keys, never media.
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
result_accept_content = ["json"]

# One queue per stage, so each can be watched and scaled on its own (quorum queues on RabbitMQ).
task_default_queue = "tokenize"
task_routes = {
    "stoker.decode": {"queue": "decode"},
    "stoker.render": {"queue": "decode"},
    "stoker.ocr": {"queue": "ocr"},
    "stoker.ocr_band": {"queue": OCR_BANDS_QUEUE},
    "stoker.probe": {"queue": "decode"},
    "stoker.keyframe": {"queue": "decode"},
    # URL inputs are downloaded on the CPU workers' decode queue: no worker kind of its own.
    "stoker.fetch": {"queue": "decode"},
    "stoker.transcribe": {"queue": "asr"},
    "stoker.tokenize": {"queue": "tokenize"},
    "stoker.rescue": {"queue": "tokenize"},
    "stoker.infer": {"queue": "infer"},
    "stoker.sync": {"queue": "sync"},
    # Completion callbacks go out from the CPU workers, on a queue of their own (never behind a backlog of OCR).
    "stoker.callback": {"queue": CALLBACK_QUEUE},
}
# An accepted job is never lost: ack after the work, requeue when a worker dies mid-task.
task_acks_late = True
# A batch line's messages carry a lower broker priority than interactive jobs' (`broker.class_priority`), and so
# does every message its tasks publish on the way (the chord's tokenize, the hand-off to inference).
task_inherit_parent_priority = True
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1
broker_connection_retry_on_startup = True
broker_connection_max_retries = None

result_expires = 3600
# Chord counters and task states live in the result backend: ride out a Redis restart instead of failing the task.
result_backend_always_retry = True
result_backend_max_retries = 30
result_backend_max_sleep_between_retries_ms = 1000
task_track_started = True
# Task events only while someone watches: Flower turns them on in every worker while it runs (its `enable_events`,
# every few seconds), so a stack without Flower does not pay for an event per task. And no task-sent event per
# publish: it cost the API more CPU than the publish itself; Flower sees each task from task-received on.
worker_send_task_events = False
task_send_sent_event = False
worker_hijack_root_logger = False


def connection(s: CommonSettings) -> dict[str, Any]:
    """Where the broker and result backend are, and how to reach them (every process that sends or runs tasks)."""
    return {
        "broker_url": s.broker_url,
        "result_backend": s.result_url,
        # rediss:// (TLS, e.g. with an ACL user: rediss://stoker:secret@host:6380/0): certificates verified against
        # STOKER_REDIS_CA_FILE; a bare rediss:// URL would otherwise connect without verifying anything.
        "broker_use_ssl": s.redis_tls(s.broker_url) or False,
        "redis_backend_use_ssl": s.redis_tls(s.result_url) or None,
        # One queue per stage, so each can be watched and scaled on its own (quorum queues on RabbitMQ).
        "task_queues": declare_queues(s.broker_url),
        "broker_transport_options": transport_options(s.broker_url, s.visibility_timeout_s),
        # On Redis, kombu's transport with one client per pool (`stoker.adapters.kombu_redis.RedisChannel`).
        "broker_transport": redis_transport(s.broker_url),
        # RabbitMQ's quorum queues take a message above priority 4 first: interactive jobs' say so (on Redis the
        # default, 0, is already the first).
        "task_default_priority": class_priority(s.broker_url, "interactive") if is_amqp(s.broker_url) else None,
    }


def producer(s: ApiSettings) -> dict[str, Any]:
    """The API's producer: a hung broker (stopped, partitioned) fails a publish within the store timeout, retried
    once, so the client gets 503 `broker_unavailable` instead of a request that never ends."""
    return {
        "broker_connection_timeout": s.store_timeout_s,
        "broker_transport_options": transport_options(s.broker_url, s.visibility_timeout_s, s.store_timeout_s),
        "task_publish_retry_policy": {"max_retries": 1, "interval_start": 0, "interval_step": 0.2},
    }


#: A worker's publishes (a chain's next stage, a hand-off, a retry, a re-send) ride out a broker restart as its result
#: backend does (`result_backend_max_retries`, at most a second apart). Celery's default gives up after about a
#: second: a stage that ended while the broker restarted then failed its input with `stage_killed` for want of
#: sending the next stage. A stage whose hard time limit comes first is killed and rescued, as before.
WORKER_PUBLISH_RETRY_POLICY = {
    "max_retries": result_backend_max_retries,
    "interval_start": 0,
    "interval_step": 0.2,
    "interval_max": result_backend_max_sleep_between_retries_ms / 1000,
}


def limits(s: WorkerSettings) -> dict[str, Any]:
    """Each stage's soft and hard time limits (workers only: Celery enforces them in the prefork pool)."""
    return {
        "task_annotations": {
            "stoker.decode": {"soft_time_limit": s.decode_soft_s, "time_limit": s.decode_hard_s},
            # A render of one picture: decode's soft limit on its picture; its end (tokenize's) inside the hard one.
            "stoker.render": {"soft_time_limit": s.decode_soft_s, "time_limit": s.decode_hard_s + s.tokenize_hard_s},
            "stoker.ocr": {"soft_time_limit": s.ocr_soft_s, "time_limit": s.ocr_hard_s},
            "stoker.ocr_band": {"soft_time_limit": s.ocr_soft_s, "time_limit": s.ocr_hard_s},
            # Tokenize may also wait for room in the inference queue (backpressure); its own work has tokenize_soft_s.
            "stoker.tokenize": {
                "soft_time_limit": s.tokenize_soft_s + s.handoff_max_wait_s,
                "time_limit": s.tokenize_hard_s + s.handoff_max_wait_s,
            },
            "stoker.probe": {"soft_time_limit": s.probe_soft_s, "time_limit": s.probe_hard_s},
            "stoker.keyframe": {"soft_time_limit": s.keyframes_soft_s, "time_limit": s.keyframes_hard_s},
            "stoker.fetch": {"soft_time_limit": s.fetch_soft_s, "time_limit": s.fetch_hard_s},
            "stoker.transcribe": {"soft_time_limit": s.transcribe_soft_s, "time_limit": s.transcribe_hard_s},
            "stoker.callback": {"soft_time_limit": s.callback_timeout_s + 2, "time_limit": s.callback_timeout_s + 5},
        }
    }
