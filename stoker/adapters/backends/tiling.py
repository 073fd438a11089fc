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

import torch
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import SizeDict


def preprocess_tiles(base: Any) -> Any:
    """A `_preprocess` for `base` (an Idefics3 torchvision processor class) that writes one picture's tiles in place,
    and hands anything else to `base`'s own."""

    def _preprocess(self: Any, images: list[list[torch.Tensor]], *args: Any, **kwargs: Any) -> Any:
        picture = None if args else _one_picture(images, kwargs)
        tiled = None if picture is None else _tiles(self, picture, kwargs)
        return base._preprocess(self, images, *args, **kwargs) if tiled is None else tiled

    return _preprocess


_STEPS = ("do_resize", "do_image_splitting", "do_pad", "do_rescale", "do_normalize")


def _one_picture(images: list[list[torch.Tensor]], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The call's only picture, when it is one 8-bit picture and every step is on; None otherwise."""
    if len(images) != 1 or len(images[0]) != 1 or not all(kwargs.get(step) for step in _STEPS):
        return None
    picture = images[0][0]
    return picture if picture.dtype == torch.uint8 and picture.dim() == 3 else None


def _tiles(self: Any, picture: torch.Tensor, kwargs: dict[str, Any]) -> BatchFeature | None:
    """What transformers' `_preprocess` answers for one picture that is split into tiles; None when it is not
    (the picture is left whole, or its sides are not whole tiles)."""
    resample, side = kwargs["resample"], kwargs["max_image_size"]["longest_edge"]
    resized = self.resize(picture.unsqueeze(0), kwargs["size"], resample=resample)
    resized = self.resize_for_vision_encoder(resized, side, resample=resample)
    _, channels, height, width = resized.shape
    if height % side or width % side or (height <= side and width <= side):
        return None
    rows, cols = height // side, width // side
    whole = self.resize(resized, SizeDict(height=side, width=side), resample=resample)
    values = torch.empty(1, rows * cols + 1, channels, side, side, dtype=torch.float32)
    for row in range(rows):
        for col in range(cols):
            tile = resized[0, :, row * side : (row + 1) * side, col * side : (col + 1) * side]
            values[0, row * cols + col].copy_(tile)  # uint8 to float32, as `.to(torch.float32)` converts
    values[0, -1].copy_(whole[0])
    mean, std, _ = self._fuse_mean_std_and_rescale_factor(
        do_normalize=True,
        image_mean=kwargs["image_mean"],
        image_std=kwargs["image_std"],
        do_rescale=True,
        rescale_factor=kwargs["rescale_factor"],
        device=values.device,
    )
    self.normalize(values, mean, std, inplace=True)
    mask = torch.ones((), dtype=torch.int64).expand(1, rows * cols + 1, side, side)
    encoding = BatchFeature(
        data={"pixel_values": values, "pixel_attention_mask": mask}, tensor_type=kwargs.get("return_tensors")
    )
    if kwargs.get("return_row_col_info"):
        encoding["rows"] = [[rows]]
        encoding["cols"] = [[cols]]
    return encoding
