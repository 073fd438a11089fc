"""API keys, tenant limits, auth settings and the Redis TLS options, without any service."""

from __future__ import annotations

import hashlib
import ssl
from pathlib import Path
from typing import Any

import pytest

from stoker.core.model import ModelRequest
from stoker.core.queues import job_messages
from stoker.core.tenancy import (
    DEFAULT_TENANT,
    IN_FLIGHT_RETRY_S,
    SHARED_SCOPE,
    ApiKey,
    LimitVerdict,
    cache_scope,
    check_tenant,
    hash_secret,
    issue_key,
    key_id_of,
    parse_key,
    retry_after,
    verify,
)
from stoker.settings import ApiSettings, StackSettings, WorkerSettings
from tasks.app import make_app
from workers.stack import _without_password, stack_auth

ROOT = Path(__file__).resolve().parents[2]


def test_a_new_key_is_prefixed_and_random_and_only_its_hash_is_kept() -> None:
    first, second = issue_key("acme", 1.0), issue_key("acme", 1.0)
    assert first.token != second.token
    prefix, key_id, secret = first.token.split("_", 2)
    assert (prefix, key_id) == ("stk", first.record.key_id)
    assert len(secret) >= 40  # 32 random bytes, url-safe base64
    assert first.record.secret_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in repr(first.record)  # the stored record never holds the secret
    assert first.record.tenant == "acme"
    assert not first.record.revoked


def test_a_key_opens_its_tenant_and_nothing_else_does() -> None:
    issued = issue_key("acme", 1.0)
    parsed = parse_key(issued.token)
    assert parsed is not None
    key_id, secret = parsed
    assert key_id == issued.record.key_id
    assert verify(secret, issued.record) == "acme"
    assert verify(secret[:-1] + ("A" if secret[-1] != "A" else "B"), issued.record) is None  # one character off
    assert verify(secret, None) is None  # unknown key id
    revoked = ApiKey(key_id, "acme", issued.record.secret_hash, 1.0, revoked=True)
    assert verify(secret, revoked) is None


@pytest.mark.parametrize(
    "token",
    ["", "stk", "stk_", "stk_0123456789abcdef_", "xyz_0123456789abcdef_secret", "stk_NOTHEX0123456789_s", "Bearer x"],
)
def test_malformed_keys_do_not_parse(token: str) -> None:
    assert parse_key(token) is None


def test_a_secret_may_hold_underscores() -> None:
    assert parse_key("stk_0123456789abcdef_a_b_c") == ("0123456789abcdef", "a_b_c")
    assert key_id_of("stk_0123456789abcdef_a_b_c") == "0123456789abcdef"
    assert key_id_of("0123456789abcdef") == "0123456789abcdef"
    assert key_id_of("nope") is None


def test_hashing_is_stable_and_not_the_secret() -> None:
    assert hash_secret("s3cret") == hash_secret("s3cret")
    assert hash_secret("s3cret") != "s3cret"
    assert hash_secret("s3cret") != hash_secret("s3creT")


@pytest.mark.parametrize("name", ["acme", "team-7", "a.b_c", "x" * 64])
def test_tenant_names_that_fit_in_keys(name: str) -> None:
    assert check_tenant(name) == name


@pytest.mark.parametrize("name", ["", "-lead", "has space", "a:b", "x" * 65, "ünï"])
def test_tenant_names_that_do_not(name: str) -> None:
    with pytest.raises(ValueError, match="tenant"):
        issue_key(name, 1.0)


def test_cache_scopes() -> None:
    assert cache_scope("acme", shared=False) != cache_scope("globex", shared=False)
    assert cache_scope("acme", shared=True) == cache_scope("globex", shared=True) == SHARED_SCOPE
    assert cache_scope(SHARED_SCOPE, shared=False) != SHARED_SCOPE


def test_retry_after_rounds_up_and_is_never_zero() -> None:
    assert retry_after(0.0001) == 1
    assert retry_after(1.0) == 1
    assert retry_after(1.2) == 2
    assert LimitVerdict.from_script("ok", 0) == LimitVerdict("ok")
    assert LimitVerdict.from_script("rate", 2.4) == LimitVerdict("rate", 3)
    assert LimitVerdict.from_script("in_flight", 0) == LimitVerdict("in_flight", IN_FLIGHT_RETRY_S)
    assert LimitVerdict.from_script("share", 0) == LimitVerdict("share", IN_FLIGHT_RETRY_S)
    assert LimitVerdict.from_script("bytes", 0) == LimitVerdict("bytes", IN_FLIGHT_RETRY_S)
    assert LimitVerdict.from_script("results", 3599.2) == LimitVerdict("results", 3600)  # its first result's expiry
    assert LimitVerdict.from_script("results", -0.5) == LimitVerdict("results", 1)  # expired, not yet let go of
    with pytest.raises(ValueError, match="unknown admission outcome"):
        LimitVerdict.from_script("maybe", 0)


@pytest.mark.parametrize(
    ("inputs", "start", "messages"),
    [
        ([], "preprocess", 2),  # tokenize + infer
        ([("image", False)], "preprocess", 4),  # + decode, ocr
        ([("image", True)], "preprocess", 5),  # + fetch
        ([("audio", False), ("image", False)], "preprocess", 6),  # + probe, transcribe
        ([("video", False)], "preprocess", 13),  # probe, transcribe + 3 x (keyframe, decode, ocr)
        ([("video", True)], "preprocess", 14),
        ([("image", False)] * 6, "preprocess", 14),
        ([("image", False)], "tokenize", 2),  # inputs cached
        ([("image", False)], "infer", 1),  # prompt cached too
        ([("image", False)], "render", 1),  # one task renders it and ends the render
        ([("image", False)] * 4, "render", 5),  # a decode each, then tokenize
        ([("image", False)] * 4, "ended", 0),  # every picture cached rendered: no message at all
    ],
)
def test_a_jobs_weight_is_the_messages_it_fans_out_into(
    inputs: list[tuple[str, bool]], start: Any, messages: int
) -> None:
    assert job_messages(inputs, start, keyframes=3) == messages


