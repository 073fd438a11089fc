"""The names of the broker queues stoker's workers consume (`celeryconfig` routes tasks onto them), and how many
messages a job puts on them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

#: The bands of dense pages (`stoker.ocr_band`): a queue of their own beside `ocr`, which a worker's consumer takes
#: from in turn with every other queue (kombu rotates them), so a small page waits behind at most a band or two,
#: never behind every band of the large pages that came before it, and bands are never starved by small pages.
OCR_BANDS_QUEUE = "ocr_bands"
#: Batch lines' inference messages: a queue of their own, which the inference consumer pulls from only into room
#: interactive requests leave (`stoker.runtime.feeder`), so they never hold the prefetch an interactive request
#: needs to reach the consumer while the device runs.
INFER_BATCH_QUEUE = "infer_batch"
#: Interactive jobs' inference messages.
INFER_QUEUE = "infer"
#: The queues inference messages wait in: interactive jobs', then batch lines'.
INFER_QUEUES = (INFER_QUEUE, INFER_BATCH_QUEUE)
#: Every queue stoker's workers consume, in pipeline order (celeryconfig routes tasks onto them).
QUEUES = ("decode", "ocr", OCR_BANDS_QUEUE, "asr", "tokenize", *INFER_QUEUES)
CPU_QUEUES = ("decode", "ocr", OCR_BANDS_QUEUE, "asr", "tokenize")


def inference_depth(depths: Mapping[str, int]) -> int:
    """Inference messages waiting, interactive and batch lines together."""
    return sum(depths.get(name, 0) for name in INFER_QUEUES)


#: Completion callbacks of ended jobs (served by the CPU workers; not a stage, so not under admission limits).
CALLBACK_QUEUE = "callbacks"
#: The synchronous baseline's one queue (`STOKER_PIPELINE_MODE=sync`, benchmarks only): whole jobs wait here.
SYNC_QUEUE = "sync"

#: Stage messages per input of each kind before tokenize: decode + ocr; probe + transcribe; a video's probe and
#: transcribe plus, per keyframe, keyframe + decode + ocr (`KEYFRAME_MESSAGES`).
KIND_MESSAGES = {"image": 2, "audio": 2, "video": 2}
KEYFRAME_MESSAGES = 3


def job_messages(
    inputs: Iterable[tuple[str, bool]],
    start: Literal["preprocess", "tokenize", "infer", "render", "ended"],
    keyframes: int,
) -> int:
    """How many queue messages a job fans out into, from where it enters: its weight in a tenant's fair share.

    `inputs` are (kind, is a URL) pairs; a URL input adds its fetch. Entering at tokenize costs tokenize + infer,
    at inference one message; a render one for a single picture, else one per picture and tokenize; a render
    served from the cache none.
    """
    if start == "ended":
        return 0
    if start == "render":
        pictures = sum(kind == "image" for kind, _ in inputs)
        return 1 if pictures == 1 else pictures + 1
    if start == "infer":
        return 1
    if start == "tokenize":
        return 2
    total = 2
    for kind, is_url in inputs:
        total += KIND_MESSAGES[kind] + (KEYFRAME_MESSAGES * keyframes if kind == "video" else 0) + int(is_url)
    return total


#: Message header holding when a task message was published: a stage's broker queue wait starts there.
SENT_HEADER = "stoker_sent"
