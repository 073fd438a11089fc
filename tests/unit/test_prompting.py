"""Prompt assembly: attachments in the user turn, the model's template, trimming to the context budget."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest

from stoker.adapters.backends.modelstore import resolve_model
from stoker.core.errors import ModelUnavailable
from stoker.core.jobs import ChatTurn
from stoker.core.prompting import Attachment, build_prompt, build_prompt_ids, render_user_message
from stoker.settings import CommonSettings


class WordTokenizer:
    """One token per word; the template wraps turns in markers. Enough to test the trimming logic."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self.vocab:
                self.vocab[word] = len(self.vocab)
                self.words[self.vocab[word]] = word
            ids.append(self.vocab[word])
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.words[i] for i in token_ids)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> list[int]:
        text = " ".join(f"<{m['role']}> {m['content']} </turn>" for m in conversation) + " <assistant>"
        return self.encode(text)


def test_attachments_come_before_the_question() -> None:
    message = render_user_message(
        "What is the total?",
        [
            Attachment("image", 0, text="TOTAL 12", features={"width": 10, "height": 20}),
            Attachment("image", 1, error_code="image_corrupt"),
        ],
    )
    assert message.index("TOTAL 12") < message.index("could not be processed: image_corrupt")
    assert message.endswith("What is the total?")
    assert "[image 1: height=20, width=10]" in message


def test_long_attachment_text_is_trimmed_and_the_question_kept() -> None:
    tok = WordTokenizer()
    page = " ".join(f"w{i}" for i in range(500))
    ids = build_prompt_ids(tok, "what is the total", [Attachment("image", 0, text=page)], budget=120)
    assert len(ids) <= 120
    text = tok.decode(ids)
    assert text.endswith("what is the total </turn> <assistant>")
    assert "w0" in text
    assert "w499" not in text


def test_fitting_prompt_is_untouched() -> None:
    tok = WordTokenizer()
    ids = build_prompt_ids(tok, "hello there", [Attachment("image", 0, text="short text")], budget=1000)
    assert "short text" in tok.decode(ids)


def test_overlong_prompt_without_attachments_still_fits() -> None:
    tok = WordTokenizer()
    ids = build_prompt_ids(tok, " ".join(f"p{i}" for i in range(400)), [], budget=100)
    assert len(ids) <= 100
    assert tok.decode(ids).endswith("<assistant>")


@pytest.fixture(scope="module")
def real_tokenizer() -> Any:
    """SmolLM2's own fast tokenizer from the model cache (`make test` fetches it)."""
    settings = CommonSettings()
    try:
        path = resolve_model(settings.model, settings.model_cache, fetch=False)
    except ModelUnavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_real_chat_template_ends_with_the_assistant_turn(real_tokenizer: Any) -> None:
    ids = build_prompt_ids(real_tokenizer, "Read it.", [Attachment("image", 0, text="INVOICE 4711")], budget=512)
    text = real_tokenizer.decode(ids)
    assert "INVOICE 4711" in text
    assert text.rstrip().endswith("<|im_start|>assistant")


def test_real_tokenizer_trims_to_budget(real_tokenizer: Any) -> None:
    page = "lorem ipsum dolor sit amet " * 400
    ids = build_prompt_ids(real_tokenizer, "Summarise.", [Attachment("image", 0, text=page)], budget=256)
    assert len(ids) <= 256
    assert real_tokenizer.decode(ids).rstrip().endswith("<|im_start|>assistant")


def _turn(role: str, text: str, inputs: list[int] | None = None) -> ChatTurn:
    return ChatTurn(role=role, text=text, inputs=inputs or [])  # type: ignore[arg-type]


def test_a_chat_keeps_its_turns_and_each_turns_own_attachments() -> None:
    chat = [
        _turn("system", "Be terse."),
        _turn("user", "Keep this.", [0]),
        _turn("assistant", "Kept."),
        _turn("user", "And this?", [1]),
    ]
    pictures = [Attachment("image", 0, text="PAGE ONE", pictures=("h0",)), Attachment("image", 1, text="PAGE TWO")]
    built = build_prompt(WordTokenizer(), "And this?", pictures, 1000, chat)
    system, first, answer, last = built.messages
    assert system["role"] == "system"
    assert system["content"].endswith("Be terse.")
    assert "PAGE ONE" in first["content"]
    assert first["content"].endswith("Keep this.")
    assert first["images"] == ["h0"]
    assert answer == {"role": "assistant", "content": "Kept."}
    assert "PAGE TWO" in last["content"]
    assert "PAGE ONE" not in last["content"]
    assert "images" not in last


def test_an_overlong_chat_drops_its_oldest_turns_first_and_keeps_the_last() -> None:
    tok = WordTokenizer()
    chat = [_turn("system", "rules here"), *(_turn("user", f"old{i} " + "x " * 30) for i in range(5))]
    chat.append(_turn("user", "the real question"))
    built = build_prompt(tok, "the real question", [], 60, chat)
    assert len(built.ids) <= 60
    text = tok.decode(built.ids)
    assert "rules here" in text  # system turns are never dropped
    assert "old0" not in text
    assert text.endswith("the real question </turn> <assistant>")
    assert built.messages[-1]["content"] == "the real question"


def test_a_job_without_turns_is_one_user_turn_with_every_attachment() -> None:
    attachments = [Attachment("image", 0, text="A", pictures=("p",)), Attachment("audio", 1, text="B")]
    built = build_prompt(WordTokenizer(), "Q", attachments, 1000)
    assert [m["role"] for m in built.messages] == ["system", "user"]
    assert built.messages[1]["images"] == ["p"]
