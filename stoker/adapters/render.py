"""A request rendered as vLLM's render tier renders it (`/v1/chat/completions/render`, `/v1/completions/render`): the
token ids the model is given, each picture's placeholder range and its tensors in vLLM's encoding
(`stoker.adapters.vllm_render`), with the model's own tokenizer and image processor.

Unlike stoker's own prompts (`stoker.core.prompting`), a render hands the chat on as it was sent: content parts in
their order, the template's `add_generation_prompt` / `continue_final_message` as asked, tools to a template that
renders them (one that does not, ignores them, as vLLM's does: they travel in `parse_context`), no system prompt
and no budget. One difference stays on purpose: a message's text is only ever text (a string that spells
`<|im_end|>` is not the control token), where vLLM would encode it as the token.

Equal to vLLM 0.33.0's render for the corpus of `tests/fixtures/vllm_render` (token ids and placeholders; tensors
bit-equal: both run the image processor's torchvision backend).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import msgspec
import numpy as np
import numpy.typing as npt
from PIL import Image

from stoker.adapters.backends.tokenizer import PromptTokenizer, load_prompt_tokenizer
from stoker.adapters.backends.vision import ImagePreparer
from stoker.adapters.vllm_render import (
    FieldSpec,
    ItemElement,
    ItemTensor,
    Mapped,
    Repeat,
    TensorBytes,
    WireItem,
    WireTensor,
    idefics3_tensors,
    item_tensors,
    spelled,
    value_width,
)
from stoker.core.cachekeys import CacheAddress, fingerprint
from stoker.core.errors import StokerError

#: Bump when what a render makes of a picture changes (its cache entries are then missed).
VERSION = "1"
#: The part of a render's cache entry that holds a picture's rendering (`RenderedPicture.to_bytes`). It names the
#: entry's layout: "item" held the layout as JSON, then the item's msgpack bytes; "wire" the item's base64 text as
#: sent; "tensors" held `_Entry`, each tensor's raw bytes (a 0/1 integer tensor as bits); "pixels" holds `_Entry`
#: whose pixel values may be 8-bit with their channels' tables (`Mapped`), so an entry of an earlier layout is never
#: read as one of this.
ITEM = "pixels"


class _Tensor(msgspec.Struct, array_like=True, frozen=True):
    """One key of a cached item: its tensor (`bits`: an integer tensor of 0s and 1s, kept as one bit a value;
    `tables`: 8-bit values looked up in them, `plane` values a channel at a time, as `Mapped`, an entry the dtype's
    width) and its field as vLLM writes it. Read back, `data` is a view of the entry's bytes (msgspec decodes a
    memoryview without a copy)."""

    dtype: str
    shape: list[int]
    data: memoryview
    bits: bool
    field: list[Any]
    tables: bytes = b""
    plane: int = 0


class _Entry(msgspec.Struct, array_like=True, frozen=True):
    """A picture's rendering as cached: its layout and its item's keys, in the item's order."""

    layout: dict[str, Any]
    keys: list[str]
    tensors: list[_Tensor]


_ENTRIES = msgspec.msgpack.Decoder(_Entry)


class RenderedPicture:
    """One picture ready for a render: its layout (for its placeholder tokens) and its vLLM item, as a worker made
    it (`of`) or as the cache holds it (`from_bytes`); each form made from the other only when asked for. Equal
    when layout and item are."""

    def __init__(self, layout: dict[str, Any], item: dict[str, ItemElement] | None, entry: _Entry | None) -> None:
        self.layout = layout
        self._item = item
        self._entry = entry

    @classmethod
    def of(cls, layout: dict[str, Any], item: dict[str, ItemElement]) -> RenderedPicture:
        """A picture's layout and item."""
        return cls(layout, dict(item), None)

    @classmethod
    def of_tensors(cls, layout: dict[str, Any], tensors: Sequence[ItemTensor]) -> RenderedPicture:
        """A picture's layout and item as a renderer makes it (`idefics3_tensors`): kept as the cache holds it."""
        return cls(layout, None, _Entry(layout, [t.key for t in tensors], [_packed(t) for t in tensors]))

    @classmethod
    def from_bytes(cls, data: bytes) -> RenderedPicture:
        """The inverse of `to_bytes`; ValueError for anything else (msgspec's DecodeError is one)."""
        entry = _ENTRIES.decode(data)
        if len(entry.keys) != len(entry.tensors):
            raise ValueError("a cached rendering whose keys and tensors differ in number")
        return cls(entry.layout, None, entry)

    @functools.cached_property
    def item(self) -> dict[str, ItemElement]:
        """The item, each tensor's bytes spelled out (a cached mask widened again)."""
        if self._item is not None:
            return self._item
        entry = self._cached
        return {key: _unpacked(tensor) for key, tensor in zip(entry.keys, entry.tensors, strict=True)}

    @functools.cached_property
    def wire(self) -> WireItem:
        """The item encoded as a render sends it (msgpack, base64), once per reading, from the cached tensors as
        they lie: the pixel values looked up from the entry's 8-bit pixels a plane at a time (`Mapped`) or
        base64-encoded from its bytes, a mask of ones as its period's text repeated (`Repeat`), never widened.
        Made where the answer is written, not cached: the base64 text is a third larger than the tensors, a pixel
        value is 2 bytes of bfloat16 where the cache keeps its 8-bit pixel, and the pixel attention mask, a vLLM
        int64 of 0s and 1s, is 8 bytes a pixel that the cache keeps as one bit, so the cache moves a sixth of the
        bytes (4 MB, not 24 MB, a 1280×960 picture) for the lookups and the base64 (`_Entry`)."""
        entry = self._cached
        return WireItem.of_tensors([_as_sent(key, t) for key, t in zip(entry.keys, entry.tensors, strict=True)])

    def to_bytes(self) -> bytes:
        """As cached: msgpack of `_Entry`, each tensor's bytes as they travel (a mask of 0s and 1s as bits)."""
        return msgspec.msgpack.encode(self._cached)

    @functools.cached_property
    def _cached(self) -> _Entry:
        if self._entry is not None:
            return self._entry
        item = self.item
        return _Entry(self.layout, list(item), [_packed(t) for t in item_tensors(item)])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RenderedPicture) and (self.layout, self.item) == (other.layout, other.item)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RenderedPicture(layout={self.layout!r}, keys={list(self._cached.keys)!r})"


