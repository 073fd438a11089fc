"""`stoker up` without starting anything: the ports it claims and what each child is told to listen on."""

from __future__ import annotations

from typing import Any

import pytest

from stoker.settings import StackSettings
from workers.stack import (
    FLOWER_USER,
    RESTARTABLE,
    Port,
    Stack,
    _start_all,
    flower_command,
    flower_credentials,
    same_server,
    stack_ports,
)


class Recorder(Stack):
    """A stack that records what it would start."""

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        """Record the child's command and environment; start nothing."""
        self.commands[name] = (argv, env)


def _started(**settings: Any) -> dict[str, dict[str, str]]:
    stack = Recorder(tether=lambda: None)
    _start_all(StackSettings(**settings), stack, {"PATH": "/usr/bin"})
    return {name: env for name, (_, env) in stack.commands.items()}


def test_the_api_serves_its_metrics_after_the_workers_on_the_stacks_address() -> None:
    ports = stack_ports(StackSettings(port=8001, flower_port=5556, metrics_base_port=9201))
    assert Port(9204, "the API's metrics", "--metrics-port / STOKER_METRICS_BASE_PORT", "127.0.0.1") in ports
    assert [p.number for p in ports] == [8001, 5556, 9201, 9203, 9204]
    api = _started(metrics_base_port=9201)["api"]
    assert (api["STOKER_API_METRICS_PORT"], api["STOKER_METRICS_HOST"]) == ("9204", "127.0.0.1")


def test_no_metrics_base_port_means_no_metrics_listener_at_all() -> None:
    assert [p.number for p in stack_ports(StackSettings(metrics_base_port=0))] == [8000, 5555]
    assert _started(metrics_base_port=0)["api"]["STOKER_API_METRICS_PORT"] == "0"


def test_every_metrics_port_of_the_stack_is_on_its_address() -> None:
    ports = stack_ports(StackSettings())
    assert {p.host for p in ports} == {"127.0.0.1"}  # the workers' metrics too, not every interface
    started = _started()
    assert set(started) == {"api", "cpu-worker", "infer-worker", "reaper", "batch-feeder", "flower"}  # one CPU pool
    for name in ("api", "cpu-worker", "infer-worker"):
        assert started[name]["STOKER_METRICS_HOST"] == "127.0.0.1", name
    assert [started[f"{k}-worker"]["STOKER_METRICS_PORT"] for k in ("cpu", "infer")] == ["9101", "9103"]


def test_the_stack_feeds_batches_in_a_process_of_its_own_and_not_in_the_api() -> None:
    stack = Recorder(tether=lambda: None)
    _start_all(StackSettings(), stack, {"PATH": "/usr/bin"})
    assert stack.commands["batch-feeder"][0][-2:] == ["stoker.cli", "batch-feeder"]
    assert stack.commands["api"][1]["STOKER_BATCH_FEEDER"] == "false"
    assert "batch-feeder" in RESTARTABLE


def test_the_stacks_one_cpu_pool_has_the_children_a_separate_asr_worker_would_have_had() -> None:
    stack = Recorder(tether=lambda: None)
    _start_all(StackSettings(), stack, {"PATH": "/usr/bin"})
    argv = stack.commands["cpu-worker"][0]
    assert argv[argv.index("--queues") + 1] == "decode,ocr,ocr_bands,asr,tokenize,callbacks"
    concurrency = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--concurrency"]
    assert concurrency[-1] == "3"  # cpu_pool 2 + asr_concurrency 1: the last --concurrency wins


def test_the_api_s_streams_end_before_the_stack_would_kill_it_on_a_stop() -> None:
    """A stream still waiting when `stoker up` stops gets its `server_stopping` event before the API is killed."""
    assert _started()["api"]["STOKER_STOP_GRACE_S"] == "10.0"  # the stack's 15 s, less the stream's 5 s margin
    assert _started(stop_grace_s=4)["api"]["STOKER_STOP_GRACE_S"] == "4.0"  # a shorter one is kept


def test_with_api_keys_on_flower_gets_basic_auth_made_for_the_run_and_kept_off_its_command_line() -> None:
    """Flower's UI shows every tenant's task arguments and results: with keys on it is never open."""
    settings = StackSettings(auth=True)
    credentials = flower_credentials(settings)
    assert credentials is not None
    user, _, password = credentials.partition(":")
    assert user == FLOWER_USER
    assert len(password) >= 24
    assert not {":", ","} & set(password)  # Flower splits a list of credentials on commas
    assert flower_credentials(settings) != credentials  # a new one each run
    settings.flower_basic_auth = credentials
    stack = Recorder(tether=lambda: None)
    _start_all(settings, stack, {"PATH": "/usr/bin"})
    argv, env = stack.commands["flower"]
    assert env["FLOWER_BASIC_AUTH"] == credentials
    assert not any(password in arg or "basic" in arg for arg in argv)  # `ps` would show it


def test_flower_is_never_started_without_basic_auth_while_api_keys_are_on() -> None:
    stack = Recorder(tether=lambda: None)
    with pytest.raises(SystemExit, match="STOKER_FLOWER_BASIC_AUTH"):
        _start_all(StackSettings(auth=True, flower_basic_auth=None), stack, {"PATH": "/usr/bin"})
    assert "flower" not in stack.commands
    for malformed in ("admin", "admin:", ":secret"):
        with pytest.raises(SystemExit, match="user:password"):
            flower_command(StackSettings(auth=True, flower_basic_auth=malformed), {})


def test_the_operator_s_flower_credentials_are_kept_and_keys_off_needs_none() -> None:
    assert flower_credentials(StackSettings(auth=True, flower_basic_auth="ops:s3cret")) == "ops:s3cret"
    assert flower_credentials(StackSettings(auth=False, flower_basic_auth=None)) is None
    _, env = flower_command(StackSettings(auth=False, flower_basic_auth=None), {"PATH": "/usr/bin"})
    assert "FLOWER_BASIC_AUTH" not in env


def test_urls_on_one_server_are_told_apart_from_urls_on_two() -> None:
    assert same_server("redis://127.0.0.1:6379/1", "redis://127.0.0.1:6379/2")
    assert same_server("redis://stoker:pw@redis/1", "rediss://other:pw@redis:6379/0")  # 6379 unless said
    assert not same_server("redis://127.0.0.1:6379/1", "redis://127.0.0.1:6380/1")
    assert not same_server("redis://redis:6379/1", "redis://cache:6379/0")
    assert same_server("unix:///run/redis.sock?db=1", "unix:///run/redis.sock?db=2")
    assert not same_server("unix:///run/redis.sock", "unix:///run/cache.sock")
