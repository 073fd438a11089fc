"""Pure stage logic: plain functions over plain values. No Celery, Redis or HTTP imports here."""
