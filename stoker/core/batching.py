"""Batch collation for the model: pure lists in, pure lists out (the predictor turns them into tensors)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Collated:
    """A left-padded batch: every row ends at the same position, where generation starts."""

    input_ids: list[list[int]]
    attention_mask: list[list[int]]

    @property
    def width(self) -> int:
        """Padded length of every row."""
        return len(self.input_ids[0]) if self.input_ids else 0


def collate_left(sequences: Sequence[Sequence[int]], pad_id: int) -> Collated:
    """Left-pad token sequences to the longest one, with the matching attention mask."""
    if any(len(s) == 0 for s in sequences):
        raise ValueError("cannot collate an empty sequence")
    width = max((len(s) for s in sequences), default=0)
    ids = [[pad_id] * (width - len(s)) + list(s) for s in sequences]
    mask = [[0] * (width - len(s)) + [1] * len(s) for s in sequences]
    return Collated(input_ids=ids, attention_mask=mask)


def strip_generated(rows: Sequence[Sequence[int]], prompt_width: int, stop_ids: set[int]) -> list[list[int]]:
    """The newly generated ids of each row, cut at the first stop token."""
    out: list[list[int]] = []
    for row in rows:
        new = list(row[prompt_width:])
        cut = next((i for i, t in enumerate(new) if t in stop_ids), len(new))
        out.append(new[:cut])
    return out
