"""A process keeps freed memory for its next buffers (`stoker.adapters.heap`): a buffer of megabytes, freed and made
again, comes back without the page faults of fresh memory."""

from __future__ import annotations

import resource

from stoker.adapters.heap import keep_freed_memory

SIZE = 24 * 1024 * 1024  # a 1280×960 picture's item as sent


def faults_making_a_buffer() -> int:
    """Minor page faults while a buffer of SIZE bytes is made and written whole."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = b"\x01" * SIZE
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert len(buffer) == SIZE
    return after - before


def test_freed_megabytes_are_reused_without_faults() -> None:
    assert keep_freed_memory(512)
    faults_making_a_buffer()  # the heap grows to hold it once
    assert faults_making_a_buffer() < SIZE // 4096 // 20  # fresh memory: one fault a 4 KiB page


def test_nothing_is_set_at_zero() -> None:
    assert not keep_freed_memory(0)
