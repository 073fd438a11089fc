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

import functools
import json
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt
import pybase64

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
        little = np.asarray(array, dtype=array.dtype.newbyteorder("<"))  # tobytes: C order; 0-d kept 0-d
        return cls(name, tuple(int(n) for n in little.shape), little.tobytes())

    @classmethod
    def bfloat16(cls, array: npt.NDArray[Any]) -> WireTensor:
        """Floating values cast to bfloat16 by torch itself (`tensor.to(torch.bfloat16)`, which vLLM applies to a
        processor's floating outputs for a model served in bfloat16: round to nearest, ties to even), so the bits
        are vLLM's by construction. torch is loaded where pictures are rendered (the image processor's torchvision
        backend runs on it), and its cast is 6x cheaper than the same rounding spelled in numpy."""
        import torch  # heavy: only the processes that render pictures cast

        values = torch.from_numpy(np.ascontiguousarray(array, dtype="<f4"))
        bits = values.to(torch.bfloat16).view(torch.int16).numpy()
        return cls("bfloat16", tuple(int(n) for n in bits.shape), bits.tobytes())

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
    return pybase64.b64encode(item_bytes(item)).decode("ascii")


@dataclass(frozen=True)
class Repeat:
    """A tensor's bytes that are one value's bytes over and over (a mask of ones): written out only as base64."""

    unit: bytes
    count: int

    def __len__(self) -> int:
        return len(self.unit) * self.count


@dataclass(frozen=True)
class Mapped:
    """A tensor's bytes that are a table's entries looked up by 8-bit values: a picture's pixel values, each the
    processor's rescaled and normalised 8-bit pixel cast to the served model's dtype, are its channel's entry for
    that pixel. `indices` hold the tensor's values in its order, `plane` of them in a row for one channel (a tile's
    height × width), the channels in turn; `tables` per channel 256 entries of `width` bytes. Spelled out only where
    the item's text is written, a plane at a time (`planes`)."""

    indices: memoryview
    tables: bytes
    plane: int
    width: int

    def __len__(self) -> int:
        return len(self.indices) * self.width

    def planes(self) -> Iterator[memoryview]:
        """The tensor's bytes, a plane at a time: each plane's 8-bit values looked up in its channel's table, two
        at a time where the plane's length is even (a table of pairs: half the lookups). Each plane is written
        into the same buffer: it holds one plane until the next is asked for."""
        indices = np.frombuffer(self.indices, dtype=np.uint8).reshape(-1, self.plane)
        if self.plane % 2 == 0 and self.width <= 4:
            tables, indices = _pairs(self.tables, self.width), indices.view("<u2")
        else:
            tables = np.frombuffer(self.tables, dtype=f"<u{self.width}").reshape(-1, 256)
        out = np.empty(indices.shape[1], dtype=tables.dtype)  # one buffer: a fresh one a plane costs its pages
        for number, plane in enumerate(indices):
            tables[number % len(tables)].take(plane, mode="clip", out=out)  # clip: no checked (slower) path
            yield memoryview(out.data).cast("B")


@functools.lru_cache(maxsize=8)
def _pairs(tables: bytes, width: int) -> npt.NDArray[Any]:
    """Per channel, the entries of every pair of 8-bit values (65,536: the pair read as a little-endian 16-bit
    index), each the two values' entries one after the other; made once per set of tables (a model's)."""
    singles = np.frombuffer(tables, dtype=f"<u{width}").reshape(-1, 256).astype(f"<u{2 * width}")
    pair = np.arange(1 << 16)
    paired: npt.NDArray[Any] = singles[:, pair & 0xFF] | (singles[:, pair >> 8] << (8 * width))
    return paired


#: A tensor's bytes as an item's text is made from them: as they are, a view of a cache entry, a repeat, or 8-bit
#: values looked up in a table.
TensorBytes = bytes | memoryview | Repeat | Mapped


@dataclass(frozen=True)
class ItemTensor:
    """One key of an item, as `item_text` writes it: the tensor's dtype (torch's name), shape, bytes and field."""

    key: str
    dtype: str
    shape: Sequence[int]
    data: TensorBytes
    field: list[Any]


@dataclass(frozen=True, eq=False)
class Base64Text:
    """Base64 text as ASCII bytes in pieces, written one after the other: an item's text is megabytes, and is never
    joined on its way into an answer. Equal when the texts are."""

    pieces: tuple[bytes, ...]

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Base64Text) and bytes(self) == bytes(other)

    __hash__ = None  # type: ignore[assignment]  # equal by value, and not frozen in value: no hash

    def decode(self) -> str:
        """The text as a str."""
        return bytes(self).decode("ascii")


