"""What every part of the settings shares: the `STOKER_` prefix, and that unknown variables are ignored."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024


class SettingsPart(BaseSettings):
    """One concern's settings, read from `STOKER_*` variables; a process's settings class is composed of parts.

    Every part has the same configuration, so a class composed of several reads the environment as each alone."""

    model_config = SettingsConfigDict(env_prefix="STOKER_", extra="ignore", protected_namespaces=())
