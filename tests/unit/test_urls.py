"""URL inputs judged without the network: syntax, forbidden addresses, the allowlist, redirects, the canvas."""

from __future__ import annotations

from ipaddress import ip_address

import pytest
from celery import group
from pydantic import ValidationError

from api.intake import UrlInput, validate
from stoker.core.errors import FetchFailed, UrlRejected
from stoker.core.jobs import InputRecord
from stoker.core.urls import MAX_URL_CHARS, Allowlist, forbidden_reason, parse_url, redirect_location, vet_addresses
from stoker.settings import ApiSettings, WorkerSettings
from tasks.app import make_app
from tasks.pipeline import job_canvas

#: A producer app, as the API builds one: signatures need no broker until sent.
APP = make_app(WorkerSettings())


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "ftp://example.com/a.png",
        "gopher://example.com:70/_",
        "javascript:alert(1)",
        "//example.com/a.png",
        "http:///a.png",
        "http://user:secret@example.com/a.png",
        "http://example.com@127.0.0.1/a.png",
        "http://example.com:0/",
        "http://example.com:65536/",
        "http://example.com:port/",
        "http://exa mple.com/",
        "http://example.com/a\nb",
        "http://[::1/",
        "http://bad_host!.com/",
        "http://example.com/" + "a" * MAX_URL_CHARS,
    ],
)
def test_urls_that_are_not_plain_http_are_rejected(url: str) -> None:
    with pytest.raises(UrlRejected):
        parse_url(url)