def test_a_model_request_keeps_its_cache_scope() -> None:
    request = ModelRequest([1, 2], [{"role": "user", "content": "hi"}], ["abc"], "tenant-acme")
    assert ModelRequest.from_json(request.to_json()) == request
    assert ModelRequest.from_json('{"ids": [1]}').scope == ""  # stored before scopes existed


# -- settings ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"), [("on", True), ("off", False), ("ON", True), ("true", True), ("0", False)]
)
def test_auth_reads_on_and_off(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("STOKER_AUTH", value)
    assert ApiSettings().auth is expected
    assert StackSettings().auth is expected


def test_auth_is_on_for_the_api_and_off_for_a_local_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STOKER_AUTH", raising=False)
    assert ApiSettings().auth is True
    assert StackSettings().auth is False
    assert stack_auth(StackSettings(), flag=False, environ={}) is False
    assert stack_auth(StackSettings(), flag=True, environ={}) is True  # stoker up --auth


def test_stoker_auth_overrides_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_AUTH", "off")
    assert stack_auth(StackSettings(), flag=True, environ={"STOKER_AUTH": "off"}) is False
    monkeypatch.setenv("STOKER_AUTH", "on")
    assert stack_auth(StackSettings(), flag=False, environ={"STOKER_AUTH": "on"}) is True


def test_limits_come_from_settings() -> None:
    limits = ApiSettings(rate_limit_per_s=2.5, rate_limit_burst=5, max_jobs_in_flight=7).tenant_limits
    assert (limits.rate_per_s, limits.burst, limits.max_in_flight) == (2.5, 5, 7)
    shares = ApiSettings(cpu_queue_limit=40, tenant_max_share=0.25, tenant_max_stored_bytes=1000).tenant_limits
    assert (shares.share_capacity, shares.max_share, shares.max_stored_bytes) == (40, 0.25, 1000)
    assert ApiSettings(tenant_max_share=0).tenant_limits.share_capacity == 0  # fair share off
    with pytest.raises(ValueError, match="rate_limit_burst"):
        ApiSettings(rate_limit_burst=0)
    assert ApiSettings().cache_shared is False
    assert DEFAULT_TENANT == "local"


def test_redis_tls_options_only_for_rediss(tmp_path: Path) -> None:
    settings = WorkerSettings(redis_ca_file=tmp_path / "ca.pem")
    assert settings.redis_tls("redis://127.0.0.1:6379/0") == {}
    assert settings.redis_tls("amqp://guest@rabbit//") == {}
    options = settings.redis_tls("rediss://stoker:pw@redis:6380/0")
    assert options == {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(tmp_path / "ca.pem")}
    mutual = WorkerSettings(redis_cert_file=tmp_path / "c.pem", redis_key_file=tmp_path / "k.pem")
    assert mutual.redis_tls("rediss://h/0") == {
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
        "ssl_certfile": str(tmp_path / "c.pem"),
        "ssl_keyfile": str(tmp_path / "k.pem"),
    }


def test_celery_verifies_tls_on_rediss_urls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env = {
        "STOKER_BROKER_URL": "rediss://stoker:pw@redis:6380/0",
        "STOKER_RESULT_URL": "rediss://stoker:pw@redis:6380/1",
        "STOKER_REDIS_CA_FILE": str(tmp_path / "ca.pem"),
    }
    config = _celery_conf(monkeypatch, env)
    expected = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(tmp_path / "ca.pem")}
    assert config.broker_use_ssl == expected
    assert config.redis_backend_use_ssl == expected
    assert config.broker_url == "rediss://stoker:pw@redis:6380/0"


def test_celery_uses_no_tls_on_plain_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"STOKER_BROKER_URL": "redis://127.0.0.1:6379/0", "STOKER_RESULT_URL": "redis://127.0.0.1:6379/1"}
    config = _celery_conf(monkeypatch, env)
    assert config.broker_use_ssl is False
    assert config.redis_backend_use_ssl is None


def test_the_stack_prints_urls_without_passwords() -> None:
    assert _without_password("rediss://stoker:s3cret@redis:6380/0") == "rediss://stoker:***@redis:6380/0"
    assert _without_password("redis://127.0.0.1:6379/1") == "redis://127.0.0.1:6379/1"


def _celery_conf(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Any:
    """The Celery configuration a process with this environment builds (from its one settings object)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return make_app(WorkerSettings()).conf


def test_the_local_tenant_is_reserved() -> None:
    with pytest.raises(ValueError, match="reserved"):
        issue_key("local", 1.0)
    assert issue_key("locals", 1.0).record.tenant == "locals"  # only the exact name


def test_the_api_docs_can_be_turned_off() -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app

    hidden = TestClient(create_app(ApiSettings(api_docs=False, api_tokenize=False)))
    assert hidden.get("/openapi.json").status_code == 404
    assert hidden.get("/docs").status_code == 404
    shown = TestClient(create_app(ApiSettings(api_tokenize=False)))
    assert shown.get("/openapi.json").status_code == 200
