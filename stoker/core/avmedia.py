"""Audio and video: probe a container without decoding it, decode audio for ASR, sample keyframes by seeking."""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

import av
import numpy as np
import numpy.typing as npt

from stoker.core.errors import ImageTooLarge, MediaCorrupt, MediaEmpty, MediaTooLong
from stoker.core.media import sniff_av_format

ASR_SAMPLE_RATE = 16_000
#: FFmpeg's demuxer for each container the door admits. Media are opened as what their magic bytes said, never as
#: whatever FFmpeg would guess: to a guesser, `OggS` followed by SDP text is an RTP session (it binds the UDP port
#: the text names), and other demuxers (concat, HLS) read local files or URLs.
DEMUXERS = {
    "WAV": "wav",
    "MP3": "mp3",
    "FLAC": "flac",
    "OGG": "ogg",
    "MATROSKA": "matroska",
    "MP4": "mov",
    "MOV": "mov",
}
#: Protocols a demuxer may open besides the bytes it was given: none (no name matches "none").
NO_PROTOCOLS = {"protocol_whitelist": "none"}
#: Bump when keyframe selection changes.
KEYFRAMES_VERSION = "1"


@dataclass(frozen=True)
class MediaInfo:
    """What the container header says: enough to refuse a file before decoding a sample."""

    container: str
    duration_s: float
    audio_streams: int
    video_streams: int
    width: int | None = None
    height: int | None = None
    sample_rate: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form for JSON."""
        return asdict(self)


def open_media(data: bytes, stage: str) -> Any:
    """An FFmpeg container over the bytes, with the demuxer their magic bytes name and no protocol to open more."""
    demuxer = DEMUXERS.get(sniff_av_format(data) or "")
    if demuxer is None:
        raise MediaCorrupt("not an audio or video container that stoker reads", stage=stage)
    return av.open(io.BytesIO(data), format=demuxer, options=dict(NO_PROTOCOLS), metadata_errors="ignore")


def probe(data: bytes, max_seconds: float) -> MediaInfo:
    """Read duration and streams from the header; refuse empty, unreadable or over-long media."""
    try:
        with open_media(data, "probe") as container:
            info = _info(container)
    except (av.FFmpegError, ValueError, EOFError) as exc:
        raise MediaCorrupt(f"cannot read the container: {exc}", stage="probe") from exc
    claimed = wav_claimed_seconds(data)
    if claimed > info.duration_s:  # a WAV header may promise hours the bytes do not hold: refuse what it claims
        info = MediaInfo(**{**info.to_dict(), "duration_s": round(claimed, 3)})
    if info.duration_s > max_seconds:
        raise MediaTooLong(f"{info.duration_s:.0f}s exceeds the {max_seconds:.0f}s limit", stage="probe")
    if not info.audio_streams and not info.video_streams:
        raise MediaEmpty("no audio or video stream", stage="probe")
    if info.duration_s <= 0:
        raise MediaEmpty("the media has no duration", stage="probe")
    return info


#: From here up, a WAV chunk size is a streaming writer's placeholder, not a length.
_STREAMED_SIZE = 0x7FFF0000


def wav_claimed_seconds(data: bytes) -> float:
    """How long a WAV's header says its sound is (its `data` chunk's size over the `fmt ` byte rate); 0 for
    anything else, and for the placeholder sizes of a WAV written as a stream (0x7FFFF000, 0xFFFFFFFF: "unknown").
    FFmpeg reports no duration for a header whose data is missing, so this is read by hand."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return 0.0
    at, byte_rate = 12, 0
    while at + 8 <= len(data):
        chunk, size = data[at : at + 4], int.from_bytes(data[at + 4 : at + 8], "little")
        if chunk == b"fmt " and at + 16 <= len(data):
            byte_rate = int.from_bytes(data[at + 16 : at + 20], "little")
        if chunk == b"data":
            return size / byte_rate if byte_rate and size < _STREAMED_SIZE else 0.0
        at += 8 + size + (size & 1)
    return 0.0


