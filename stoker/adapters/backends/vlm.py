"""A vision-language model as the local backend: the picture's tensors in, the model's answer out.

The CPU workers did everything a picture needs before the model: decoded it, ran the model's own image processor
(`stoker.adapters.backends.vision`) and built the prompt with the image placeholders expanded. The inference worker
never decodes or resizes: for each request it takes the token ids and, per picture (its content hash, in placeholder
order), the vision embeddings, from the cache (`stoker.adapters.embeddings`) or by running the vision encoder and
connector on the prepared tensors; then one batched generate, left-padded, image and text-only requests together,
with the embeddings handed to the model so that it never runs the encoder again (transformers' `mm_encoder_outputs`,
which generate passes on the prefill step only).

Carried: SmolVLM / Idefics3 (`get_image_features` on `pixel_values` and `pixel_attention_mask`, image tokens
replaced in order). Qwen2-VL is not: its rotary positions need each picture's grid in the forward pass as well.
"""

from __future__ import annotations

import base64
import inspect
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stoker.adapters.backends.calls import EngineRun, LocalBatch, torch_dtype
from stoker.adapters.backends.generation import Generated
from stoker.adapters.backends.local import TransformersPredictor
from stoker.adapters.backends.vision import ImagePreparer, PreparedImage
from stoker.adapters.embeddings import CacheFactory, EmbeddingCache, model_identity
from stoker.adapters.metrics import VISION_ENCODER_SECONDS
from stoker.core.batching import collate_left
from stoker.core.errors import ImageFeaturesMismatch, ImageTensorsMissing, StokerError
from stoker.core.model import EncoderUse, ModelRequest, Outcome, Prediction

log = logging.getLogger(__name__)

#: Where a picture's prepared tensors come from: (content hash, cache scope) → tensors, None when they are gone.
PreparedSource = Callable[[str, str], PreparedImage | None]


def is_vision_language(model_path: str) -> bool:
    """Whether the model reads pictures: its config has a vision part (a local directory, or a hub id)."""
    config = Path(model_path) / "config.json"
    if config.is_file():
        return "vision_config" in json.loads(config.read_text())
    from transformers import AutoConfig  # a hub id: its config alone

    return hasattr(AutoConfig.from_pretrained(model_path), "vision_config")


