"""The tests' in-memory store fails loudly where it keeps nothing: a command of a repository it does not keep never
reaches a server or passes as a no-op."""

from __future__ import annotations

import pytest
from redis.client import Pipeline

from stoker.adapters.store.jobs import Pending
from stoker.core.jobs import Job
from stoker.core.model import ModelRequest
from tests.fakes.store import MemoryStore, NotKept


def test_a_repository_it_does_not_keep_refuses_every_command() -> None:
    store = MemoryStore.empty()
    with pytest.raises(NotKept):
        store.blobs.release("j1")


def test_a_command_queued_onto_a_kept_round_trip_by_a_repository_it_does_not_keep_fails() -> None:
    store = MemoryStore.empty()

    def foreign(pipe: Pipeline[bytes]) -> None:
        pipe.sadd("elsewhere", "j1")

    with pytest.raises(NotKept, match="SADD"):
        store.jobs.load_pending(["j1"], also=[foreign])


def test_what_a_kept_repository_queues_onto_another_s_round_trip_is_kept() -> None:
    store = MemoryStore.empty()
    job = Job(id="j1", status="inferring", prompt="p", inputs=[])
    request = ModelRequest(prompt_ids=[1], messages=[{"role": "user", "content": "p"}])
    store.jobs.pending["j1"] = Pending(job=job, request=request, preprocessed=None, deadline=None, trace=None)

    def hold(pipe: Pipeline[bytes]) -> None:
        store.consumers.queue_hold(pipe, "c1", ["j1"])

    assert store.jobs.load_pending(["j1"], also=[hold]) == {"j1": store.jobs.pending["j1"]}
    assert store.consumers.held == {"j1"}
    assert store.consumers.hold_writes == [(["j1"], True)]
