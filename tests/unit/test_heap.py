"""A process keeps freed memory for its next buffers (`stoker.adapters.heap`): a buffer of megabytes, freed and made
again, comes back without the page faults of fresh memory."""

from __future__ import annotations

import resource
import subprocess
import sys

from stoker.adapters.heap import MMAP_THRESHOLD_MAX, freed_memory_environment, keep_freed_memory

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


#: Run in a process of its own (glibc fixes its most heaps once a process has eight): two threads alive together,
#: as the API's thread pool has them; the second makes a buffer after the first freed one. Prints its faults.
TWO_THREADS = """
import sys, threading
from stoker.adapters.heap import keep_freed_memory
from tests.unit.test_heap import faults_making_a_buffer
assert keep_freed_memory(512, arenas=int(sys.argv[1]))
first_done, faults = threading.Event(), []

def first():
    faults_making_a_buffer()
    first_done.set()

def second():
    bytearray(64)  # this thread has its heap before the first frees its buffer
    first_done.wait()
    faults.append(faults_making_a_buffer())

threads = [threading.Thread(target=second), threading.Thread(target=first)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(faults[0])
"""


def _faults_on_the_second_thread(arenas: int) -> int:
    done = subprocess.run(
        [sys.executable, "-c", TWO_THREADS, str(arenas)], capture_output=True, text=True, check=True, timeout=60
    )
    return int(done.stdout)


def test_a_buffer_freed_on_one_thread_is_reused_on_another_when_they_share_a_heap() -> None:
    fresh = SIZE // 4096
    assert _faults_on_the_second_thread(arenas=0) > fresh // 2  # glibc's default: a heap each, fresh memory
    assert _faults_on_the_second_thread(arenas=1) < fresh // 20


def test_a_process_stoker_starts_is_given_the_same_heap_settings_in_its_environment() -> None:
    assert freed_memory_environment(512) == {
        "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_MAX),
        "MALLOC_TRIM_THRESHOLD_": str(512 * 1024 * 1024),
    }
    assert freed_memory_environment(0) == {}
