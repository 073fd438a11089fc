"""Celery edges: each task reads its inputs by key, calls one core function, writes its output."""