class VisionEncoder:
    """A vision-language model's vision tower and connector, behind the embeddings cache: one picture's embeddings
    by its content hash, computed from its prepared tensors only on a miss."""

    def __init__(self, model_path: str, prepared: PreparedSource, caches: CacheFactory, dtype: str = "auto") -> None:
        self.model_path = model_path
        self.prepared = prepared
        self.caches = caches
        self.dtype = dtype
        self.model: Any = None
        self.cache: EmbeddingCache | None = None
        self.device = "cpu"
        #: Pictures this process ran through the encoder (misses), for tests and benchmarks.
        self.calls = 0
        #: The identity of the model's own image processor: tensors another one made are not read.
        self.processor = ""
        self._inputs: set[str] = set()

    def setup(self, device: str) -> None:
        """Load the model's weights (`AutoModelForImageTextToText`) and open its embeddings cache."""
        import torch  # heavy: only the inference worker
        from transformers import AutoModelForImageTextToText

        self.device = device
        dtype = torch_dtype(torch, self.dtype, device)
        self.model = AutoModelForImageTextToText.from_pretrained(self.model_path, dtype=dtype)
        self.model.to(device).eval()
        self._inputs = set(inspect.signature(self.model.model.get_image_features).parameters)
        self.cache = self.caches(model_identity(self.model_path, dtype=str(self.model.dtype)))
        preparer = ImagePreparer.load(self.model_path)
        self.processor = preparer.identity if preparer is not None else ""

    @property
    def hidden_size(self) -> int:
        """The width of an embedding: the text model's hidden size."""
        return int(self.model.config.text_config.hidden_size)

    def embeddings(self, digest: str, scope: str) -> tuple[Any, EncoderUse]:
        """One picture's embeddings (tokens × hidden, the model's dtype, on its device), and whether they hit: in the
        request's cache scope only, so a tenant never hits what another computed (unless the cache is shared)."""
        cached = self.cache.get(digest, scope) if self.cache is not None else None
        if cached is not None:
            return cached.to(device=self.device, dtype=self.model.dtype), "hit"
        prepared = self.prepared(digest, scope)
        if prepared is None:
            raise ImageTensorsMissing(stage="infer")
        if prepared.meta.get("processor") != self.processor:
            raise ImageFeaturesMismatch("the picture was prepared by another image processor", stage="infer")
        started = time.perf_counter()
        features = self.encode(prepared)
        VISION_ENCODER_SECONDS.observe(time.perf_counter() - started)
        if self.cache is not None:
            self.cache.put(digest, scope, features)
        return features, "miss"

    def encode(self, prepared: PreparedImage) -> Any:
        """Run the vision encoder and connector on one picture's tensors, as its processor made them."""
        import torch  # heavy: see setup()

        inputs: dict[str, Any] = {}
        for name, array in prepared.tensors.items():
            if name in self._inputs:
                tensor = torch.from_numpy(array).to(self.device)
                inputs[name] = tensor.to(self.model.dtype) if tensor.is_floating_point() else tensor
        self.calls += 1
        with torch.inference_mode():
            output = self.model.model.get_image_features(**inputs, return_dict=True)
        return output.pooler_output[0]

    @property
    def tokens_per_tile(self) -> int:
        """Idefics3 / SmolVLM: the image tokens one tile becomes ((side / patch)² patches, pixel-shuffled)."""
        vision = self.model.config.vision_config
        scale = int(getattr(self.model.config, "scale_factor", 1))
        return int((vision.image_size // vision.patch_size) ** 2 // scale**2)

    def check(self, features: Any) -> None:
        """Embeddings this model can read: whole tiles of image tokens × its text model's width, in its dtype (a
        server fed another shape may crash, so they are checked before they leave)."""
        tiles_ok = features.ndim == 2 and features.shape[0] > 0 and features.shape[0] % self.tokens_per_tile == 0
        if not tiles_ok or features.shape[1] != self.hidden_size or features.dtype != self.model.dtype:
            expected = f"(n × {self.tokens_per_tile}, {self.hidden_size}) {self.model.dtype}"
            found = f"{tuple(features.shape)} {features.dtype}"
            raise ImageFeaturesMismatch(f"vision embeddings are {found}, not {expected}", stage="infer")


@dataclass(frozen=True)
class VisionBatch:
    """The requests that go to the model (left-padded, with their pictures' embeddings in placeholder order), and
    those that failed before it (by position)."""

    local: LocalBatch
    kept: list[int]
    size: int
    #: Per kept request, its pictures' embeddings in placeholder order.
    features: list[list[Any]] = field(default_factory=list)
    failed: dict[int, StokerError] = field(default_factory=dict)
    encoder: dict[int, dict[str, EncoderUse]] = field(default_factory=dict)


class VisionLanguagePredictor(TransformersPredictor):
    """A local vision-language model (`AutoModelForImageTextToText`): text-only and image requests in one batch.

    A request whose pictures' tensors are gone, or whose image tokens do not match its pictures' embeddings,
    fails alone; the rest of the batch is answered."""

    def __init__(self, model_path: str, *, prepared: PreparedSource, caches: CacheFactory, **options: Any) -> None:
        super().__init__(model_path, **options)
        self.encoder = VisionEncoder(model_path, prepared, caches, self.dtype)
        #: The embeddings of the requests the last engine call set aside, going on in the next, by (content hash,
        #: scope), with how they were found: an answer going on does not look them up or encode them again (a new
        #: request looks them up as ever).
        self._carried: dict[tuple[str, str], tuple[Any, EncoderUse]] = {}

    def _load_model(self, device: str) -> Any:
        """The vision-language model, through its encoder (one set of weights for both)."""
        self.encoder.setup(device)
        return self.encoder.model

    @property
    def image_token_id(self) -> int:
        """The placeholder token each embedding row replaces."""
        return int(self._model.config.image_token_id)

    def batch(self, requests: Sequence[ModelRequest]) -> VisionBatch:  # type: ignore[override]
        """Each request's pictures as embeddings (cached or encoded now); the requests that have them, left-padded."""
        kept: list[int] = []
        features: list[list[Any]] = []
        failed: dict[int, StokerError] = {}
        encoder: dict[int, dict[str, EncoderUse]] = {}
        for position, request in enumerate(requests):
            try:
                found, encoder[position] = self._pictures(request)
            except StokerError as exc:
                failed[position] = exc
                continue
            kept.append(position)
            features.append(found)
        prompts = [[*requests[i].prompt_ids, *requests[i].generated] for i in kept]
        local = LocalBatch(collate_left(prompts, self.pad_id), [requests[i] for i in kept])
        return VisionBatch(local, kept, len(requests), features, failed, encoder)

    def _pictures(self, request: ModelRequest) -> tuple[list[Any], dict[str, EncoderUse]]:
        """A request's embeddings in placeholder order, checked against its image tokens."""
        found: list[Any] = []
        used: dict[str, EncoderUse] = {}
        for digest in request.images:
            carried = self._carried.get((digest, request.scope)) if request.generated else None
            tensor, use = carried if carried is not None else self.encoder.embeddings(digest, request.scope)
            found.append(tensor)
            used.setdefault(digest, use)
        tokens = request.prompt_ids.count(self.image_token_id)
        rows = sum(int(t.shape[0]) for t in found)
        if tokens != rows:
            raise ImageFeaturesMismatch(
                f"the prompt has {tokens} image tokens, its {len(found)} picture(s) {rows} embeddings", stage="infer"
            )
        return found, used

    def predict(  # type: ignore[override]
        self, batch: VisionBatch
    ) -> tuple[VisionBatch, Generated | EngineRun | None]:
        """The kept requests on the decode engine, each with its pictures' embeddings (read once, with its prompt:
        a request that goes on from its parked cache reads none again); without the engine, one generate over
        them, the embeddings in place of the encoder (each request's repeated for each of its `n` rows, as its
        prompt is)."""
        if not batch.kept:
            return batch, None
        if self.engine:
            run = self._run_engine(batch.local, batch.features)
            self._carry(batch, run)
            return batch, run
        n = batch.local.params[0].n
        pictures = [tensor for found in batch.features for _ in range(n) for tensor in found]
        if not pictures:
            return batch, self._generate(batch.local)
        from transformers.modeling_outputs import BaseModelOutputWithPooling  # heavy: see setup()

        encoded = {"image": BaseModelOutputWithPooling(pooler_output=pictures)}
        return batch, self._generate(batch.local, mm_encoder_outputs=encoded)

    def _carry(self, batch: VisionBatch, run: EngineRun) -> None:
        """Keep the embeddings of the requests that go on in the next call (those of the call before let go)."""
        self._carried = {}
        for position in run.going:
            request, used = batch.local.requests[position], batch.encoder[batch.kept[position]]
            for digest, tensor in zip(request.images, batch.features[position], strict=True):
                self._carried[(digest, request.scope)] = (tensor, used[digest])

    def unbatch(  # type: ignore[override]
        self, output: tuple[VisionBatch, Generated | EngineRun | None]
    ) -> list[Outcome]:
        """Every request's outcome in order: its answer (saying which pictures hit the cache), or its own error."""
        batch, generated = output
        answers = super().unbatch(generated) if generated is not None else []
        outcomes: list[Outcome] = []
        answered = dict(zip(batch.kept, answers, strict=True))
        for position in range(batch.size):
            answer = answered.get(position)
            if answer is None:
                outcomes.append(batch.failed[position])
            else:
                outcomes.append(self._with_encoder(answer, batch.encoder.get(position, {})))
        return outcomes

    @staticmethod
    def _with_encoder(answer: Outcome, used: dict[str, EncoderUse]) -> Outcome:
        return replace(answer, encoder=used) if used and isinstance(answer, Prediction) else answer

    def _stop_ids(self) -> set[int]:
        """Padding, end of sequence, and every end the model's generation config names (SmolVLM's
        `<end_of_utterance>`)."""
        ends = getattr(self._model.generation_config, "eos_token_id", None)
        listed = ends if isinstance(ends, list) else [ends] if ends is not None else []
        return {*super()._stop_ids(), *(int(e) for e in listed)}


def tensor_base64(tensor: Any) -> str:
    """A tensor as vLLM's `image_embeds` parts carry it: `torch.save` bytes (read back with
    `torch.load(weights_only=True)`), base64-encoded."""
    import io

    import torch  # heavy: only the inference worker sends embeddings

    buffer = io.BytesIO()
    torch.save(tensor.detach().to("cpu").contiguous(), buffer)
    return base64.b64encode(buffer.getvalue()).decode()
