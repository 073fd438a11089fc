"""Celery edges: each stage's task is one call into its body (`stoker.runtime.stages`), with what only Celery has
around it (retries, time limits, routing, the job's chord)."""
