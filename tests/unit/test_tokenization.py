"""`/tokenize`'s request: a chat or a prompt, in vLLM's shapes, within the chat's limits."""

from __future__ import annotations

import json

import pytest

from api.tokenization import TokenizeChat, TokenizeCompletion, accept_tokenize
from stoker.core.errors import InvalidRequest, PromptTooLong, UnsupportedParameter
from stoker.settings import ApiSettings

SETTINGS = ApiSettings(max_prompt_chars=100)


def _accept(**body: object) -> TokenizeCompletion | TokenizeChat:
    return accept_tokenize(json.dumps(body).encode(), SETTINGS)


def test_a_body_with_messages_is_a_chat_and_any_other_a_prompt() -> None:
    chat = _accept(messages=[{"role": "user", "content": "hi"}], mm_processor_kwargs={})
    assert isinstance(chat, TokenizeChat)
    assert (chat.add_generation_prompt, chat.add_special_tokens) == (True, False)
    prompt = _accept(prompt="hi")
    assert isinstance(prompt, TokenizeCompletion)
    assert (prompt.add_special_tokens, prompt.return_token_strs) == (True, False)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, "continue_final_message"),
        ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ x }}"}, "chat_template"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://a/b"}}]}]},
            "messages",
        ),
    ],
)
def test_what_a_chat_job_cannot_be_is_refused(body: dict[str, object], param: str) -> None:
    with pytest.raises(UnsupportedParameter) as refused:
        _accept(**body)
    assert refused.value.param == param


def test_the_chats_limits_hold() -> None:
    with pytest.raises(PromptTooLong):
        _accept(prompt="x" * 101)
    with pytest.raises(PromptTooLong):
        _accept(messages=[{"role": "user", "content": "x" * 101}])
    with pytest.raises(InvalidRequest):
        _accept(messages=[])
    with pytest.raises(InvalidRequest):
        accept_tokenize(b"not json", SETTINGS)
