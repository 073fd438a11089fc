"""vLLM's wire encoding of a multimodal kwargs item, mirrored from vLLM 0.33.0 (written from its code, never imported:
stoker's venv has no vLLM).

A render (`GenerateRequest.features.kwargs_data`, `mm_metadata`) carries each picture's tensors as one
`MultiModalKwargsItem`, msgpack then base64 (`vllm/entrypoints/scale_out/token_in_token_out/mm_serde.py`), encoded by
`vllm/v1/serial_utils.py`'s `MsgpackEncoder` with every tensor inline (`size_threshold=2**62`):

    {key: {"data": [dtype, shape, Ext(3, raw bytes)], "field": [factory, {field's dataclass fields, in order}]}}

in the item's own key order; `dtype` is torch's name without `torch.` (`bfloat16`, `int64`), `shape` a list, the raw
bytes the tensor's contiguous memory (little-endian); `factory` is `flat` (`keep_on_cpu`, `slices` as nested
`[start, stop, step]`, `dim`), `batched` (`keep_on_cpu`) or `shared` (`keep_on_cpu`, `batch_size`). msgspec writes the
bytes, as vLLM's encoder does, so equal items are equal bytes. `tests/unit/test_vllm_render.py` checks this module
against an item vLLM wrote (`tests/fixtures/vllm_render`, re-recorded by `make peer`): a vLLM that changes the layout
fails it.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

#: The vLLM release whose encoding this module writes.
VLLM_VERSION = "0.33.0"
#: vLLM's msgpack extension code for a tensor's raw bytes inline (`CUSTOM_TYPE_RAW_VIEW`).
RAW_VIEW = 3

Factory = Literal["flat", "batched", "shared"]

#: numpy's dtype names as torch spells them (vLLM writes torch's); bfloat16 has no numpy dtype (`WireTensor`).
_TORCH_NAMES = {
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
}
_NUMPY_NAMES = {torch: np.dtype(name) for name, torch in _TORCH_NAMES.items()}


@dataclass(frozen=True)
class WireTensor:
    """A tensor as vLLM sends it: torch's dtype name, its shape, its contiguous bytes (little-endian)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, array: npt.NDArray[Any]) -> WireTensor:
        """A numpy array as it travels (any numpy dtype torch has under the same name)."""
        name = _TORCH_NAMES.get(array.dtype.name)
        if name is None:
            raise ValueError(f"no torch dtype for numpy's {array.dtype}")
        little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        return cls(name, tuple(int(n) for n in little.shape), little.tobytes())

    @classmethod
    def bfloat16(cls, array: npt.NDArray[Any]) -> WireTensor:
        """Floating values cast to bfloat16 as torch casts them (`tensor.to(torch.bfloat16)`, which vLLM applies to a
        processor's floating outputs for a model served in bfloat16): round to nearest, ties to even; any NaN becomes
        0xFFFF, as torch's CPU cast makes it. By hand: numpy has no bfloat16, and a CPU worker need not load torch."""
        bits = np.ascontiguousarray(array, dtype="<f4").view("<u4")
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
        rounded[np.isnan(bits.view("<f4"))] = 0xFFFF
        return cls("bfloat16", tuple(int(n) for n in bits.shape), rounded.tobytes())

    def to_numpy(self) -> npt.NDArray[Any]:
        """The values (bfloat16 widened exactly to float32)."""
        if self.dtype == "bfloat16":
            bits = np.frombuffer(self.data, dtype="<u2").astype("<u4") << 16
            return bits.view("<f4").reshape(self.shape)
        return np.frombuffer(self.data, dtype=_NUMPY_NAMES[self.dtype].newbyteorder("<")).reshape(self.shape)


@dataclass(frozen=True)
class FieldSpec:
    """How vLLM batches one key of an item (`MultiModalFieldConfig`'s factory and its field's arguments)."""

    factory: Factory
    keep_on_cpu: bool = False
    #: `flat`: the item's slices along `dim` (nested as vLLM nests them: one list per item, `[start, stop, step]`).
    slices: tuple[Any, ...] = ()
    dim: int = 0
    #: `shared`: the batch it is shared by.
    batch_size: int = 0

    def wire(self) -> list[Any]:
        """The field as vLLM encodes it: its factory, then its dataclass fields in declaration order."""
        arguments: dict[str, Any] = {"keep_on_cpu": self.keep_on_cpu}
        if self.factory == "flat":
            arguments |= {"slices": _listed(self.slices), "dim": self.dim}
        elif self.factory == "shared":
            arguments["batch_size"] = self.batch_size
        return [self.factory, arguments]

    @classmethod
    def from_wire(cls, value: list[Any]) -> FieldSpec:
        """The inverse of `wire`."""
        factory, arguments = value
        if factory not in ("flat", "batched", "shared"):
            raise ValueError(f"unknown multimodal field factory {factory!r}")
        slices = _tupled(arguments.get("slices", ()))
        return cls(
            factory,
            bool(arguments["keep_on_cpu"]),
            slices,
            int(arguments.get("dim", 0)),
            int(arguments.get("batch_size", 0)),
        )


def _listed(value: Any) -> Any:
    return [_listed(v) for v in value] if isinstance(value, (tuple, list)) else value


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, (tuple, list)) else value


@dataclass(frozen=True)
class ItemElement:
    """One key of an item: its tensor and its field."""

    tensor: WireTensor
    field: FieldSpec = field(default_factory=lambda: FieldSpec("batched"))


#: One picture's `MultiModalKwargsItem`: its keys in the processor's order.
KwargsItem = Mapping[str, ItemElement]


def item_bytes(item: KwargsItem) -> bytes:
    """The item's msgpack bytes, as vLLM's `MsgpackEncoder` writes them with every tensor inline."""
    wire = {
        key: {
            "data": [
                element.tensor.dtype,
                list(element.tensor.shape),
                msgspec.msgpack.Ext(RAW_VIEW, element.tensor.data),
            ],
            "field": element.field.wire(),
        }
        for key, element in item.items()
    }
    return msgspec.msgpack.encode(wire)


def encode_item(item: KwargsItem) -> str:
    """The item as a render carries it: msgpack, base64 (`mm_serde.encode_mm_kwargs_item`)."""
    return base64.b64encode(item_bytes(item)).decode("ascii")


def decode_item(encoded: str) -> dict[str, ItemElement]:
    """A base64 item back to its tensors and fields (`mm_serde.decode_mm_kwargs_item`, without torch); ValueError
    for anything that is not one."""
    try:
        wire = msgspec.msgpack.decode(base64.b64decode(encoded, validate=True))
        return {str(key): _element(value) for key, value in wire.items()}
    except (msgspec.DecodeError, TypeError, KeyError, AttributeError, ValueError) as exc:
        raise ValueError(f"not a multimodal kwargs item: {exc}") from exc


def _element(value: dict[str, Any]) -> ItemElement:
    dtype, shape, data = value["data"]
    if not isinstance(data, msgspec.msgpack.Ext) or data.code != RAW_VIEW:
        raise ValueError("a tensor that is not inline")
    tensor = WireTensor(str(dtype), tuple(int(n) for n in shape), bytes(data.data))
    width = 2 if tensor.dtype == "bfloat16" else _NUMPY_NAMES[tensor.dtype].itemsize
    if len(tensor.data) != width * int(np.prod(tensor.shape, dtype=np.int64)):
        raise ValueError(f"{len(tensor.data)} bytes for a {tensor.dtype} tensor of shape {list(tensor.shape)}")
    return ItemElement(tensor, FieldSpec.from_wire(value["field"]))
