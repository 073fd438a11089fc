"""Cache keys change with everything that changes a stage's output, and nothing else."""

from __future__ import annotations

from dataclasses import replace

from stoker.adapters.cache import StageCache
from stoker.adapters.store.keys import cache_key, cache_lease_key
from stoker.core.cachekeys import (
    CacheAddress,
    DecodeOutputs,
    PipelineContext,
    decode_address,
    fingerprint,
    keyframe_address,
    ocr_address,
    prompt_address,
    prompt_worth_caching,
    transcribe_address,
    vision_address,
)
from stoker.core.imaging import DecodeParams
from stoker.core.jobs import ChatTurn
from stoker.core.prompting import Attachment
from stoker.core.tenancy import SHARED_SCOPE, cache_scope
from stoker.core.tools import ToolSpec
from stoker.settings import CommonSettings
from workers.broker import free_port

SCOPE = cache_scope("acme", shared=False)


PARAMS = DecodeParams(max_pixels=90_000_000, ocr_max_side=2000)


def ocr_key(digest: str, scope: str = SCOPE, params: DecodeParams = PARAMS, langs: str = "eng") -> str:
    """The Redis key of an OCR result under these parameters (tesseract 5.3.0)."""
    return cache_key(ocr_address(digest, scope, params=params, langs=langs, tesseract="5.3.0"))


def test_ocr_language_change_misses() -> None:
    assert ocr_key("abc", langs="eng+chi_sim") != ocr_key("abc")


def test_a_tesseract_upgrade_misses() -> None:
    old = ocr_address("abc", SCOPE, params=PARAMS, langs="eng", tesseract="5.3.0")
    assert ocr_address("abc", SCOPE, params=PARAMS, langs="eng", tesseract="5.4.1") != old


def test_decode_parameters_change_decode_and_ocr_keys() -> None:
    bigger = replace(PARAMS, ocr_max_side=3000)
    assert cache_key(decode_address("abc", SCOPE, bigger)) != cache_key(decode_address("abc", SCOPE, PARAMS))
    assert ocr_key("abc", params=bigger) != ocr_key("abc")


def test_what_decode_makes_is_part_of_its_address() -> None:
    """OCR on or off, the model's image processor and the served picture's bounds each change what decode stores."""
    base = cache_key(decode_address("abc", SCOPE, PARAMS, DecodeOutputs()))
    variants = [
        DecodeOutputs(ocr=False),
        DecodeOutputs(processor="p1"),
        DecodeOutputs(picture=(1024, 0)),
        DecodeOutputs(picture=(2048, 0)),
        DecodeOutputs(render="r1"),
    ]
    keys = {cache_key(decode_address("abc", SCOPE, PARAMS, v)) for v in variants}
    assert len(keys) == len(variants)
    assert base not in keys
    assert cache_key(decode_address("abc", SCOPE, PARAMS)) == base


def test_vision_tensors_are_addressed_by_content_scope_and_processor() -> None:
    base = cache_key(vision_address("abc", SCOPE, PARAMS, "p1"))
    assert cache_key(vision_address("abc", SCOPE, PARAMS, "p2")) != base
    assert cache_key(vision_address("abd", SCOPE, PARAMS, "p1")) != base
    assert cache_key(vision_address("abc", SHARED_SCOPE, PARAMS, "p1")) != base
    assert cache_key(vision_address("abc", SCOPE, replace(PARAMS, max_pixels=10), "p1")) != base


def test_key_carries_stage_version_content_and_fingerprint() -> None:
    key = ocr_key("c0ffee")
    assert key.startswith("stoker:cache:ocr:1:c0ffee:")
    assert ocr_key("c0ffef") != key


def test_transcripts_and_keyframes_change_with_their_parameters() -> None:
    base = transcribe_address("abc", SCOPE, model="tiny.en", weights="1:2", beam=1)
    assert transcribe_address("abc", SCOPE, model="tiny.en", weights="1:3", beam=1) != base  # new weights
    assert transcribe_address("abc", SCOPE, model="tiny.en", weights="1:2", beam=5) != base
    frame = keyframe_address("abc", 0, 3, SCOPE, max_media_seconds=600)
    assert keyframe_address("abc", 1, 3, SCOPE, max_media_seconds=600) != frame
    assert keyframe_address("abc", 0, 3, SCOPE, max_media_seconds=60) != frame