def _packed(tensor: ItemTensor) -> _Tensor:
    """A tensor as cached: an integer one whose values are all 0 or 1 as bits (np.packbits; a repeat of ones as
    bytes of ones), any other as it is."""
    data = tensor.data
    if isinstance(data, Mapped):
        return _Tensor(tensor.dtype, list(tensor.shape), data.indices, False, tensor.field, data.tables, data.plane)
    if isinstance(data, Repeat) and tensor.dtype in _INTEGERS and data.unit == _one(tensor.dtype):
        whole, rest = divmod(data.count, 8)
        bits = b"\xff" * whole + (bytes([(0xFF << (8 - rest)) & 0xFF]) if rest else b"")
        return _Tensor(tensor.dtype, list(tensor.shape), memoryview(bits), True, tensor.field)
    data = spelled(data) if isinstance(data, Repeat) else data
    if tensor.dtype in _INTEGERS and len(data):
        dtype = _INTEGERS[tensor.dtype]
        values = np.frombuffer(data, dtype=f"<u{dtype.itemsize}")  # as unsigned: a negative one is large
        if not bool((values > 1).any()):  # 0s and 1s only, in one pass
            low = np.frombuffer(data, dtype=np.uint8)[:: dtype.itemsize]  # each value's low byte: 0 or 1
            packed = np.packbits(low)  # of bytes, not of the dtype: numpy packs an int64 array 7x slower
            return _Tensor(tensor.dtype, list(tensor.shape), memoryview(packed.tobytes()), True, tensor.field)
    return _Tensor(tensor.dtype, list(tensor.shape), memoryview(data), False, tensor.field)


def _one(dtype: str) -> bytes:
    """A value of 1 in an integer dtype (torch's name), as its bytes travel."""
    return np.ones(1, dtype=_INTEGERS[dtype]).tobytes()


def _unpacked(cached: _Tensor) -> ItemElement:
    """The inverse of `_packed`: the tensor's bytes as they travel, and its field."""
    data = spelled(_as_sent("", cached).data)
    return ItemElement(WireTensor(cached.dtype, tuple(cached.shape), data), FieldSpec.from_wire(cached.field))


def _as_sent(key: str, cached: _Tensor) -> ItemTensor:
    """A cached tensor as an item's text is written from it: its bytes as they lie, bits widened to the dtype's
    values (a mask over whole tiles, as a picture's is, all ones: a repeat of one value, never spelled out)."""
    data: TensorBytes = cached.data
    if cached.tables:
        data = Mapped(cached.data, cached.tables, cached.plane, value_width(cached.dtype))
    elif cached.bits:
        count = int(np.prod(cached.shape, dtype=np.int64))
        packed = np.frombuffer(cached.data, dtype=np.uint8)
        if _all_ones(packed, count):
            data = Repeat(_one(cached.dtype), count)
        else:
            data = np.unpackbits(packed, count=count).astype(_INTEGERS[cached.dtype]).tobytes()
    return ItemTensor(key, cached.dtype, cached.shape, data, cached.field)


def _all_ones(packed: npt.NDArray[np.uint8], count: int) -> bool:
    """Whether the first `count` bits of `packed` (np.packbits' order: the first bit is a byte's highest) are all 1."""
    whole, rest = divmod(count, 8)
    if not bool((packed[:whole] == 0xFF).all()):
        return False
    return rest == 0 or int(packed[whole]) >> (8 - rest) == (1 << rest) - 1


