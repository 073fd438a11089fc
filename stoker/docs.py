"""Pages of the documentation that are generated from the code, so that they cannot drift from it.

`docs/configuration.md` is written from the settings classes: each field's environment variable, type, default
and `Field(description=...)`. `stoker docs config > docs/configuration.md` (`make docs`) writes it, and a unit test
fails while the committed page differs from what this module renders.
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from stoker.settings import (
    ApiSettings,
    BenchSettings,
    ClientSettings,
    CommonSettings,
    StackSettings,
    WorkerSettings,
)

#: Every settings class, in the order the page shows them: the shared base, each process kind, then the tools'.
SETTINGS_CLASSES: tuple[type[BaseSettings], ...] = (
    CommonSettings,
    ApiSettings,
    WorkerSettings,
    StackSettings,
    ClientSettings,
    BenchSettings,
)

HEADER = """\
# Configuration

<!-- Generated from stoker/settings/ by `stoker docs config` (`make docs`): edit a field's description there. -->

Every setting is an environment variable with the prefix `STOKER_`, declared in a part per concern in
`stoker/settings/` (the store, stages, inference, tenancy, the Batch API, the benchmarks' simulated device and
baseline) and read by one pydantic-settings class per process kind composed of those parts (the only place the
environment is read). `CommonSettings` is what every process reads; the API, the workers and `stoker up` each add
their own, and a class may give an inherited setting a default of its own (shown beside the one it replaces).
Booleans take `true`/`false` (or `on`/`off`, `1`/`0`); a duration's unit is in its name (`_s` seconds, `_ms`
milliseconds). Unknown `STOKER_*` variables are ignored.
Where each process gets them from in a deployment: [operations](operations.md).
"""

#: How annotated-types' bounds read in a type column.
BOUNDS = {
    annotated_types.Ge: ("≥", "ge"),
    annotated_types.Gt: (">", "gt"),
    annotated_types.Le: ("≤", "le"),
    annotated_types.Lt: ("<", "lt"),
}


def configuration_page() -> str:
    """The whole `docs/configuration.md`: a header, then one section per settings class."""
    return "\n".join([HEADER, *(_section(cls) for cls in SETTINGS_CLASSES)])


def _section(cls: type[BaseSettings]) -> str:
    """One settings class: its docstring, what it inherits, and a table of the fields it adds to what it inherits."""
    lines = [f"## {cls.__name__}", "", (cls.__doc__ or "").strip(), ""]
    parent = next((base for base in cls.__mro__[1:] if base in SETTINGS_CLASSES), None)
    if parent is not None:
        lines += [f"It also reads every setting of [{parent.__name__}](#{parent.__name__.lower()}).", ""]
    lines += ["| variable | type | default | description |", "| --- | --- | --- | --- |"]
    lines += [_row(cls, name, cls.model_fields[name], parent) for name in _own_fields(cls, parent)]
    return "\n".join(lines) + "\n"


def _own_fields(cls: type[BaseSettings], parent: type[BaseSettings] | None) -> list[str]:
    """The fields a class declares in its body or takes from its parts, not those it only inherits from the settings
    class it extends: first the inherited ones it gives a default of its own, in that class's order, then its new
    ones in the order they are written (its body's, then each part's in the order of its bases: the method
    resolution order, where pydantic's own field order runs from the last base to the first)."""
    inherited = set(parent.__mro__) if parent is not None else set()
    written = (name for klass in cls.__mro__ if klass not in inherited for name in inspect.get_annotations(klass))
    own = [name for name in dict.fromkeys(written) if name in cls.model_fields]
    replaced = [name for name in (parent.model_fields if parent is not None else ()) if name in own]
    return replaced + [name for name in own if name not in replaced]


def _row(cls: type[BaseSettings], name: str, field: FieldInfo, parent: type[BaseSettings] | None) -> str:
    """A field's table row; a default that replaces an inherited one names the one it replaces."""
    default = _default(name, field.default)
    if parent is not None and name in parent.model_fields:
        default += f" ({parent.__name__}: {_default(name, parent.model_fields[name].default)})"
    cells = [f"`{env_var(cls, name, field)}`", _type(field), default, field.description or ""]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def env_var(cls: type[BaseSettings], name: str, field: FieldInfo) -> str:
    """The environment variable a field is read from: its own alias, or the class's prefix and its name."""
    if isinstance(field.validation_alias, str):
        return field.validation_alias
    return f"{cls.model_config.get('env_prefix', '')}{name}".upper()


def _type(field: FieldInfo) -> str:
    """The field's type as a reader gives it: the Python type, its choices, its bounds, whether it may be unset."""
    bounds = []
    for constraint in field.metadata:
        if type(constraint) in BOUNDS:
            symbol, attribute = BOUNDS[type(constraint)]
            bounds.append(f"{symbol} {getattr(constraint, attribute)}")
    text = _annotation(field.annotation)
    return text + (f" ({', '.join(bounds)})" if bounds else "")


def _annotation(annotation: Any) -> str:
    """`int`, `Path (optional)`, `one of none, console`: a type without Python's punctuation (no `|` in a table)."""
    origin = get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{choice}`" for choice in get_args(annotation))
    if origin in (Union, types.UnionType):
        present = [arg for arg in get_args(annotation) if arg is not type(None)]
        return " or ".join(_annotation(arg) for arg in present) + " (optional)"
    return f"`{getattr(annotation, '__name__', annotation)}`"


def _default(name: str, value: Any) -> str:
    """A default as it would be written in the environment; a path under the home folder as `~/…`, whoever runs
    this, and a byte count with its size in KiB or MiB."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "":
        return "empty"
    if isinstance(value, Path) and value.is_relative_to(Path.home()):
        return f"`~/{value.relative_to(Path.home())}`"
    text = f"`{value}`"
    if name.endswith("_bytes") and isinstance(value, int):
        for unit, size in (("MiB", 1024 * 1024), ("KiB", 1024)):
            if value >= size and value % size == 0:
                return f"{text} ({value // size} {unit})"
    return text
