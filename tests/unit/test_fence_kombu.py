"""The kombu fence (`stoker.adapters.kombu_redis`) against the installed kombu, without a broker: the release, the
hooks stoker overrides (with the arguments it expects), the internals it reads, and the names of the priority lists.
What kombu writes to Redis is checked against a real one in tests/integration/test_fence_kombu.py."""

from __future__ import annotations

import inspect
from importlib.metadata import version
from typing import Any

import pytest
from kombu.transport import redis as kombu_redis
from packaging.specifiers import SpecifierSet

from stoker.adapters.kombu_redis import (
    KOMBU_VERSIONS,
    PRIORITY_STEPS,
    RedisChannel,
    RedisQoS,
    RedisTransport,
    priority_keys,
)


def test_the_installed_kombu_is_one_the_fence_mirrors() -> None:
    installed = version("kombu")
    assert installed in SpecifierSet(KOMBU_VERSIONS), (
        f"kombu {installed} is outside {KOMBU_VERSIONS}, the releases stoker.adapters.kombu_redis mirrors: "
        "check it against this release (the tests here and in tests/integration/test_fence_kombu.py), then widen "
        "KOMBU_VERSIONS"
    )


def _parameters(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize(
    ("ours", "kombus", "hook"),
    [
        (RedisQoS, kombu_redis.QoS, "append"),
        (RedisQoS, kombu_redis.QoS, "ack"),
        (RedisQoS, kombu_redis.QoS, "restore_by_tag"),
        (RedisChannel, kombu_redis.Channel, "close"),
        (RedisChannel, kombu_redis.Channel, "_create_client"),
        (RedisTransport, kombu_redis.Transport, "register_with_event_loop"),
    ],
)
def test_each_hook_the_fence_overrides_is_kombus_with_the_same_arguments(ours: type, kombus: type, hook: str) -> None:
    assert hook in vars(ours), f"{ours.__name__} no longer overrides {hook}: remove it from this list"
    assert hasattr(kombus, hook), f"kombu's {kombus.__name__} has no {hook} any more"
    assert _parameters(getattr(ours, hook)) == _parameters(getattr(kombus, hook)), (
        f"kombu's {kombus.__name__}.{hook} now takes {_parameters(getattr(kombus, hook))}"
    )


@pytest.mark.parametrize(
    ("kombus", "name"),
    [
        (kombu_redis.QoS, "_remove_from_indices"),
        (kombu_redis.QoS, "unacked_key"),
        (kombu_redis.QoS, "unacked_index_key"),
        (kombu_redis.Channel, "unacked_key"),
        (kombu_redis.Channel, "unacked_index_key"),
        (kombu_redis.Channel, "_in_poll"),
        (kombu_redis.Channel, "_brpop_read"),
        (kombu_redis.Channel, "_put"),
        (kombu_redis.Channel, "pool"),
        (kombu_redis.Channel, "max_connections"),
        (kombu_redis.Channel, "conn_or_acquire"),
    ],
)
def test_what_the_fence_reads_of_kombu_is_still_there(kombus: type, name: str) -> None:
    assert hasattr(kombus, name), f"kombu's {kombus.__name__} has no {name} any more"


def test_the_publish_seam_is_still_one_kombus_put_takes() -> None:
    assert "_publish_batch" in inspect.getsource(kombu_redis.Channel._put), "kombu's Channel._put lost _publish_batch"


def test_a_queues_priority_lists_are_named_as_kombu_names_them() -> None:
    channel = kombu_redis.Channel.__new__(kombu_redis.Channel)  # no connection: only its naming is used
    channel.priority_steps = PRIORITY_STEPS
    assert priority_keys("decode") == [
        channel._q_for_pri("decode", step)  # type: ignore[no-untyped-call]  # kombu's channel has no annotations
        for step in PRIORITY_STEPS
    ]
