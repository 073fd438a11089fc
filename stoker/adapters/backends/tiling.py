"""Idefics3's tiles written straight into the processor's output: the same bits as transformers' own `_preprocess`,
without its copies.

Written here because no setting of transformers avoids them. For one picture, Idefics3's torchvision processor
(transformers 5) resizes it twice, cuts the result into `max_image_size` squares (a copy of every 8-bit pixel into
planes), appends the whole picture resized to one square (another copy of all of them), converts that to float32,
normalises it, then pads every tile into a zeroed buffer of the same size (a third copy, of floats) beside a zeroed
int64 mask that it fills with ones. Here the same resizes run (transformers' own calls), each tile is converted to
float32 straight into its place in the output, and the same normalisation (`normalize` with the same fused mean and
standard deviation, in place) runs once over them: the same operations on the same values, element by element, so
the same bits (`tests/unit/test_vision.py` compares both on pictures of random sizes; the render conformance tests
compare with vLLM's recorded renders). Tiles cut from a picture sized to whole tiles are never padded, so the mask is
ones: a view of a single one, not megabytes of them. On a 1280×960 photo (five 512-px tiles), one thread, five
alternating runs of 8 pictures: 43-60 ms a picture down to 29-33 ms.

Anything else (several pictures, a picture left whole, a step turned off, a picture not in 8 bits) goes through
transformers' own code.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import SizeDict


def preprocess_tiles(base: Any, eight_bit: bool = False) -> Any:
    """A `_preprocess` for `base` (an Idefics3 torchvision processor class) that writes one picture's tiles in place,
    and hands anything else to `base`'s own. `eight_bit`: the tiles' 8-bit pixels as they are, before rescaling and
    normalising, with each channel's table of what those make of its 256 values (`pixel_values_table`, float32),
    so that the pixel values are `table[channel][pixel]`, bit for bit (the same operations on the same values)."""

    def _preprocess(self: Any, images: list[list[torch.Tensor]], *args: Any, **kwargs: Any) -> Any:
        picture = None if args else _one_picture(images, kwargs)
        tiled = None if picture is None else _tiles(self, picture, kwargs, eight_bit)
        return base._preprocess(self, images, *args, **kwargs) if tiled is None else tiled

    return _preprocess


_STEPS = ("do_resize", "do_image_splitting", "do_pad", "do_rescale", "do_normalize")


def _one_picture(images: list[list[torch.Tensor]], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The call's only picture, when it is one 8-bit picture and every step is on; None otherwise."""
    if len(images) != 1 or len(images[0]) != 1 or not all(kwargs.get(step) for step in _STEPS):
        return None
    picture = images[0][0]
    return picture if picture.dtype == torch.uint8 and picture.dim() == 3 else None


def _tiles(self: Any, picture: torch.Tensor, kwargs: dict[str, Any], eight_bit: bool) -> BatchFeature | None:
    """What transformers' `_preprocess` answers for one picture that is split into tiles (or, `eight_bit`, its 8-bit
    tiles and tables); None when it is not split (the picture is left whole, or its sides are not whole tiles)."""
    resample, side = kwargs["resample"], kwargs["max_image_size"]["longest_edge"]
    resized = self.resize(picture.unsqueeze(0), kwargs["size"], resample=resample)
    resized = self.resize_for_vision_encoder(resized, side, resample=resample)
    _, channels, height, width = resized.shape
    if height % side or width % side or (height <= side and width <= side):
        return None
    rows, cols = height // side, width // side
    whole = self.resize(resized, SizeDict(height=side, width=side), resample=resample)
    values = torch.empty(1, rows * cols + 1, channels, side, side, dtype=torch.uint8 if eight_bit else torch.float32)
    tiles = [
        resized[0, :, row * side : (row + 1) * side, col * side : (col + 1) * side]
        for row in range(rows)
        for col in range(cols)
    ]
    for number, tile in enumerate([*tiles, whole[0]]):
        _copy(values[0, number], tile)
    data = {"pixel_values": values}
    if eight_bit:  # each channel's 256 values, through the same normalisation
        data["pixel_values_table"] = torch.arange(256, dtype=torch.uint8).to(torch.float32).repeat(channels, 1, 1)
    normalised = data["pixel_values_table"] if eight_bit else values
    self.normalize(normalised, *_mean_std(self, kwargs, values.device), inplace=True)
    data["pixel_attention_mask"] = torch.ones((), dtype=torch.int64).expand(1, rows * cols + 1, side, side)
    encoding = BatchFeature(data=data, tensor_type=kwargs.get("return_tensors"))
    if kwargs.get("return_row_col_info"):
        encoding["rows"] = [[rows]]
        encoding["cols"] = [[cols]]
    return encoding


def _copy(into: torch.Tensor, tile: torch.Tensor) -> None:
    """A tile's pixels (a view of the channels-last picture) into its planes: converted to float32 as
    `.to(torch.float32)` converts, or 8-bit as they are, by numpy (a third of the CPU of torch's 8-bit copy across
    layouts: 1.7 against 5.2 ms a 1024 × 1024 picture)."""
    if into.dtype == torch.uint8:
        np.copyto(into.numpy(), tile.numpy())
    else:
        into.copy_(tile)


def _mean_std(self: Any, kwargs: dict[str, Any], device: Any) -> tuple[Any, Any]:
    """The mean and standard deviation transformers normalises by, the rescaling folded in (its own function)."""
    mean, std, _ = self._fuse_mean_std_and_rescale_factor(
        do_normalize=True,
        image_mean=kwargs["image_mean"],
        image_std=kwargs["image_std"],
        do_rescale=True,
        rescale_factor=kwargs["rescale_factor"],
        device=device,
    )
    return mean, std
