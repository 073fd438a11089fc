"""The workers' runtime, between the adapters and the Celery tasks: one `WorkerContext` per process (its pictures in
`pictures`), the stage skeleton and each stage's body (`stages/`, one module per stage), the hand-off to inference,
the inference consumer (feeder, batches, watchdog) and the reaper's actions.

Nothing here is a Celery task or imports one; whatever needs the broker gets it through the context's `Outbox`.
"""
