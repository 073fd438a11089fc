"""The SmolVLM-shaped test model: loaded as any vision-language model is, it reads images and answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from stoker.adapters.backends.modelstore import resolve_model
from stoker.adapters.backends.tinyvlm import IMAGE_SEQ_LEN, IMAGE_TOKENS, TILE_TOKENS
from stoker.adapters.backends.vision import ImagePreparer, PreparedImage
from stoker.core.imaging import DecodeParams, decode_rgb
from stoker.settings import BUILTIN_MODEL, CommonSettings
from tests.media import text_image


@pytest.fixture(scope="module")
def loaded(tiny_vlm: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText.from_pretrained(tiny_vlm), AutoProcessor.from_pretrained(tiny_vlm)


def test_it_loads_as_smolvlm_does(loaded: tuple[Any, Any]) -> None:
    model, processor = loaded
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    assert type(processor).__name__ == "Idefics3Processor"
    assert type(processor.image_processor).__name__ == "Idefics3ImageProcessor"  # torchvision's, as vLLM's renderer
    assert processor.image_seq_len == IMAGE_SEQ_LEN
    tokenizer = processor.tokenizer
    for token in (*IMAGE_TOKENS, *TILE_TOKENS):
        assert tokenizer.tokenize(token) == [token]
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<image>")
    assert model.get_input_embeddings().weight.shape[0] >= len(tokenizer)


def test_its_language_model_is_smollm2(loaded: tuple[Any, Any]) -> None:
    model, _ = loaded
    text_model = Path(resolve_model(BUILTIN_MODEL, CommonSettings().model_cache, fetch=False))
    with safe_open(text_model / "model.safetensors", framework="pt") as shipped:
        name = "model.layers.7.mlp.down_proj.weight"
        assert torch.equal(model.model.text_model.layers[7].mlp.down_proj.weight, shipped.get_tensor(name))
        embeddings = shipped.get_tensor("model.embed_tokens.weight")
    assert torch.equal(model.get_input_embeddings().weight[: embeddings.shape[0]], embeddings)


def test_it_answers_from_the_prepared_tensors(loaded: tuple[Any, Any], tiny_vlm: Path) -> None:
    model, processor = loaded
    preparer = ImagePreparer.load(tiny_vlm)
    assert preparer is not None
    rgb = decode_rgb(text_image("HELLO", size=(1000, 400)), DecodeParams())
    prepared = PreparedImage.from_bytes(preparer.prepare(rgb).to_bytes())
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What does it say?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    text = processor(text=prompt, images=[rgb], return_tensors="pt")
    rows, cols = int(prepared.tensors["rows"][0, 0]), int(prepared.tensors["cols"][0, 0])
    # The prompt spells one run of image tokens per tile and one for the whole: the tensors' tiles, exactly.
    image_tokens = int((text["input_ids"] == model.config.image_token_id).sum())
    assert (
        image_tokens == (rows * cols + 1) * IMAGE_SEQ_LEN == prepared.tensors["pixel_values"].shape[1] * IMAGE_SEQ_LEN
    )
    pixels = torch.from_numpy(prepared.tensors["pixel_values"]).to(model.dtype)
    mask = torch.from_numpy(prepared.tensors["pixel_attention_mask"])
    with torch.inference_mode():
        out = model.generate(
            input_ids=text["input_ids"],
            attention_mask=text["attention_mask"],
            pixel_values=pixels,
            pixel_attention_mask=mask,
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
        )
        ours = model(**{**text, "pixel_values": pixels, "pixel_attention_mask": mask}).logits[0, -1]
        theirs = model(**text).logits[0, -1]
    assert out.shape[1] == text["input_ids"].shape[1] + 8
    # float16 pixels move the answer's logits by rounding only.
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=1e-3)
