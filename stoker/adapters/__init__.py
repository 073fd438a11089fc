"""Adapters: Redis repositories, the stage cache, model backends, HTTP clients, observability."""
