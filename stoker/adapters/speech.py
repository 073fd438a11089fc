"""Speech fallbacks two temperatures at a time: once a window's greedy text has failed, each fallback try is
decoded beside the next one on a second replica of the model, so a window that fails again finds its next try
done or under way.

faster-whisper decodes a window greedily and, when the text fails its checks (too repetitive, too unlikely),
samples it again at 0.2, 0.4, … 1.0, each try after the one before (`WhisperModel.generate_with_fallback`). On the
benchmark's recordings a window that fell back to 1.0 took 1.6 to 2.5 s of one core against 0.4 to 0.6 for one that did
not: among the slowest jobs of a quiet pipeline, while the other core idled. Yet each try reads only the window's
encoder output and prompt, never the try before, so the next one can start before the current one is judged.
CTranslate2 runs one model's decodes side by side on its replicas (faster-whisper's `num_workers`) and hands them
back asynchronously; this wrapper stands where faster-whisper calls the model (`WhisperModel.model`): asked for a
fallback try, it starts the try after it too (while `room()` says a core would otherwise idle), and when
faster-whisper asks for that one, returns it. faster-whisper still judges every try and picks the text as it
always does. Most windows pass greedily, so nothing is started beside the greedy try. A try started ahead and not
asked for (the one before it passed) is left to finish on its replica: a CTranslate2 decode cannot be stopped,
and one dropped does not block.

Hand-written: neither faster-whisper nor CTranslate2 decodes a fallback ahead, and faster-whisper has no hook
around its tries but this attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stoker.adapters.metrics import ASR_LOOKAHEAD
from stoker.core import asr

#: A try's own arguments: greedy (beam) or sampled; the rest (length, prompt limits, suppression) is the window's.
_TRY_ARGUMENTS = ("beam_size", "patience", "num_hypotheses", "sampling_topk", "sampling_temperature")


def sampled_at(arguments: dict[str, Any], temperature: float) -> dict[str, Any]:
    """The arguments faster-whisper gives a try at `temperature` above 0, from those of another try of the window."""
    window = {name: value for name, value in arguments.items() if name not in _TRY_ARGUMENTS}
    sampling = {"num_hypotheses": asr.BEST_OF, "sampling_topk": 0, "sampling_temperature": temperature}
    return {**window, "beam_size": 1, **sampling}


@dataclass
class _Ahead:
    """A try started before it was asked for, and the arguments it was started with."""

    arguments: dict[str, Any]
    result: Any


class FallbackLookahead:
    """Stands in for faster-whisper's CTranslate2 model: `generate` of one window's prompt at a fallback temperature
    also starts the window's next temperature, while `room()` says a core is free for it."""

    def __init__(self, model: Any, room: Callable[[], bool]) -> None:
        self._model = model
        self._room = room
        self._window: tuple[Any, list[Any]] | None = None
        self._ahead: dict[float, _Ahead] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)  # encode, detect_language, align…: the model's own

    def generate(self, features: Any, prompts: list[Any], **arguments: Any) -> list[Any]:
        """One try of one window, as `ctranslate2.models.Whisper.generate` (a batch of one, waited for)."""
        if len(prompts) != 1 or arguments.get("asynchronous"):
            return list(self._model.generate(features, prompts, **arguments))  # not a window's try
        if self._window is None or self._window[0] is not features or self._window[1] != prompts:
            self._window, self._ahead = (features, prompts), {}  # a new window: earlier tries are not asked for
        temperature = float(arguments.get("sampling_temperature", 0.0))  # absent: the greedy (or beam) first try
        current = self._taken(temperature, arguments)
        if current is None:
            current = self._start(features, prompts, arguments)
        following = asr.next_temperature(temperature)
        # From the first fallback on: most windows pass greedily, and a try started beside theirs would be waste.
        if temperature > 0 and following is not None and following not in self._ahead and self._room():
            ahead = sampled_at(arguments, following)
            self._ahead[following] = _Ahead(ahead, self._start(features, prompts, ahead))
            ASR_LOOKAHEAD.labels("started").inc()
        return [current.result()]

    def _taken(self, temperature: float, arguments: dict[str, Any]) -> Any | None:
        """The try at `temperature` if it was started ahead with the very arguments faster-whisper asks for."""
        ahead = self._ahead.pop(temperature, None)
        if ahead is None or ahead.arguments != arguments:
            return None
        ASR_LOOKAHEAD.labels("taken").inc()
        return ahead.result

    def _start(self, features: Any, prompts: list[Any], arguments: dict[str, Any]) -> Any:
        return self._model.generate(features, prompts, asynchronous=True, **arguments)[0]


def load_whisper(path: str, *, device: str, compute_type: str, threads: int, room: Callable[[], bool] | None) -> Any:
    """A faster-whisper model on `threads` threads, with its fallback tries decoded ahead on a second replica while
    `room()` (None: one replica, no lookahead)."""
    from faster_whisper import WhisperModel  # heavy (CTranslate2): only processes that transcribe load it

    replicas = 1 if room is None else 2
    model = WhisperModel(path, device=device, compute_type=compute_type, cpu_threads=threads, num_workers=replicas)
    if room is not None:
        model.model = FallbackLookahead(model.model, room)
    return model
