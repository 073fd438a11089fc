"""Batch collation and output splitting."""

from __future__ import annotations

import pytest

from stoker.core.batching import collate_left, strip_generated


def test_left_padding_aligns_the_ends() -> None:
    batch = collate_left([[1, 2, 3], [4]], pad_id=0)
    assert batch.input_ids == [[1, 2, 3], [0, 0, 4]]
    assert batch.attention_mask == [[1, 1, 1], [0, 0, 1]]
    assert batch.width == 3


def test_empty_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        collate_left([[1], []], pad_id=0)


def test_generated_tokens_are_cut_at_the_first_stop() -> None:
    rows = [[0, 5, 6, 7, 2, 9], [5, 6, 8, 8, 8, 8]]
    assert strip_generated(rows, prompt_width=2, stop_ids={2}) == [[6, 7], [8, 8, 8, 8]]