#: Integer dtypes (torch's names) whose tensors of 0s and 1s a cache entry keeps as bits.
_INTEGERS: dict[str, np.dtype[Any]] = {
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("u1"),
}


@dataclass(frozen=True)
class Rendered:
    """A rendered prompt: its token ids and, per picture in order, where its placeholder lies (offset, length)."""

    token_ids: list[int]
    placeholders: list[tuple[int, int]] = field(default_factory=list)


class Renderer:
    """The served model's tokenizer and image processor, rendering as vLLM does for a model served in `dtype`."""

    def __init__(self, model_path: str, dtype: str = "bfloat16", tokenizer: PromptTokenizer | None = None) -> None:
        self.model_path = model_path
        self.dtype = dtype
        self.tokenizer = tokenizer or load_prompt_tokenizer(model_path)
        # 8-bit pixels and each channel's float32 table of the processor's own values, the table cast once to the
        # model's dtype as vLLM casts the values: looked up where the answer is written, the same bits
        self.preparer = ImagePreparer.load(model_path, floats="float32", eight_bit=True) if self.sees else None
        self.max_model_len = _max_model_len(Path(model_path))

    @property
    def sees(self) -> bool:
        """Whether the model reads pictures (its processor has image tokens)."""
        return self.tokenizer.images is not None

    @property
    def renders_pictures(self) -> bool:
        """Whether its pictures can be rendered as vLLM's items: the Idefics3 / SmolVLM family's processor (the one
        item layout mirrored, `idefics3_tensors`), or a model that reads no pictures."""
        return self.preparer is None or "Idefics3" in type(self.preparer.processor).__name__

    @property
    def identity(self) -> str:
        """What identifies a picture's rendering: the image processor and the dtype its floats are cast to."""
        processor = self.preparer.identity if self.preparer is not None else ""
        return f"{VERSION}.{processor}.{self.dtype}"

    def picture_hash(self, content_hash: str) -> str:
        """A picture's `mm_hash`: its content hash and this rendering's identity, so vLLM's caches key on one value
        for one picture across every stoker of the fleet."""
        return blake3.blake3(f"{content_hash}:{self.identity}".encode()).hexdigest()

    def picture_address(self, content_hash: str, decode: str, scope: str) -> CacheAddress:
        """Where a picture's rendering is cached: its content, this rendering's identity and the decode parameters
        (`decode`: their repr) that made its pixels, in the tenant's scope."""
        return CacheAddress("render", VERSION, content_hash, fingerprint(renderer=self.identity, params=decode), scope)

    def picture(self, rgb: Image.Image) -> RenderedPicture:
        """One decoded picture through the model's image processor, as vLLM's item."""
        if self.preparer is None:
            raise StokerError("this model reads no pictures", stage="render")
        prepared = self.preparer.prepare(rgb)
        return RenderedPicture.of_tensors(
            self.preparer.layout(prepared), idefics3_tensors(prepared.tensors, self.dtype)
        )

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        layouts: Sequence[dict[str, Any]] = (),
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> Rendered:
        """A chat's messages (OpenAI's, each image part already replaced by `{"type": "image"}`) rendered, the
        pictures' `layouts` in the order of their image parts."""
        shaped = [self._message(m) for m in messages]
        ids = self.tokenizer.render_template(shaped, tools, add_generation_prompt, continue_final_message)
        images = self.tokenizer.images
        if images is None:
            return Rendered(ids)
        expanded, ranges = images.expand_with_ranges(ids, list(layouts))
        return Rendered(expanded, ranges)

    def completion(self, prompt: str) -> Rendered:
        """A completion's prompt, encoded with the tokenizer's own special tokens (its BOS, where it adds one)."""
        return Rendered([int(i) for i in self.tokenizer.tokenizer.encode(prompt, add_special_tokens=True)])

    def _message(self, message: dict[str, Any]) -> dict[str, Any]:
        """A message as the template takes it: content parts for a model that sees (a string made one text part),
        text for any other (its text parts joined by newlines); a call's arguments as an object."""
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        out: dict[str, Any] = {**message}
        if self.sees:
            out["content"] = parts
        else:
            out["content"] = content if isinstance(content, str) else "\n".join(p["text"] for p in parts)
        if message.get("tool_calls"):
            out["tool_calls"] = [_with_arguments(call) for call in message["tool_calls"]]
        return out


def _with_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    with contextlib.suppress(TypeError, ValueError):  # not JSON: the template gets the text as it was sent
        function["arguments"] = json.loads(function.get("arguments") or "{}")
    return {**call, "function": function}


def _max_model_len(model_dir: Path) -> int:
    """The model's context length as vLLM reads it from its config (`max_position_embeddings`, the text model's
    for a model that sees); 2048 where the config has none."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return 2048
    text = config.get("text_config") or config
    return int(text.get("max_position_embeddings") or config.get("max_position_embeddings") or 2048)
