"""The model behind the inference queue, as a hook contract: setup(device), then batch → predict → unbatch."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from stoker.core.batching import Collated, collate_left, strip_generated

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prediction:
    """One request's answer."""

    text: str
    prompt_tokens: int
    completion_tokens: int


class Predictor(Protocol):
    """What the inference consumer drives. setup() loads the model; it never happens at import."""

    name: str

    def setup(self, device: str) -> None:
        """Load the model onto device."""

    def batch(self, prompts: Sequence[Sequence[int]]) -> Any:
        """Collate tokenized prompts into one model input."""

    def predict(self, batch: Any) -> Any:
        """Run the model once over the batch."""

    def unbatch(self, output: Any) -> list[Prediction]:
        """Split the model output into one prediction per request, in order."""


class TransformersPredictor:
    """A local Hugging Face causal LM: batched greedy generate with left padding."""

    def __init__(self, model_path: str, *, max_new_tokens: int, dtype: str = "auto", name: str = "") -> None:
        self.model_path = model_path
        self.max_new_tokens = max_new_tokens
        self.dtype = dtype
        self.name = name or model_path
        self._model: Any = None
        self._tokenizer: Any = None
        self._device = "cpu"

    def setup(self, device: str) -> None:
        """Load tokenizer and weights (safetensors) onto device."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        started = time.perf_counter()
        self._device = device
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self._model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self._torch_dtype(torch, device))
        self._model.to(device).eval()
        log.info("model %s on %s loaded in %.1fs", self.name, device, time.perf_counter() - started)

    def _torch_dtype(self, torch: Any, device: str) -> Any:
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        return torch.bfloat16 if device.startswith("cuda") else torch.float32

    @property
    def pad_id(self) -> int:
        """Padding token id (falls back to end-of-sequence)."""
        tok = self._tokenizer
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    def batch(self, prompts: Sequence[Sequence[int]]) -> Collated:
        """Left-pad the prompts so generation starts at the same column for all."""
        return collate_left(prompts, self.pad_id)

    def predict(self, batch: Collated) -> tuple[Collated, list[list[int]]]:
        """Greedy generation for the whole batch in one call."""
        import torch

        ids = torch.tensor(batch.input_ids, device=self._device)
        mask = torch.tensor(batch.attention_mask, device=self._device)
        with torch.inference_mode():
            out = self._model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
            )
        return batch, out.tolist()

    def unbatch(self, output: tuple[Collated, list[list[int]]]) -> list[Prediction]:
        """Decode each row's new tokens."""
        batch, rows = output
        stops = {self.pad_id, int(self._tokenizer.eos_token_id)}
        generated = strip_generated(rows, batch.width, stops)
        return [
            Prediction(
                text=self._tokenizer.decode(new, skip_special_tokens=True).strip(),
                prompt_tokens=sum(mask),
                completion_tokens=len(new),
            )
            for new, mask in zip(generated, batch.attention_mask, strict=True)
        ]


def run_predictor(predictor: Predictor, prompts: Sequence[Sequence[int]]) -> list[Prediction]:
    """One full pass of the hook contract."""
    return predictor.unbatch(predictor.predict(predictor.batch(prompts)))
