"""The uvicorn fence (`api.uvicorn_server`) against the installed uvicorn: the release, the hooks stoker overrides
(with the arguments it expects), the state it reads, and the server tick it relies on. What the bounds do over a
real socket is tests/unit/test_request_bounds.py's."""

from __future__ import annotations

import asyncio
import inspect
from importlib.metadata import version
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from packaging.specifiers import SpecifierSet
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from api.server import server_config
from api.uvicorn_server import PROTOCOL_HOOKS, SERVER_HOOKS, UVICORN_VERSIONS, ApiServer, HeadBoundedProtocol
from stoker.settings import ApiSettings


def test_the_installed_uvicorn_is_one_the_fence_mirrors() -> None:
    installed = version("uvicorn")
    assert installed in SpecifierSet(UVICORN_VERSIONS), (
        f"uvicorn {installed} is outside {UVICORN_VERSIONS}, the releases api.uvicorn_server mirrors: check it "
        "against this release (the tests here and in test_request_bounds.py), then widen UVICORN_VERSIONS"
    )


def _parameters(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


def _uvicorns(cls: type, hook: str) -> Any:
    """uvicorn's own hook: sse-starlette, once imported, puts a wrapper of its own over `Server.handle_exit` (and
    calls uvicorn's from it), so uvicorn's is the one it keeps."""
    function = getattr(cls, hook)
    if function.__module__.startswith("sse_starlette"):
        from sse_starlette.sse import AppStatus

        return AppStatus.original_handler
    return function


@pytest.mark.parametrize(
    ("ours", "uvicorns", "hook"),
    [(HeadBoundedProtocol, HttpToolsProtocol, hook) for hook in PROTOCOL_HOOKS]
    + [(ApiServer, uvicorn.Server, hook) for hook in SERVER_HOOKS],
)
def test_each_hook_the_fence_overrides_is_uvicorns_with_the_same_arguments(
    ours: type, uvicorns: type, hook: str
) -> None:
    assert hook in vars(uvicorns), f"uvicorn's {uvicorns.__name__} has no {hook} any more"
    theirs = _parameters(_uvicorns(uvicorns, hook))
    assert _parameters(getattr(ours, hook))[: len(theirs)] == theirs, (
        f"uvicorn's {uvicorns.__name__}.{hook} now takes {theirs}"
    )


def test_every_uvicorn_hook_the_protocol_defines_is_listed() -> None:
    overridden = {name for name in vars(HeadBoundedProtocol) if hasattr(HttpToolsProtocol, name)}
    assert overridden - {"__doc__", "__module__", "__qualname__", "__firstlineno__", "__static_attributes__"} == set(
        PROTOCOL_HOOKS
    )


def test_the_parser_error_is_still_answered_through_send_400_response() -> None:
    source = inspect.getsource(HttpToolsProtocol.data_received)
    assert "except httptools.HttpParserError" in source, "uvicorn no longer catches the parser's error here"
    assert "self.send_400_response(" in source, "uvicorn no longer answers a parser error with send_400_response"


def test_a_request_is_still_run_through_start_asgi_task() -> None:
    assert "self._start_asgi_task(" in inspect.getsource(HttpToolsProtocol), (
        "uvicorn no longer runs a request's app through _start_asgi_task: the body deadline would not be enforced"
    )


def test_a_cycle_still_has_the_state_the_protocol_reads() -> None:
    parameters = inspect.signature(RequestResponseCycle).parameters
    nothing: dict[str, Any] = dict.fromkeys(parameters)  # None for each, whatever its type
    cycle = RequestResponseCycle(**nothing)  # its constructor only keeps what it is given
    for name in ("response_started", "response_complete", "keep_alive", "message_event"):
        assert hasattr(cycle, name), f"uvicorn's RequestResponseCycle has no {name} any more"


def test_the_protocol_still_keeps_the_state_it_reads() -> None:
    config = server_config(ApiSettings(), app=FastAPI())
    config.load()

    async def build() -> HeadBoundedProtocol:
        return HeadBoundedProtocol(config, uvicorn.server.ServerState(), {})

    protocol = asyncio.run(build())
    for name in ("cycle", "loop"):
        assert hasattr(protocol, name), f"uvicorn's HttpToolsProtocol keeps no {name} any more"
    # The transport is kept only once a connection is made, which needs a socket: its assignment is looked for.
    assert "self.transport = transport" in inspect.getsource(HttpToolsProtocol.connection_made), (
        "uvicorn's HttpToolsProtocol keeps no transport any more"
    )


def test_the_server_tick_renews_the_date_on_multiples_of_ten_and_says_when_to_stop() -> None:
    server = ApiServer(server_config(ApiSettings(), app=FastAPI()))
    server.config.load()

    async def ticks() -> tuple[list[Any], list[Any], bool, bool]:
        server.server_state.default_headers = []
        await server.on_tick(5)
        off_ten = list(server.server_state.default_headers)
        going = await server.on_tick(10)
        on_ten = list(server.server_state.default_headers)
        server.should_exit = True
        return off_ten, on_ten, going, await server.on_tick(20)

    off_ten, on_ten, going, stopping = asyncio.run(ticks())
    assert off_ten == []
    assert [name for name, _ in on_ten if name == b"date"] == [b"date"]
    assert (going, stopping) == (False, True)