class Base64Stream:
    """Base64 of a byte stream written in parts, each part encoded as it comes (whole 3-byte groups; up to two bytes
    carried to the next part), and a part that repeats a unit encoded once per period. By hand: no base64 library
    encodes a stream in parts or a repeat without spelling it out, and an item is its msgpack framing around
    tensors of megabytes, one of them (a mask of ones) the same 8 bytes a million times."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self._carry = b""

    def write(self, data: bytes | memoryview) -> None:
        """Encode `data` after what was written."""
        view = memoryview(data).cast("B")
        if self._carry:
            head = self._carry + bytes(view[: 3 - len(self._carry)])
            view = view[3 - len(self._carry) :]
            if len(head) < 3:
                self._carry = head
                return
            self._pieces.append(pybase64.b64encode(head))
        whole = len(view) - len(view) % 3
        if whole:
            self._pieces.append(pybase64.b64encode(view[:whole]))
        self._carry = bytes(view[whole:])

    def write_repeated(self, repeat: Repeat) -> None:
        """Encode `repeat.unit` written `repeat.count` times: the groups of one period (3 units: a whole number of
        groups) encoded once and repeated, what is left over written as it is."""
        unit, total = repeat.unit, len(repeat)
        lead = min((3 - len(self._carry)) % 3, total)  # bytes until the stream is at a group's start again
        self.write((unit * 3)[:lead])
        turned = unit[lead % len(unit) :] + unit[: lead % len(unit)]  # the unit as it continues from there
        period = turned * 3
        periods, rest = divmod(total - lead, len(period))
        if periods:
            text = pybase64.b64encode(period)
            block = _periods(text)  # shared by every repeat of this period: never megabytes a picture
            blocks, left = divmod(periods, len(block) // len(text))
            self._pieces += [block] * blocks + ([block[: left * len(text)]] if left else [])
        self.write((turned * (rest // len(unit) + 1))[:rest])

    def text(self) -> Base64Text:
        """Everything written, padded as base64 ends."""
        tail = [pybase64.b64encode(self._carry)] if self._carry else []
        return Base64Text(tuple(self._pieces + tail))


#: The text a repeat's pieces share (`Base64Stream.write_repeated`): about 4 MiB of whole periods.
_PERIODS_BYTES = 4 << 20


@functools.lru_cache(maxsize=8)
def _periods(text: bytes) -> bytes:
    """A period's text repeated to about `_PERIODS_BYTES`, made once: a picture's mask is a few of these pieces."""
    return text * max(1, _PERIODS_BYTES // len(text))


#: msgpack's fixext 16 marker: how msgspec writes an extension of 16 bytes (`item_text`'s placeholders).
_FIXEXT16 = 0xD8


def item_text(tensors: Sequence[ItemTensor]) -> Base64Text:
    """An item's base64 text (`encode_item`'s, in pieces) made without its msgpack bytes: msgspec writes the item's
    framing with a 16-byte placeholder for each tensor's bytes, and each placeholder is replaced in the stream by
    the extension's head and the tensor's bytes, which are base64-encoded straight from where they lie."""
    marker = uuid.uuid4().bytes  # random: no shape, dtype or field can spell it
    wire = {
        t.key: {"data": [t.dtype, list(t.shape), msgspec.msgpack.Ext(RAW_VIEW, marker)], "field": t.field}
        for t in tensors
    }
    framing = msgspec.msgpack.encode(wire).split(bytes([_FIXEXT16, RAW_VIEW]) + marker)
    if len(framing) != len(tensors) + 1:
        raise ValueError("an item's framing did not keep one placeholder per tensor")
    stream = Base64Stream()
    stream.write(framing[0])
    for tensor, after in zip(tensors, framing[1:], strict=True):
        stream.write(_ext_head(len(tensor.data)))
        if isinstance(tensor.data, Repeat):
            stream.write_repeated(tensor.data)
        elif isinstance(tensor.data, Mapped):
            for plane in tensor.data.planes():
                stream.write(plane)
        else:
            stream.write(tensor.data)
        stream.write(after)
    return stream.text()


def _ext_head(length: int) -> bytes:
    """The head msgpack writes before an extension's `length` bytes of type RAW_VIEW (the smallest form that holds
    the length, as msgspec writes it)."""
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: _FIXEXT16}
    if length in fixed:
        return bytes([fixed[length], RAW_VIEW])
    for code, width in ((0xC7, 1), (0xC8, 2), (0xC9, 4)):
        if length < 1 << (8 * width):
            return bytes([code]) + length.to_bytes(width, "big") + bytes([RAW_VIEW])
    raise ValueError(f"an extension of {length} bytes is more than msgpack holds")


def item_tensors(item: KwargsItem) -> list[ItemTensor]:
    """An item's keys as `item_text` takes them."""
    return [ItemTensor(key, e.tensor.dtype, e.tensor.shape, e.tensor.data, e.field.wire()) for key, e in item.items()]


