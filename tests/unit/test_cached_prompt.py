"""The cached prompt: the tokenize stage's cache entry, as the worker and the API write and read it."""

from __future__ import annotations

from stoker.core.cached_prompt import CachedPrompt
from stoker.core.jobs import ChatTurn, Conversation
from stoker.core.model import GenerationParams
from stoker.core.prompting import BuiltPrompt


def test_a_prompt_reads_back_from_its_entry_as_built() -> None:
    built = BuiltPrompt(ids=[1, 2, 3], messages=[{"role": "user", "content": "hi"}], images=["abc"])
    entry = CachedPrompt.of(built).to_dict()
    assert entry == {"ids": [1, 2, 3], "messages": [{"role": "user", "content": "hi"}], "images": ["abc"]}
    entry["cost_s"] = 0.25  # the cache's own field beside it
    assert CachedPrompt.from_dict(entry) == CachedPrompt([1, 2, 3], [{"role": "user", "content": "hi"}], ["abc"])


def test_an_entry_without_messages_or_pictures_reads_as_none_of_them() -> None:
    assert CachedPrompt.from_dict({"ids": ["7", 8]}) == CachedPrompt([7, 8], [], [])


def test_its_request_carries_a_chat_s_parameters_and_streams_to_the_job_its_client_reads() -> None:
    prompt = CachedPrompt([5], [{"role": "user", "content": "q"}], ["pic"])
    chat = Conversation(turns=[ChatTurn(role="user", text="q")], params=GenerationParams(max_tokens=9), stream=True)
    request = prompt.request("tenant-a", chat, "job-1")
    assert (request.prompt_ids, request.images, request.scope) == ([5], ["pic"], "tenant-a")
    assert (request.params.max_tokens, request.stream_to) == (9, "job-1")
    plain = prompt.request("tenant-a", None, "job-2")
    assert plain.stream_to is None
