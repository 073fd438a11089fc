"""Process launchers: Celery workers per queue group, the embedded broker, and the local stack."""
