"""Settings: pydantic-settings classes read from `STOKER_*` environment variables, a module per concern.

Each process kind's class is composed of parts, one concern each, so every setting keeps its flat name
(`settings.ocr_langs`) and its variable (`STOKER_OCR_LANGS`):

- `CommonSettings` (`common`): what every process reads; the broker, job store and cache parts are in `store`.
- `ApiSettings` (`api`): with `tenancy` (API keys, per-tenant limits) and `batch_api` (OpenAI's Files and Batch APIs).
- `WorkerSettings` (`workers`): with `stages` (the CPU stages) and `inference` (the inference consumer).
- `StackSettings` and `ClientSettings` (`stack`): `stoker up` and `stoker submit`.
- `benchmark`: the simulated device, the synchronous baseline and `BenchSettings`, apart from production's.

A new setting is a `Field(description=...)` in the part of its concern; a new concern is a part (a `SettingsPart`)
added to the bases of the process classes that read it. `stoker docs config` lists each class's fields in the order
written: its own, then each part's in the order of its bases.
"""

from stoker.settings.api import ApiSettings
from stoker.settings.benchmark import BenchSettings
from stoker.settings.common import BUILTIN_MODEL, CommonSettings
from stoker.settings.stack import ClientSettings, StackSettings
from stoker.settings.workers import WorkerSettings

__all__ = [
    "BUILTIN_MODEL",
    "ApiSettings",
    "BenchSettings",
    "ClientSettings",
    "CommonSettings",
    "StackSettings",
    "WorkerSettings",
]