def test_a_url_is_split_into_what_a_pinned_request_needs() -> None:
    target = parse_url("HTTPS://Files.EXAMPLE.com/scans/ä.png?page=2#top")
    assert (target.scheme, target.host, target.port) == ("https", "files.example.com", 443)
    assert target.path == "/scans/%C3%A4.png?page=2"
    assert target.host_header == "files.example.com"
    v6 = parse_url("http://[::1]:8080")
    assert (v6.host, v6.port, v6.path, v6.host_header) == ("::1", 8080, "/", "[::1]:8080")
    assert parse_url("http://bücher.example/").host == "xn--bcher-kva.example"


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("169.254.169.254", "metadata"),
        ("fd00:ec2::254", "metadata"),
        ("100.100.100.200", "metadata"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("10.0.0.1", "private"),
        ("172.16.5.4", "private"),
        ("192.168.1.1", "private"),
        ("fc00::1", "private"),
        ("100.64.0.1", "non-public"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("192.0.0.1", "private"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:169.254.169.254", "metadata"),
        ("64:ff9b::a00:1", "private"),
        ("2002:7f00:1::", "loopback"),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"),
    ],
)
def test_non_public_addresses_are_forbidden(address: str, reason: str) -> None:
    found = forbidden_reason(ip_address(address))
    assert found is not None
    assert reason in found


@pytest.mark.parametrize(
    "address", ["93.184.216.34", "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"]
)
def test_public_addresses_are_allowed(address: str) -> None:
    assert forbidden_reason(ip_address(address)) is None


def test_the_allowlist_admits_hosts_addresses_and_networks_on_their_ports() -> None:
    allow = Allowlist.parse(" files.internal:8443, 127.0.0.2 ,10.1.0.0/16,[::1]:8080, fd00::/8 ")
    loop, v6loop = ip_address("127.0.0.1"), ip_address("::1")
    assert allow.allows("files.internal", 8443, ip_address("10.9.9.9"))
    assert not allow.allows("files.internal", 443, ip_address("10.9.9.9"))
    assert allow.allows("anything", 1, ip_address("127.0.0.2"))
    assert not allow.allows("anything", 1, loop)
    assert allow.allows("x", 80, ip_address("10.1.200.3"))
    assert not allow.allows("x", 80, ip_address("10.2.0.1"))
    assert allow.allows("x", 8080, v6loop)
    assert not allow.allows("x", 8081, v6loop)
    assert allow.allows("x", 1, ip_address("fd00::5"))
    assert not Allowlist.parse("").allows("x", 80, loop)


@pytest.mark.parametrize("entry", ["bad host", "127.0.0.1:0", "files:99999", "[::1]x", "10.0.0.0/33", "a:b"])
def test_a_bad_allowlist_entry_is_refused(entry: str) -> None:
    with pytest.raises(ValueError, match=r"."):
        Allowlist.parse(entry)


def test_a_bad_allowlist_stops_the_worker_settings() -> None:
    with pytest.raises(ValidationError, match="url_allowlist"):
        WorkerSettings(url_allowlist="not a host")
    assert WorkerSettings(url_allowlist="127.0.0.1:8080,10.0.0.0/8").url_allowlist


def test_the_fetch_stage_is_under_the_visibility_timeout() -> None:
    with pytest.raises(ValidationError, match="visibility_timeout_s"):
        WorkerSettings(visibility_timeout_s=100, fetch_hard_s=120)


def test_one_forbidden_address_rejects_the_whole_host() -> None:
    target = parse_url("http://mixed.example/a.png")
    public, private = ip_address("93.184.216.34"), ip_address("10.0.0.7")
    assert vet_addresses(target, [public], Allowlist()) == [public]
    with pytest.raises(UrlRejected) as rejected:
        vet_addresses(target, [public, private], Allowlist())
    assert rejected.value.message == "mixed.example resolves to a private address"  # the kind, never the address
    assert "10.0.0.7" not in rejected.value.message
    with pytest.raises(FetchFailed):
        vet_addresses(target, [], Allowlist())


def test_the_allowlist_lets_a_private_host_through_by_name_or_address() -> None:
    target = parse_url("http://files.internal:8443/a.png")
    private = ip_address("10.0.0.7")
    assert vet_addresses(target, [private], Allowlist.parse("files.internal:8443")) == [private]
    assert vet_addresses(target, [private], Allowlist.parse("10.0.0.0/24")) == [private]
    with pytest.raises(UrlRejected):
        vet_addresses(target, [private], Allowlist.parse("files.internal:443"))
    with pytest.raises(UrlRejected, match="metadata"):
        vet_addresses(parse_url("http://169.254.169.254/"), [ip_address("169.254.169.254")], Allowlist.parse("x"))


def test_redirects_resolve_against_the_url_they_came_from() -> None:
    here = parse_url("http://files.example/a/b.png")
    assert redirect_location(here, 200, None) is None
    assert redirect_location(here, 304, "/elsewhere") is None
    assert redirect_location(here, 302, "c.png") == "http://files.example/a/c.png"
    assert redirect_location(here, 301, "//127.0.0.1/x") == "http://127.0.0.1/x"
    assert redirect_location(here, 307, " file:///etc/passwd ") == "file:///etc/passwd"
    with pytest.raises(FetchFailed):
        redirect_location(here, 308, None)
    with pytest.raises(UrlRejected):
        redirect_location(here, 302, "http://[::1/")


SETTINGS = ApiSettings()


def test_the_api_accepts_an_http_url_without_fetching_it() -> None:
    accepted = validate("hi", [("image", UrlInput("https://files.example/a.png"))], SETTINGS)
    item = accepted.inputs[0]
    assert (item.url, item.data, item.digest) == ("https://files.example/a.png", b"", "")


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://files.example/a.png", "http://u:p@files.example/"])
def test_the_api_refuses_urls_that_are_not_http_at_once(url: str) -> None:
    with pytest.raises(UrlRejected, match=r"inputs\[0\]\.url") as caught:
        validate("hi", [("image", UrlInput(url))], SETTINGS)
    assert caught.value.http_status == 422
    assert caught.value.to_dict()["code"] == "url_rejected"


def test_url_inputs_are_fetched_before_their_branches() -> None:
    image = InputRecord(index=0, kind="image", content_hash="", size_bytes=0, url="http://x/a.png")
    audio = InputRecord(index=1, kind="audio", content_hash="", size_bytes=0, url="http://x/a.mp3")
    canvas = job_canvas("j", [image, audio], APP, keyframes=2)
    assert [[t.task for t in c.tasks] for c in canvas.tasks] == [
        ["stoker.fetch", "stoker.decode", "stoker.ocr"],
        ["stoker.fetch", "stoker.probe", "stoker.transcribe"],
    ]
    fetch = canvas.tasks[1].tasks[0]
    assert fetch.args == ("j", "input:1")
    assert fetch.immutable


def test_a_url_video_is_fetched_once_before_its_sound_and_keyframe_branches() -> None:
    video = InputRecord(index=0, kind="video", content_hash="", size_bytes=0, url="http://x/v.mp4")
    canvas = job_canvas("j", [video], APP, keyframes=2, deadline=2_000_000_000.0)
    (branch,) = canvas.tasks
    fetch, fanout = branch.tasks
    assert fetch.task == "stoker.fetch"
    assert isinstance(fanout, group)
    assert [[t.task for t in c.tasks] for c in fanout.tasks] == [
        ["stoker.probe", "stoker.transcribe"],
        ["stoker.keyframe", "stoker.decode", "stoker.ocr"],
        ["stoker.keyframe", "stoker.decode", "stoker.ocr"],
    ]
    assert fetch.options["expires"] is not None
    assert fanout.tasks[2].tasks[2].options["expires"] == fetch.options["expires"]
