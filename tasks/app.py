"""The Celery application shared by the API (to send) and the workers (to run)."""

from celery import Celery

app = Celery("stoker", include=["tasks.preprocess", "tasks.media", "tasks.inference"])
app.config_from_object("celeryconfig")
