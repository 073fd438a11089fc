"""A transcript's timed segments as the subtitle formats OpenAI's transcriptions answer: SubRip (`srt`) and WebVTT
(`vtt`).

Written here rather than taken from a library (`srt`, `webvtt-py`): each format is a numbered or headed list of
`start --> end` cues, a dozen lines, and neither library is otherwise needed.
"""

from __future__ import annotations

from collections.abc import Sequence

from stoker.core.jobs import Segment


def timestamp(seconds: float, decimal: str) -> str:
    """`HH:MM:SS,mmm` (SubRip, `decimal` ",") or `HH:MM:SS.mmm` (WebVTT, "."), rounded to the millisecond."""
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"


def srt(segments: Sequence[Segment]) -> str:
    """SubRip: each segment a numbered cue (from 1), cues separated by a blank line."""
    cues = [
        f"{number}\n{timestamp(s.start, ',')} --> {timestamp(s.end, ',')}\n{s.text}\n"
        for number, s in enumerate(segments, start=1)
    ]
    return "\n".join(cues)


def vtt(segments: Sequence[Segment]) -> str:
    """WebVTT: the `WEBVTT` header, then each segment a cue."""
    cues = [f"{timestamp(s.start, '.')} --> {timestamp(s.end, '.')}\n{s.text}\n" for s in segments]
    return "\n".join(["WEBVTT\n", *cues])