def _info(container: Any) -> MediaInfo:
    audio = list(container.streams.audio)
    video = list(container.streams.video)
    first_video = video[0] if video else None
    return MediaInfo(
        container=str(container.format.name),
        duration_s=round(_duration(container), 3),
        audio_streams=len(audio),
        video_streams=len(video),
        width=int(first_video.codec_context.width) if first_video else None,
        height=int(first_video.codec_context.height) if first_video else None,
        sample_rate=int(audio[0].codec_context.sample_rate) if audio else None,
    )


def _duration(container: Any) -> float:
    if container.duration is not None and container.duration > 0:
        return float(container.duration) / float(av.time_base)
    spans = [
        float(s.duration * s.time_base) for s in container.streams if s.duration is not None and s.time_base is not None
    ]
    return float(max(spans, default=0.0))


def decode_audio(data: bytes) -> npt.NDArray[np.float32]:
    """Decode the first audio stream to 16 kHz mono float32, what Whisper models take.

    By hand rather than faster-whisper's `decode_audio`, which opens the bytes with no demuxer named and no
    protocol whitelist (see `DEMUXERS`); the resampling is the same (s16 mono, then scaled to float)."""
    try:
        with open_media(data, "transcribe") as container:
            if not container.streams.audio:
                raise MediaEmpty("no audio stream", stage="transcribe")
            resampler = av.AudioResampler(format="s16", layout="mono", rate=ASR_SAMPLE_RATE)
            chunks = [out.to_ndarray().reshape(-1) for frame in _frames(container) for out in resampler.resample(frame)]
            chunks += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    except (av.FFmpegError, ValueError, IndexError, EOFError) as exc:
        raise MediaCorrupt(f"cannot decode audio: {exc}", stage="transcribe") from exc
    samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)
    if samples.size == 0:
        raise MediaEmpty("the audio has no samples", stage="transcribe")
    return samples.astype(np.float32) / 32768.0


def _frames(container: Any) -> Any:
    """The first audio stream's frames, skipping the ones FFmpeg calls invalid (as faster-whisper does)."""
    frames = container.decode(audio=0)
    while True:
        try:
            yield next(frames)
        except StopIteration:
            return
        except av.InvalidDataError:
            continue


def keyframe_times(duration_s: float, count: int) -> list[float]:
    """count instants spread evenly over the media, each in the middle of its share."""
    if count <= 0 or duration_s <= 0:
        return []
    return [round(duration_s * (k + 0.5) / count, 3) for k in range(count)]


def extract_frame(data: bytes, at_s: float, max_pixels: int) -> tuple[float, bytes] | None:
    """The first frame at or after the keyframe before at_s, as PNG bytes with its time; None if none decodes.
    A video whose frames have more than max_pixels (the limit of an uploaded image) is refused before decoding."""
    try:
        with open_media(data, "keyframes") as container:
            if not container.streams.video:
                return None
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > max_pixels:
                raise ImageTooLarge(f"{width}×{height} frames exceed {max_pixels} pixels", stage="keyframes")
            stream.thread_type = "AUTO"
            if stream.time_base is not None:
                container.seek(int(Fraction(at_s) / stream.time_base), stream=stream, backward=True, any_frame=False)
            # Seeking lands on the keyframe before at_s; decode forward (at most one GOP) to the wanted instant.
            last = None
            for frame in container.decode(stream):
                last = frame
                if frame.time is None or frame.time >= at_s:
                    break
            if last is not None:
                buffer = io.BytesIO()
                last.to_image().save(buffer, format="PNG")
                return float(last.time if last.time is not None else at_s), buffer.getvalue()
    except (av.FFmpegError, ValueError, EOFError) as exc:
        raise MediaCorrupt(f"cannot decode video: {exc}", stage="keyframes") from exc
    return None
