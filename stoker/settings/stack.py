"""The command line's own: `stoker up` (the local stack it supervises) and `stoker submit` (the API it talks to)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from stoker.settings.api import ApiSettings


class StackSettings(ApiSettings):
    """`stoker up`: the API's settings plus what the local stack supervisor needs."""

    auth: bool = Field(
        False,
        description="A local stack, bound to 127.0.0.1, runs without API keys unless `stoker up --auth` (or "
        "STOKER_AUTH=on).",
    )
    flower_port: int = Field(5555, description="Flower's port under `stoker up` (`--flower-port`).")
    metrics_base_port: int = Field(
        9101,
        ge=0,
        le=65533,
        description="`stoker up` (`--metrics-port`): the CPU worker serves its metrics on this port, the inference "
        "worker two on (the one between is for an ASR worker run apart), the API on the next; 0 turns them off.",
    )
    flower_basic_auth: str | None = Field(
        None,
        description="\"user:password\" for Flower's basic auth; without it Flower's HTTP API refuses every call. "
        "`stoker up` binds Flower to its host (127.0.0.1 unless `host` says otherwise); with API keys on "
        "(`--auth`) it never runs Flower without basic auth: unset, it makes a password for the run and prints it.",
    )
    ready_timeout_s: float = Field(
        300.0, ge=1, description="How long `stoker up` waits for every process to be ready before it gives up."
    )
    embedded_maxmemory_mb: int = Field(
        2048,
        ge=64,
        description="The embedded broker and job store's memory limit (it refuses writes beyond it: noeviction); the "
        "API refuses new jobs with 503 `store_full` before it is reached (`store_memory_high_ratio`).",
    )
    embedded_cache_maxmemory_mb: int = Field(
        1024,
        ge=16,
        description="The embedded stage cache's memory limit: `stoker up` runs the cache on a Valkey of its own "
        "(unless one answers at `cache_url`), which forgets the least recently used entries beyond it "
        "(allkeys-lru), so a full cache never refuses a job.",
    )


class ClientSettings(BaseSettings):
    """`stoker submit`: the API to talk to and the key to send, when the command line names none."""

    model_config = SettingsConfigDict(env_prefix="STOKER_", extra="ignore")

    api_url: str = Field(
        "http://127.0.0.1:8000", description="The API `stoker submit` talks to when `--api` names none."
    )

    api_key: str | None = Field(None, description="The API key `stoker submit` sends when `--key` names none.")
