"""The vision-language backend on the tiny VLM: prepared tensors in, the model's own answer out, and each picture's
vision embeddings computed once for the fleet (this worker's memory, then the shared store in the cache Redis)."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from prometheus_client import REGISTRY

from stoker.adapters.backends.calls import EngineRun
from stoker.adapters.backends.remote import OpenAIPredictor
from stoker.adapters.backends.vision import ImagePreparer, PreparedImage
from stoker.adapters.backends.vlm import VisionEncoder, VisionLanguagePredictor
from stoker.adapters.embeddings import EmbeddingCache, SharedEmbeddings, model_identity
from stoker.adapters.metrics import VISION_EMBEDDING_STORE_FAILURES
from stoker.adapters.store.keys import EMBEDDINGS_EVICTIONS_KEY, EMBEDDINGS_INDEX_KEY
from stoker.core.errors import ImageFeaturesMismatch, ImageTensorsMissing
from stoker.core.imaging import DecodeParams, decode_rgb
from stoker.core.model import Continued, GenerationParams, ModelRequest, Prediction, run_predictor
from stoker.core.tenancy import cache_scope
from stoker.settings import WorkerSettings
from tests.fakeopenai import fake_openai_server
from tests.media import text_image

#: The model runs in this process: these tests run beside no other that does (tests/conftest.py).
pytestmark = pytest.mark.real_model

TOKENS = 4
#: Wide pictures: 1 × 2 tiles and the whole, 192 image tokens (a CPU runs them through the model quickly).
WIDE = (800, 200)
PROMPTS = ("What does it say?", "Describe the picture.")


class Pictures:
    """Prepared tensors by content hash, as the CPU workers leave them (safetensors bytes), counting reads."""

    def __init__(self, preparer: ImagePreparer) -> None:
        self.preparer = preparer
        self.rgb: dict[str, Any] = {}
        self.stored: dict[str, bytes] = {}
        self.reads = 0

    def add(self, text: str, size: tuple[int, int]) -> str:
        digest = uuid.uuid4().hex
        self.rgb[digest] = decode_rgb(text_image(text, size=size), DecodeParams())
        self.stored[digest] = self.preparer.prepare(self.rgb[digest]).to_bytes()
        return digest

    def __call__(self, digest: str, scope: str) -> PreparedImage | None:
        self.reads += 1
        raw = self.stored.get(digest)
        return PreparedImage.from_bytes(raw) if raw is not None else None


@pytest.fixture(scope="module")
def shared(store_redis: redis.Redis[bytes]) -> Iterator[SharedEmbeddings]:
    """The shared vision-embeddings store in the test cache Redis."""
    client = redis.Redis.from_url(os.environ["STOKER_CACHE_URL"])
    yield SharedEmbeddings(client, max_bytes=256 * 1024**2, ttl_s=600)
    client.close()


@pytest.fixture(scope="module")
def pictures(tiny_vlm: Path) -> Pictures:
    preparer = ImagePreparer.load(tiny_vlm)
    assert preparer is not None
    return Pictures(preparer)


def _caches(shared: SharedEmbeddings, salt: str) -> Any:
    # each test module run its own identity: a previous run's entries in the cache Redis never answer for this one
    return lambda identity: EmbeddingCache(f"{identity}-{salt}", local_bytes=64 * 1024**2, shared=shared)


@pytest.fixture(scope="module")
def salt() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def predictor(tiny_vlm: Path, pictures: Pictures, shared: SharedEmbeddings, salt: str) -> VisionLanguagePredictor:
    threads = WorkerSettings().torch_threads  # the suite's (tests/conftest.py), for this process's torch
    loaded = VisionLanguagePredictor(
        str(tiny_vlm), prepared=pictures, caches=_caches(shared, salt), max_new_tokens=TOKENS, threads=threads
    )
    loaded.setup("cpu")
    return loaded


@pytest.fixture(scope="module")
def processor(tiny_vlm: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vlm)


def _chat(processor: Any, text: str, images: int) -> dict[str, Any]:
    content = [*({"type": "image"} for _ in range(images)), {"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return {"prompt": prompt}


def _in_process(predictor: VisionLanguagePredictor, processor: Any, text: str, rgbs: list[Any]) -> list[int]:
    """What a user writes: the model's processor on the raw pictures, then the model's generate (greedy)."""
    chat = _chat(processor, text, len(rgbs))
    inputs = processor(text=chat["prompt"], images=rgbs or None, return_tensors="pt")
    with torch.inference_mode():
        out = predictor._model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    new: list[int] = out[0, inputs["input_ids"].shape[1] :].tolist()
    return new


def _request(processor: Any, text: str, pictures: Pictures, digests: list[str]) -> ModelRequest:
    """The job as tokenize hands it to the model: ids with the placeholders expanded, pictures by content hash."""
    chat = _chat(processor, text, len(digests))
    rgbs = [pictures.rgb[d] for d in digests]
    ids = processor(text=chat["prompt"], images=rgbs or None)["input_ids"][0]
    return ModelRequest(list(ids), images=digests, scope="shared", params=GenerationParams(max_tokens=TOKENS))


def _answer(predictor: VisionLanguagePredictor, request: ModelRequest) -> Prediction:
    (answer,) = run_predictor(predictor, [request])
    assert isinstance(answer, Prediction), answer
    return answer


def _generated(predictor: VisionLanguagePredictor, request: ModelRequest) -> tuple[Prediction, list[int]]:
    """One request through the hook contract: its answer, and the token ids the model generated for it."""
    batch, generated = predictor.predict(predictor.batch([request]))
    assert generated is not None
    (answer,) = predictor.unbatch((batch, generated))
    assert isinstance(answer, Prediction), answer
    if isinstance(generated, EngineRun):  # the decode engine's row, with the end of sequence generate writes
        (row,) = generated.finished[0].rows
        return answer, [*row.tokens, *([row.end_token] if row.end_token is not None else [])]
    return answer, generated.rows[0][batch.local.collated.width :]


def _sample(counter: Any, op: str) -> float:
    value = REGISTRY.get_sample_value(f"{counter._name}_total", {"op": op})
    return float(value or 0.0)


def test_the_answer_is_the_models_own_on_the_raw_picture_and_a_repeat_skips_the_encoder(
    predictor: VisionLanguagePredictor, processor: Any, pictures: Pictures
) -> None:
    digest = pictures.add("HELLO", WIDE)
    first, tokens = _generated(predictor, _request(processor, PROMPTS[0], pictures, [digest]))
    assert tokens == _in_process(predictor, processor, PROMPTS[0], [pictures.rgb[digest]])
    assert first.completion_tokens > 0
    assert first.encoder == {digest: "miss"}
    calls, reads = predictor.encoder.calls, pictures.reads

    # the same picture, another prompt: no encoder run, no tensors read, the answer an uncached run gives
    second, tokens = _generated(predictor, _request(processor, PROMPTS[1], pictures, [digest]))
    assert (predictor.encoder.calls, pictures.reads) == (calls, reads)
    assert second.encoder == {digest: "hit"}
    assert tokens == _in_process(predictor, processor, PROMPTS[1], [pictures.rgb[digest]])

    # another picture misses
    other = pictures.add("WORLD", WIDE)
    assert predictor.encoder.embeddings(other, "shared")[1] == "miss"
    assert predictor.encoder.calls == calls + 1


def test_a_mixed_batch_gives_each_request_its_solo_answer_and_a_broken_one_fails_alone(
    predictor: VisionLanguagePredictor, processor: Any, pictures: Pictures
) -> None:
    one, two = pictures.add("RED SHOE", WIDE), pictures.add("42", (200, 800))
    text_only = _request(processor, "Say hello.", pictures, [])
    both = _request(processor, "Compare them.", pictures, [one, two])  # two pictures in one job
    gone = ModelRequest(both.prompt_ids, images=["0" * 32, two], scope="shared", params=both.params)
    unplaced = [t for t in both.prompt_ids if t != predictor.image_token_id]  # placeholders lost
    short = ModelRequest(unplaced, images=[one, two], scope="shared", params=both.params)
    foreign = pictures.add("42", (200, 800))  # prepared by another processor (another config, another model)
    made = PreparedImage.from_bytes(pictures.stored[foreign])
    pictures.stored[foreign] = PreparedImage(made.tensors, {**made.meta, "processor": "another"}).to_bytes()
    alien = ModelRequest(both.prompt_ids, images=[one, foreign], scope="shared", params=both.params)

    together = run_predictor(predictor, [text_only, gone, both, short, alien])
    assert isinstance(together[1], ImageTensorsMissing)
    assert isinstance(together[3], ImageFeaturesMismatch)
    assert isinstance(together[4], ImageFeaturesMismatch)
    answered = [together[0], together[2]]
    assert all(isinstance(a, Prediction) for a in answered), answered
    # each answered as it is alone: the text-only job by itself, the two-picture job as the model in-process
    assert together[0] == _answer(predictor, text_only)
    rgbs = [pictures.rgb[one], pictures.rgb[two]]
    expected = predictor._tokenizer.decode(
        _in_process(predictor, processor, "Compare them.", rgbs), skip_special_tokens=True
    )
    assert together[2].text == expected  # type: ignore[union-attr]


def test_a_restarted_worker_hits_the_shared_store_and_another_model_misses(
    tiny_vlm: Path,
    predictor: VisionLanguagePredictor,
    processor: Any,
    pictures: Pictures,
    shared: SharedEmbeddings,
    salt: str,
    tmp_path: Path,
) -> None:
    digest = pictures.add("SHARED", WIDE)
    computed, use = predictor.encoder.embeddings(digest, "shared")
    assert use == "miss"

    restarted = VisionLanguagePredictor(
        str(tiny_vlm), prepared=pictures, caches=_caches(shared, salt), max_new_tokens=TOKENS
    )
    restarted.setup("cpu")
    reads = pictures.reads
    batch = restarted.batch([_request(processor, PROMPTS[0], pictures, [digest])])
    assert (batch.encoder, restarted.encoder.calls, pictures.reads) == ({0: {digest: "hit"}}, 0, reads)
    assert torch.equal(batch.features[0][0], computed)  # exactly what the first worker computed (its one picture)

    # Another model's identity finds nothing; the same files elsewhere (another host's path, other mtimes) do.
    assert predictor.encoder.cache is not None
    other_model = EmbeddingCache(predictor.encoder.cache.identity + "x", local_bytes=0, shared=shared)
    assert other_model.get(digest, "shared") is None
    copy = tmp_path / "copy"
    copy.mkdir()
    for item in tiny_vlm.iterdir():
        if item.suffix == ".safetensors":
            (copy / item.name).symlink_to(item)
        else:
            shutil.copy(item, copy / item.name)
    os.utime(copy / "config.json", (1, 1))
    assert model_identity(copy) == model_identity(tiny_vlm)
    config = (copy / "config.json").read_text()
    (copy / "config.json").write_text(config.replace('"scale_factor": 4', '"scale_factor": 2'))
    assert model_identity(copy) != model_identity(tiny_vlm)


def test_a_tenant_never_hits_the_embeddings_of_another_tenants_picture_unless_the_cache_is_shared(
    predictor: VisionLanguagePredictor, pictures: Pictures, shared: SharedEmbeddings
) -> None:
    digest = pictures.add("TENANTS", WIDE)
    alpha, beta = cache_scope("alpha", shared=False), cache_scope("beta", shared=False)
    encoder = predictor.encoder
    assert [encoder.embeddings(digest, alpha)[1] for _ in range(2)] == ["miss", "hit"]
    calls = encoder.calls
    assert encoder.embeddings(digest, beta)[1] == "miss"  # alpha's picture: beta's job shows no sign of it
    assert encoder.calls == calls + 1
    # the fleet's store is scoped as this worker's memory is: a restarted worker finds alpha's for alpha alone
    assert encoder.cache is not None
    restarted = EmbeddingCache(encoder.cache.identity, local_bytes=0, shared=shared)
    assert restarted.get(digest, alpha) is not None
    assert restarted.get(digest, cache_scope("gamma", shared=False)) is None
    # STOKER_CACHE_SHARED: every tenant in one scope, and one tenant's picture saves another the encoder
    assert encoder.embeddings(digest, cache_scope("alpha", shared=True))[1] == "miss"
    assert encoder.embeddings(digest, cache_scope("beta", shared=True))[1] == "hit"


def test_the_shared_store_stays_under_its_cap_and_counts_evictions(shared: SharedEmbeddings) -> None:
    small = SharedEmbeddings(shared.redis, max_bytes=250_000, ttl_s=600)
    identity = uuid.uuid4().hex
    # the cap is the whole store's: what other tests left there (each entry over this cap) goes first
    before, left = small.evictions(), int(shared.redis.zcard(EMBEDDINGS_INDEX_KEY))
    tensors = {f"p{i}": torch.full((64, 576), float(i)) for i in range(3)}  # ~147 kB each as float32
    for digest, tensor in tensors.items():
        EmbeddingCache(identity, local_bytes=0, shared=small).put(digest, "shared", tensor)
    fresh = EmbeddingCache(identity, local_bytes=0, shared=small)
    assert fresh.get("p0", "shared") is None
    assert fresh.get("p1", "shared") is None
    assert torch.equal(fresh.get("p2", "shared"), tensors["p2"])  # read back exactly
    assert small.evictions() == before + left + 2
    assert shared.redis.zscore(EMBEDDINGS_INDEX_KEY, f"stoker:vision-embeddings:{identity}:shared:p2") is not None
    assert int(shared.redis.get(EMBEDDINGS_EVICTIONS_KEY) or 0) >= 2


def test_a_failing_store_costs_only_the_recomputation(predictor: VisionLanguagePredictor, pictures: Pictures) -> None:
    dead = SharedEmbeddings(redis.Redis(port=1, socket_connect_timeout=0.2), max_bytes=10**6, ttl_s=60)
    encoder = predictor.encoder
    saved = encoder.cache
    failures = {op: _sample(VISION_EMBEDDING_STORE_FAILURES, op) for op in ("read", "write")}
    encoder.cache = EmbeddingCache("dead", local_bytes=0, shared=dead)
    try:
        digest = pictures.add("NO STORE", WIDE)
        features, use = encoder.embeddings(digest, "shared")
        assert use == "miss"
        assert torch.equal(features, encoder.encode(pictures(digest, "shared")))  # type: ignore[arg-type]
    finally:
        encoder.cache = saved
    # one read (the lookup) and one write (the computed embeddings) failed, and were counted
    assert {op: _sample(VISION_EMBEDDING_STORE_FAILURES, op) for op in failures} == {
        op: n + 1 for op, n in failures.items()
    }


def test_the_openai_backend_sends_the_cached_embeddings_as_vllm_reads_them(
    tiny_vlm: Path,
    predictor: VisionLanguagePredictor,
    processor: Any,
    pictures: Pictures,
    shared: SharedEmbeddings,
    salt: str,
) -> None:
    digest = pictures.add("EMBEDS", (600, 400))
    embedder = VisionEncoder(str(tiny_vlm), pictures, _caches(shared, salt))
    request = ModelRequest([1], [{"role": "user", "content": "What is it?"}], [digest], "shared")
    with fake_openai_server() as server:
        remote = OpenAIPredictor(server.url, "fake-vlm", max_new_tokens=TOKENS, embedder=embedder)
        remote.setup("cpu")
        try:
            (first,) = run_predictor(remote, [request])
            (second,) = run_predictor(remote, [request])
        finally:
            remote.close()
    assert isinstance(first, Prediction)
    assert isinstance(second, Prediction)
    assert (first.encoder, second.encoder, embedder.calls) == ({digest: "miss"}, {digest: "hit"}, 1)
    parts = server.bodies[0]["messages"][-1]["content"]
    (embeds,) = [p for p in parts if p["type"] == "image_embeds"]
    assert embeds["uuid"] == digest
    sent = torch.load(io.BytesIO(base64.b64decode(embeds["image_embeds"])), weights_only=True)
    expected, _ = predictor.encoder.embeddings(digest, "shared")
    tiles = pictures(digest, "shared").tensors["pixel_values"].shape[1]  # type: ignore[union-attr]
    assert sent.shape == expected.shape == (tiles * 64, predictor._model.config.text_config.hidden_size)
    assert sent.dtype == expected.dtype == predictor._model.dtype
    assert torch.equal(sent, expected)
    assert server.embeds == [(tuple(sent.shape), str(sent.dtype))] * 2
    # vLLM takes image_embeds in one message of a request: pictures on two turns go as pictures
    turns = [{"role": "user", "content": "a", "images": [digest]}, {"role": "user", "content": "b", "images": [digest]}]
    body = remote.body(ModelRequest([1], turns, [digest, digest], "shared"))
    assert "image_embeds" not in json.dumps(body)
    # what the model cannot read never leaves: another width, part of a tile, another dtype, another rank
    for wrong in (sent[:, :-1], sent[:-1], sent.to(torch.float16), sent[None]):
        with pytest.raises(ImageFeaturesMismatch):
            embedder.check(wrong)


def test_an_answer_going_on_in_the_next_call_is_not_encoded_again(
    tiny_vlm: Path, processor: Any, pictures: Pictures
) -> None:
    """No embeddings cache (a worker's first sight of the picture): a request set aside with its KV cache at a yield
    point comes back in the next call without its picture running through the encoder again, and its answer is
    the one a call that never stopped gives."""
    threads = WorkerSettings().torch_threads
    yielding = VisionLanguagePredictor(
        str(tiny_vlm),
        prepared=pictures,
        caches=lambda identity: None,
        max_new_tokens=8,
        yield_tokens=2,
        threads=threads,
    )
    yielding.setup("cpu")
    yielding.yield_to(lambda: 0, max_rows=4)
    digest = pictures.add("GOING", WIDE)
    long = replace(_request(processor, PROMPTS[0], pictures, [digest]), params=GenerationParams(max_tokens=8))
    short = replace(long, params=GenerationParams(max_tokens=2))
    done, going = run_predictor(yielding, [short, long])  # the short answer ends at the first yield point
    assert isinstance(done, Prediction)
    assert isinstance(going, Continued)
    assert yielding.encoder.calls == 2  # no cache: each request's picture
    (went_on,) = run_predictor(yielding, [long.continued(going)])
    assert isinstance(went_on, Prediction)
    assert yielding.encoder.calls == 2
    assert went_on.encoder == {digest: "miss"}  # as it was found at its first call
    (whole,) = run_predictor(yielding, [long])
    assert isinstance(whole, Prediction)
    assert (went_on.text, went_on.completion_tokens) == (whole.text, whole.completion_tokens)
    assert yielding.encoder.calls == 3  # a new request: encoded again
