"""The decode engine's cache tensors: its layers that grow in place, the padding that lines rows up, and which
joining prompts are read together (transformers' internals, fenced here and in `stoker.adapters.backends.engine`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from stoker.adapters.backends.engine_rows import EngineRequest

#: The room a batch's cache keeps at its end, in tokens: what its rows may still generate, within these bounds.
ROOM_LEAST, ROOM_MOST = 16, 256
#: Prompts read together waste at most this share of what is read on padding (longer ones are read apart).
PADDING = 0.25


def read_groups(requests: list[EngineRequest]) -> list[list[EngineRequest]]:
    """Requests whose prompts are read together, longest first, each group's padding within `PADDING` of what it
    reads."""
    ordered = sorted(requests, key=lambda r: -_read(r))
    groups: list[list[EngineRequest]] = []
    for request in ordered:
        length = _read(request)
        group = groups[-1] if groups else None
        if group is not None:
            width = _read(group[0])
            real = sum(_read(r) for r in group) + length
            if width * (len(group) + 1) * (1 - PADDING) <= real:
                group.append(request)
                continue
        groups.append([request])
    return groups


def _read(request: EngineRequest) -> int:
    """The tokens a request's read takes: its prompt and its answer so far."""
    return len(request.prompt_ids) + len(request.generated)


@functools.cache
def growing_layer() -> Any:
    """The class of the batch's cache layers, made of its rows' caches (`parts`): each writes a step's keys and values
    into room kept at its end (made anew, larger, when it is full), where transformers' `DynamicLayer` concatenates,
    copying the whole cache at every step. Its `keys` and `values` are views of what is written. Made at first use:
    transformers is heavy."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):  # type: ignore[misc]
        def __init__(self, parts: Sequence[tuple[Any, Any]], room: int) -> None:
            super().__init__()
            self.device, self.is_initialized = parts[0][0].device, True
            self._hold(parts, room)

        def _hold(self, parts: Sequence[tuple[Any, Any]], room: int) -> None:
            """The rows of `parts` (each keys and values, rows × heads × tokens × width) one after another, each
            left-padded with zeros to the longest, written once into new tensors with `room` tokens free at
            their end (never concatenated first)."""
            length = max(int(keys.shape[2]) for keys, _ in parts)
            rows = sum(int(keys.shape[0]) for keys, _ in parts)
            keys, values = parts[0]
            self._keys = keys.new_empty((rows, keys.shape[1], length + room, keys.shape[3]))
            self._values = values.new_empty((rows, values.shape[1], length + room, values.shape[3]))
            at = 0
            for keys, values in parts:
                n, pad = int(keys.shape[0]), length - int(keys.shape[2])
                for whole, part in ((self._keys, keys), (self._values, values)):
                    whole[at : at + n, :, :pad] = 0  # padding the mask hides: zeros, never what memory held
                    whole[at : at + n, :, pad:length] = part
                at += n
            self.keys, self.values = self._keys[:, :, :length], self._values[:, :, :length]

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            length, new = int(self.keys.shape[2]), int(key_states.shape[2])
            if length + new > int(self._keys.shape[2]):
                self._hold([(self.keys, self.values)], max(new, ROOM_LEAST, length // 4))
            self._keys[:, :, length : length + new] = key_states
            self._values[:, :, length : length + new] = value_states
            self.keys, self.values = self._keys[:, :, : length + new], self._values[:, :, : length + new]
            return self.keys, self.values

    return GrowingLayer


def pad_mask(mask: Any, length: int) -> Any:
    """An attention mask (rows × tokens) left-padded with zeros to `length` tokens."""
    import torch.nn.functional as functional  # heavy: in the model's process only

    missing = length - int(mask.shape[1])
    return functional.pad(mask, (missing, 0)) if missing else mask
