"""The workers' runtime, between the adapters and the Celery tasks: one `WorkerContext` per process, the stage
skeleton, the hand-off to inference, the inference consumer (feeder, batches, watchdog) and the reaper's actions.

Nothing here is a Celery task or imports one; whatever needs the broker gets it through the context's `Outbox`.
"""