def decode_item(encoded: str) -> dict[str, ItemElement]:
    """A base64 item back to its tensors and fields (`mm_serde.decode_mm_kwargs_item`, without torch); ValueError
    for anything that is not one."""
    try:
        wire = msgspec.msgpack.decode(pybase64.b64decode(encoded, validate=True))
        return {str(key): _element(value) for key, value in wire.items()}
    except (msgspec.DecodeError, TypeError, KeyError, AttributeError, ValueError) as exc:
        raise ValueError(f"not a multimodal kwargs item: {exc}") from exc


def value_width(dtype: str) -> int:
    """Bytes a value of a dtype (torch's name) takes as it travels."""
    return 2 if dtype == "bfloat16" else _NUMPY_NAMES[dtype].itemsize


def _element(value: dict[str, Any]) -> ItemElement:
    dtype, shape, data = value["data"]
    if not isinstance(data, msgspec.msgpack.Ext) or data.code != RAW_VIEW:
        raise ValueError("a tensor that is not inline")
    tensor = WireTensor(str(dtype), tuple(int(n) for n in shape), bytes(data.data))
    if len(tensor.data) != value_width(tensor.dtype) * int(np.prod(tensor.shape, dtype=np.int64)):
        raise ValueError(f"{len(tensor.data)} bytes for a {tensor.dtype} tensor of shape {list(tensor.shape)}")
    return ItemElement(tensor, FieldSpec.from_wire(value["field"]))


def idefics3_item(tensors: Mapping[str, npt.NDArray[Any]], dtype: str = "bfloat16") -> dict[str, ItemElement]:
    """One picture's item as vLLM's Idefics3 / SmolVLM processor makes it (`idefics3_tensors`), every tensor's
    bytes spelled out."""
    return {
        t.key: ItemElement(WireTensor(t.dtype, tuple(t.shape), spelled(t.data)), FieldSpec.from_wire(t.field))
        for t in idefics3_tensors(tensors, dtype)
    }


def idefics3_tensors(tensors: Mapping[str, npt.NDArray[Any]], dtype: str = "bfloat16") -> list[ItemTensor]:
    """One picture's item as vLLM's Idefics3 / SmolVLM processor makes it (`Idefics3MultiModalProcessor`'s fields):
    `pixel_values` (tiles × 3 × side × side, floats cast to the served model's `dtype`) and `pixel_attention_mask`
    (int64), both `flat` over the picture's tiles, and `num_patches` (the tile count, 0-d int64, `batched`, kept on
    the CPU). `tensors`: the image processor's output for one picture (a leading batch of one), floats as float32,
    or 8-bit pixel values with their channels' tables (`pixel_values_table`: `ImagePreparer.eight_bit`), which
    stay 8-bit (`Mapped`) until the item's text is written. A mask of ones (every tile whole, as a picture's are
    once it is split) is a `Repeat` of one int64 one, not 8 bytes a pixel spelled out."""
    pixels = np.asarray(tensors["pixel_values"])[0]
    tiles = int(pixels.shape[0])
    spread = FieldSpec("flat", slices=(((0, tiles, None),),)).wire()
    values = _cast(pixels if pixels.dtype != np.uint8 else np.asarray(tensors["pixel_values_table"]), dtype)
    data: TensorBytes = values.data
    if pixels.dtype == np.uint8:  # 8-bit pixels and their channels' tables: looked up where the text is written
        plane = int(np.prod(pixels.shape[2:], dtype=np.int64))
        indices = memoryview(np.ascontiguousarray(pixels).data).cast("B")
        data = Mapped(indices, values.data, plane, value_width(values.dtype))
    mask = np.asarray(tensors["pixel_attention_mask"])[0]
    ones = Repeat(_int64(1), int(mask.size))
    kept = FieldSpec("batched", True).wire()
    return [
        ItemTensor("pixel_values", values.dtype, tuple(int(n) for n in pixels.shape), data, spread),
        ItemTensor("pixel_attention_mask", "int64", tuple(mask.shape), ones if mask.all() else _int64(mask), spread),
        ItemTensor("num_patches", "int64", (), _int64(tiles), kept),
    ]


