"""Cache keys change with everything that changes a stage's output, and nothing else."""

from __future__ import annotations

import pytest

from stoker.cache import CacheAddress, PipelineContext, StageCache, fingerprint, prompt_address
from stoker.core.imaging import DecodeParams
from stoker.settings import WorkerSettings
from stoker.tenancy import SHARED_SCOPE, cache_scope
from tasks import preprocess, resources
from workers.broker import free_port

SCOPE = cache_scope("acme", shared=False)


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
    before = preprocess.ocr_address("abc", SCOPE)
    settings.ocr_langs = "eng+chi_sim"
    assert preprocess.ocr_address("abc", SCOPE).key() != before.key()


def test_decode_parameters_change_decode_and_ocr_keys(settings: WorkerSettings) -> None:
    decode, ocr = preprocess.decode_address("abc", SCOPE), preprocess.ocr_address("abc", SCOPE)
    settings.image_size = 336
    assert preprocess.decode_address("abc", SCOPE).key() != decode.key()
    assert preprocess.ocr_address("abc", SCOPE).key() != ocr.key()


def test_key_carries_stage_version_content_and_fingerprint(settings: WorkerSettings) -> None:
    address = preprocess.ocr_address("c0ffee", SCOPE)
    assert address.key().startswith("stoker:cache:ocr:1:c0ffee:")
    assert preprocess.ocr_address("c0ffef", SCOPE).key() != address.key()


def test_fingerprint_is_order_independent_and_value_sensitive() -> None:
    assert fingerprint(a=1, b="x") == fingerprint(b="x", a=1)
    assert fingerprint(a=1) != fingerprint(a=2)


def test_an_unreachable_cache_is_a_miss_not_an_error() -> None:
    cache = StageCache.from_url(f"redis://127.0.0.1:{free_port()}/0", ttl_s=10, max_value_bytes=1024)
    address = CacheAddress("ocr", "1", "abc", "f", SCOPE)
    assert cache.get_json(address) is None
    assert cache.put_json(address, {"text": "x"}) is False
    with cache.single_flight(address, lease_s=1, wait_s=1) as shared:
        assert shared is None  # nobody to wait for: compute


def test_oversize_values_are_not_cached() -> None:
    cache = StageCache(None, ttl_s=10, max_value_bytes=8)
    assert cache.put_bytes(CacheAddress("decode", "1", "abc", "f", SCOPE), b"0123456789") is False


def test_a_disabled_cache_always_computes() -> None:
    cache = StageCache(None, ttl_s=10, max_value_bytes=1024)
    address = CacheAddress("ocr", "1", "abc", "f", SCOPE)
    with cache.single_flight(address, lease_s=1, wait_s=1) as shared:
        assert shared is None
    assert cache.get_json(address) is None
    assert cache.context() is None
    assert cache.stats() == {}


def test_each_tenant_has_its_own_entries_unless_sharing_is_on(settings: WorkerSettings) -> None:
    acme, globex = cache_scope("acme", shared=False), cache_scope("globex", shared=False)
    assert acme != globex
    assert preprocess.ocr_address("c0ffee", acme).key() != preprocess.ocr_address("c0ffee", globex).key()
    assert preprocess.decode_address("c0ffee", acme).lease != preprocess.decode_address("c0ffee", globex).lease
    # Sharing: one scope for every tenant, so one tenant's result answers another's identical input.
    shared = {cache_scope(tenant, shared=True) for tenant in ("acme", "globex", "shared")}
    assert shared == {SHARED_SCOPE}
    assert cache_scope("shared", shared=False) != SHARED_SCOPE  # a tenant named "shared" stays apart
    # The content hash and the parameters still key the entry inside a scope.
    key = preprocess.ocr_address("c0ffee", acme).key()
    assert key.startswith("stoker:cache:ocr:1:c0ffee:")
    assert ":tenant-acme:" in key
    assert preprocess.ocr_address("c0ffef", acme).key() != key


def test_a_prompt_is_cached_per_tenant() -> None:
    context = PipelineContext(identity="i", tokenizer="t", budget=100)
    acme = prompt_address(context, "hello", [], cache_scope("acme", shared=False))
    globex = prompt_address(context, "hello", [], cache_scope("globex", shared=False))
    assert acme.digest == globex.digest  # same material
    assert acme.key() != globex.key()  # different owners