def test_fingerprint_is_order_independent_and_value_sensitive() -> None:
    assert fingerprint(a=1, b="x") == fingerprint(b="x", a=1)
    assert fingerprint(a=1) != fingerprint(a=2)


def test_an_unreachable_cache_is_a_miss_not_an_error() -> None:
    cache = StageCache.connect(CommonSettings(cache_url=f"redis://127.0.0.1:{free_port()}/0"))
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


def test_each_tenant_has_its_own_entries_unless_sharing_is_on() -> None:
    acme, globex = cache_scope("acme", shared=False), cache_scope("globex", shared=False)
    assert acme != globex
    assert ocr_key("c0ffee", acme) != ocr_key("c0ffee", globex)
    leases = {cache_lease_key(decode_address("c0ffee", scope, PARAMS)) for scope in (acme, globex)}
    assert len(leases) == 2
    # Sharing: one scope for every tenant, so one tenant's result answers another's identical input.
    shared = {cache_scope(tenant, shared=True) for tenant in ("acme", "globex", "shared")}
    assert shared == {SHARED_SCOPE}
    assert cache_scope("shared", shared=False) != SHARED_SCOPE  # a tenant named "shared" stays apart
    # The content hash and the parameters still key the entry inside a scope.
    key = ocr_key("c0ffee", acme)
    assert key.startswith("stoker:cache:ocr:1:c0ffee:")
    assert ":tenant-acme:" in key
    assert ocr_key("c0ffef", acme) != key


def test_a_prompt_is_cached_per_tenant() -> None:
    context = PipelineContext(identity="i", tokenizer="t", budget=100)
    acme = prompt_address(context, "hello", [], cache_scope("acme", shared=False))
    globex = prompt_address(context, "hello", [], cache_scope("globex", shared=False))
    assert acme.digest == globex.digest  # same material
    assert cache_key(acme) != cache_key(globex)  # different owners


def test_a_short_text_only_prompt_is_tokenized_without_the_cache() -> None:
    picture = Attachment(kind="image", index=0, text="PHOTO")
    tool = ToolSpec.model_validate({"function": {"name": "lookup", "parameters": {"type": "object"}}})
    assert not prompt_worth_caching("What is 2 + 2?", [], None, (), min_chars=1024)
    assert prompt_worth_caching("x" * 1025, [], None, (), min_chars=1024)  # long enough to be worth a lookup
    assert prompt_worth_caching("Hi", [picture], None, (), min_chars=1024)  # attachments: always through it
    assert prompt_worth_caching("Hi", [], None, [tool], min_chars=1024)  # so are tools
    # A chat counts every turn's text, not its last prompt alone.
    turns = [ChatTurn(role="user", text="y" * 600), ChatTurn(role="assistant", text="z" * 600)]
    assert prompt_worth_caching("Hi", [], turns, (), min_chars=1024)
    assert not prompt_worth_caching("Hi", [], turns[:1], (), min_chars=1024)
    assert prompt_worth_caching("", [], None, (), min_chars=0)  # 0: everything through the cache


def test_the_tool_calls_a_chat_carries_count_as_its_text_does() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "x" * 1024}}
    turns = [ChatTurn(role="user", text="Hi"), ChatTurn(role="assistant", text="", tool_calls=[call])]
    assert prompt_worth_caching("Hi", [], turns, (), min_chars=1024)  # tokenized off the event loop
    answered = [ChatTurn(role="user", text="Hi"), ChatTurn(role="tool", text="ok", tool_call_id="c" * 1024)]
    assert prompt_worth_caching("Hi", [], answered, (), min_chars=1024)
    short = [
        ChatTurn(role="user", text="Hi"),
        ChatTurn(role="assistant", text="", tool_calls=[{**call, "function": {"name": "f", "arguments": "{}"}}]),
    ]
    assert not prompt_worth_caching("Hi", [], short, (), min_chars=1024)