def _cast(values: npt.NDArray[Any], dtype: str) -> WireTensor:
    """Floating values cast to the served model's dtype, as vLLM casts a processor's floats."""
    return WireTensor.bfloat16(values) if dtype == "bfloat16" else WireTensor.of(values.astype(dtype))


def _int64(values: Any) -> bytes:
    """Values as int64, little-endian, in C order."""
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


def spelled(data: TensorBytes) -> bytes:
    """A tensor's bytes written out (a repeat's unit as many times as it repeats, 8-bit values looked up)."""
    if isinstance(data, Repeat):
        return data.unit * data.count
    if isinstance(data, Mapped):
        return b"".join(bytes(plane) for plane in data.planes())  # each copied before the next overwrites it
    return bytes(data)


def metadata_item(item: Mapping[str, ItemElement]) -> dict[str, ItemElement]:
    """The part of an item `mm_metadata` carries: its fields kept on the CPU (`_encode_metadata_items`)."""
    return {key: element for key, element in item.items() if element.field.keep_on_cpu}


@dataclass(frozen=True)
class WireItem:
    """One picture's item in the form a render sends it: `kwargs_data` (the whole item, msgpack then base64) and
    `mm_metadata` (its fields kept on the CPU, encoded alike; None for an item without one). Made once per answer
    from the cached tensors (`stoker.adapters.render.RenderedPicture.wire`), and copied into the answer's JSON as it
    is, piece by piece (`request_json_pieces`)."""

    kwargs_data: Base64Text
    mm_metadata: Base64Text | None

    @classmethod
    def of(cls, item: KwargsItem) -> WireItem:
        """The item encoded as `features` carries it."""
        return cls.of_tensors(item_tensors(item))

    @classmethod
    def of_tensors(cls, tensors: Sequence[ItemTensor]) -> WireItem:
        """An item given as `item_text` takes it, encoded as `features` carries it."""
        metadata = [t for t in tensors if FieldSpec.from_wire(t.field).keep_on_cpu]
        return cls(item_text(tensors), item_text(metadata) if metadata else None)


#: vLLM's SamplingParams defaults that an int equal to them leaves out of its JSON (msgspec's `omit_defaults`
#: compares by identity, so a small int equal to its default is omitted, a computed float is not).
_INT_DEFAULTS = {"max_tokens": 16, "n": 1}
#: What its render's chat_template_kwargs always carry besides the generation prompt's two switches.
TEMPLATE_DEFAULTS = {"cohere_format": "cmd4"}
_GREEDY = 1e-5


def sampling_params(
    *,
    max_tokens: int,
    temperature: float,
    top_p: float | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    n: int | None = None,
    logprobs: int | None = None,
    stream: bool = False,
    tools_parsed: bool = False,
) -> dict[str, Any]:
    """`SamplingParams` as vLLM 0.33.0's render writes them in JSON for these request values (`to_sampling_params`,
    `SamplingParams.from_optional`): greedy sampling (temperature 0) drops top_p and min_p; a stop string asks for
    an output buffer of its length less one; ints equal to their defaults are left out. `tools_parsed`: the answer
    is read for tool calls (tools offered, a choice other than `none`), so its special tokens are kept for the
    parser."""
    out: dict[str, Any] = {
        "bad_words": [],
        "frequency_penalty": 0.0,
        "output_kind": 1 if stream else 2,  # RequestOutputKind.DELTA / FINAL_ONLY
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "skip_clone": True,
        "skip_reading_prefix_cache": False,
        "stop": list(stop or []),
        "stop_token_ids": [],
        "temperature": temperature,
    }
    if temperature >= _GREEDY:
        out |= {"top_p": 1.0 if top_p is None else top_p, "min_p": 0.0}
    for name, value in (("max_tokens", max_tokens), ("n", n)):
        if value is not None and value != _INT_DEFAULTS[name]:
            out[name] = value
    if seed is not None:
        out["seed"] = seed
    if logprobs is not None:
        out["logprobs"] = logprobs
    if tools_parsed:
        out["skip_special_tokens"] = False
    if stop:
        out["output_text_buffer_length"] = max(len(s) for s in stop) - 1
    return out


