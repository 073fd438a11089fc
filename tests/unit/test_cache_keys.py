"""Cache keys change with everything that changes a stage's output, and nothing else."""

from __future__ import annotations

import pytest

from stoker.cache import CacheAddress, StageCache, fingerprint
from stoker.core.imaging import DecodeParams
from stoker.settings import WorkerSettings
from tasks import preprocess, resources
from workers.broker import free_port


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch) -> WorkerSettings:
    """Worker settings the key functions will read; tests mutate them."""
    current = WorkerSettings()
    monkeypatch.setattr(resources, "settings", lambda: current)
    monkeypatch.setattr(
        resources,
        "decode_params",
        lambda: DecodeParams(
            max_pixels=current.max_image_pixels, image_size=current.image_size, ocr_max_side=current.ocr_max_side
        ),
    )
    monkeypatch.setattr(resources, "tesseract", lambda: "5.3.0")
    return current


def test_ocr_language_change_misses(settings: WorkerSettings) -> None:
    before = preprocess.ocr_address("abc")
    settings.ocr_langs = "eng+chi_sim"
    assert preprocess.ocr_address("abc").key() != before.key()


def test_decode_parameters_change_decode_and_ocr_keys(settings: WorkerSettings) -> None:
    decode, ocr = preprocess.decode_address("abc"), preprocess.ocr_address("abc")
    settings.image_size = 336
    assert preprocess.decode_address("abc").key() != decode.key()
    assert preprocess.ocr_address("abc").key() != ocr.key()


def test_key_carries_stage_version_content_and_fingerprint(settings: WorkerSettings) -> None:
    address = preprocess.ocr_address("c0ffee")
    assert address.key().startswith("stoker:cache:ocr:1:c0ffee:")
    assert preprocess.ocr_address("c0ffef").key() != address.key()


def test_fingerprint_is_order_independent_and_value_sensitive() -> None:
    assert fingerprint(a=1, b="x") == fingerprint(b="x", a=1)
    assert fingerprint(a=1) != fingerprint(a=2)


def test_an_unreachable_cache_is_a_miss_not_an_error() -> None:
    cache = StageCache.from_url(f"redis://127.0.0.1:{free_port()}/0", ttl_s=10, max_value_bytes=1024)
    address = CacheAddress("ocr", "1", "abc", "f")
    assert cache.get_json(address) is None
    assert cache.put_json(address, {"text": "x"}) is False
    with cache.single_flight(address, lease_s=1, wait_s=1) as shared:
        assert shared is None  # nobody to wait for: compute


def test_oversize_values_are_not_cached() -> None:
    cache = StageCache(None, ttl_s=10, max_value_bytes=8)
    assert cache.put_bytes(CacheAddress("decode", "1", "abc", "f"), b"0123456789") is False


def test_a_disabled_cache_always_computes() -> None:
    cache = StageCache(None, ttl_s=10, max_value_bytes=1024)
    address = CacheAddress("ocr", "1", "abc", "f")
    with cache.single_flight(address, lease_s=1, wait_s=1) as shared:
        assert shared is None
    assert cache.get_json(address) is None
    assert cache.context() is None
    assert cache.stats() == {}
