"""The names of the broker queues stoker's workers consume (`celeryconfig` routes tasks onto them)."""

#: Every queue stoker's workers consume, in pipeline order (celeryconfig routes tasks onto them).
QUEUES = ("decode", "ocr", "asr", "tokenize", "infer")
CPU_QUEUES = ("decode", "ocr", "asr", "tokenize")
#: The synchronous baseline's one queue (`STOKER_PIPELINE_MODE=sync`, benchmarks only): whole jobs wait here.
SYNC_QUEUE = "sync"