def features(
    hashes: list[str], placeholders: list[tuple[int, int]], items: Sequence[WireItem]
) -> dict[str, Any] | None:
    """`MultiModalFeatures` for a render's pictures (None for a render without one): their hashes, placeholder
    ranges and encoded items, each item's fields kept on the CPU again in `mm_metadata`."""
    if not hashes:
        return None
    metadata = [item.mm_metadata for item in items]
    return {
        "mm_hashes": {"image": hashes},
        "mm_placeholders": {"image": [{"offset": offset, "length": length} for offset, length in placeholders]},
        "kwargs_data": {"image": [item.kwargs_data for item in items]},
        "mm_metadata": {"image": metadata} if any(m is not None for m in metadata) else None,
    }


def request_json(request: dict[str, Any]) -> bytes:
    """A `GenerateRequest` as JSON, the very bytes Starlette's `JSONResponse` writes for it (compact, UTF-8, no
    NaN), with its items' base64 text copied in rather than scanned by the json module (`request_json_pieces`)."""
    return b"".join(request_json_pieces(request))


def request_json_pieces(request: dict[str, Any]) -> list[bytes]:
    """`request_json`'s bytes in pieces, each item's base64 text in its own pieces as they are: an answer is written
    piece by piece, never joined (a picture's item is 24 MB; four of them joined would be a 98 MB buffer). Copied rather
    than scanned by the json module: base64's alphabet needs no escaping in JSON, so the pieces are what
    `json.dumps` would have written. By hand: no JSON library takes a string as a raw piece, and msgspec or orjson
    write floats and escapes their own way."""
    marker = f"stoker-item-{uuid.uuid4().hex}"  # random: no string a caller sends can spell it
    items: list[Base64Text | str] = []
    skeleton = (
        {**request, "features": _marked(request["features"], marker, items)} if "features" in request else request
    )
    text = json.dumps(skeleton, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
    pieces = re.split(f'"{marker}:([0-9]+)"', text)
    out = [pieces[0].encode()]
    for at in range(1, len(pieces), 2):
        item = items[int(pieces[at])]
        out[-1] += b'"'
        out += [*item.pieces] if isinstance(item, Base64Text) else [item.encode("ascii")]
        out.append(b'"' + pieces[at + 1].encode())
    return out


def _marked(found: dict[str, Any] | None, marker: str, items: list[Base64Text | str]) -> dict[str, Any] | None:
    """`features` with each base64 item replaced by a marker naming its place in `items`."""
    if found is None:
        return None
    out = dict(found)
    for name in ("kwargs_data", "mm_metadata"):
        if out.get(name) is not None:
            out[name] = {kind: [_mark(v, marker, items) for v in values] for kind, values in out[name].items()}
    return out


def _mark(value: Base64Text | str | None, marker: str, items: list[Base64Text | str]) -> str | None:
    if value is None:
        return None
    items.append(value)
    return f"{marker}:{len(items) - 1}"


def parse_context(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    *,
    parallel_tool_calls: bool = True,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    history_tool_call_cnt: int = 0,
) -> dict[str, Any]:
    """`ParseContext` as vLLM's render writes it: what a generate server needs to read the answer back (tool calls
    by its parser) in `output_mode: derender`. No `tool_choice`: `auto` with tools, else `none`."""
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    template = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        **TEMPLATE_DEFAULTS,
    }
    return {
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel_tool_calls,
        "include_reasoning": True,
        "chat_template_kwargs": template,
        "history_tool_call_cnt": history_tool_call_cnt,
    }


def generate_request(
    request_id: str,
    token_ids: list[int],
    sampling: dict[str, Any],
    *,
    model: str,
    mm_features: dict[str, Any] | None = None,
    parse_context: dict[str, Any] | None = None,
    stream: bool = False,
    priority: int = 0,
    cache_salt: str | None = None,
    output_mode: str = "tokens",
) -> dict[str, Any]:
    """vLLM's `GenerateRequest` as its render answers it in JSON (every field, at its default where unused);
    `output_mode` as a generate server is asked for it (`tokens`, `text` or `derender`; a render writes `tokens`)."""
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "token_offsets": None,
        "features": mm_features,
        "content_parts": None,
        "sampling_params": sampling,
        "model": model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": output_mode,
        "parse_context": parse_context,
        "stream": stream,
        "stream_options": None,
        "cache_salt": cache_salt,
        "priority": priority,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }
