"""The decode engine with the tiny vision-language model: a picture's image tokens are read once per request, and
a greedy answer with a picture equals the model's own `generate` beside a text-only request."""

from __future__ import annotations

import io
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from stoker.adapters.backends.engine import DecodeEngine
from stoker.adapters.backends.engine_rows import EngineRequest, Finished
from tests.media import text_image

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def vlm(tiny_vlm: Path) -> tuple[Any, Any, Any, Any]:
    """The model, its processor, a prompt with a picture (ids), and the picture's embeddings."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm).eval()
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    picture = Image.open(io.BytesIO(text_image("HELLO", size=(400, 300)))).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What does it say?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=prompt, images=[picture], return_tensors="pt")
    with torch.inference_mode():
        features = model.model.get_image_features(
            pixel_values=inputs["pixel_values"], pixel_attention_mask=inputs["pixel_attention_mask"], return_dict=True
        ).pooler_output[0]
    return model, processor, inputs, features


def _engine(model: Any, processor: Any, prefill_chunk: int = 0) -> DecodeEngine:
    tokenizer = processor.tokenizer
    ends = model.generation_config.eos_token_id
    stop = {int(e) for e in (ends if isinstance(ends, list) else [ends])} | {int(tokenizer.eos_token_id)}

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    return DecodeEngine(model, decode, stop, max_rows=4, prefill_chunk=prefill_chunk)


def _run(engine: DecodeEngine) -> dict[Hashable, Finished]:
    done: dict[Hashable, Finished] = {}
    while engine.busy:
        done.update({f.key: f for f in engine.step()})
    return done


@pytest.mark.parametrize("chunk", [0, 40])
def test_a_picture_is_read_once_and_its_greedy_answer_is_generates(vlm: tuple[Any, Any, Any, Any], chunk: int) -> None:
    """Read whole, or (chunk 40) over several steps beside the running text row, its image tokens split between
    chunks: the same answer either way."""
    model, processor, inputs, features = vlm
    ids = inputs["input_ids"][0].tolist()
    image_tokens = ids.count(model.config.image_token_id)
    assert image_tokens == features.shape[0] > 0
    text = processor.tokenizer("User: hello<end_of_utterance>\nAssistant:")["input_ids"]
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    generated = out[0, len(ids) :].tolist()
    engine = _engine(model, processor, chunk)
    engine.submit(EngineRequest("text", text, limit=8 if not chunk else 40))
    engine.step()
    engine.submit(EngineRequest("picture", ids, limit=8, features=[features], images=("h",)))
    engine.step()
    assert engine.rows == (1 if chunk else 2)  # read in chunks: the text row runs while the picture waits
    done = _run(engine)
    ended = next((i for i, token in enumerate(generated) if token in engine.stop_ids), len(generated))
    assert done["picture"].rows[0].tokens == generated[:ended]
    # each prompt once (the picture's image tokens among them), each answer token but the last once
    answers = sum(len(f.rows[0].tokens) - 1 for f in done.values())
    assert engine.fed == len(ids) + len(text) + answers
