"""Requests that repeat a header or parameter deciding who they are are refused before anything reads them."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from coderunner.edge.http_limits import (
    SINGLE_HEADERS,
    ConnectionLimits,
    bounded_protocol,
    no_delay,
    refuse_repeated,
    repeated_field,
)
from coderunner.edge.listener import bind_listener

pytestmark = pytest.mark.anyio


def scope(headers: list[tuple[bytes, bytes]], query: bytes = b"") -> dict[str, Any]:
    return {"type": "http", "headers": headers, "query_string": query}


def test_a_request_with_one_of_each_passes() -> None:
    assert repeated_field(scope([(b"authorization", b"Bearer a"), (b"host", b"x"), (b"accept", b"*/*")])) is None


@pytest.mark.parametrize("name", sorted(SINGLE_HEADERS))
def test_each_deciding_header_repeated_is_named(name: bytes) -> None:
    found = repeated_field(scope([(name, b"1"), (name.upper(), b"2")]))
    assert found == f"header {name.decode()}"


def test_other_headers_may_repeat() -> None:
    assert repeated_field(scope([(b"accept", b"a"), (b"accept", b"b"), (b"cookie", b"c"), (b"cookie", b"d")])) is None


@pytest.mark.parametrize(
    "query", [b"session_id=a&session_id=b", b"session_id=a&session%5Fid=b", b"session_id=&session_id"]
)
def test_a_repeated_session_parameter_is_named_however_it_is_spelled(query: bytes) -> None:
    assert repeated_field(scope([], query)) == "query parameter session_id"


def test_one_session_parameter_and_other_repeats_pass() -> None:
    assert repeated_field(scope([], b"session_id=a&x=1&x=2")) is None


async def test_the_refusal_is_a_plain_400_that_names_the_field() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await refuse_repeated("header host", send)
    start, body = sent
    assert start["status"] == 400
    headers = dict(start["headers"])
    assert headers[b"content-length"] == str(len(body["body"])).encode()
    assert body["body"] == b"bad request: header host appears more than once; send it once\n"


def test_each_server_gets_a_gate_of_its_own() -> None:
    limits = ConnectionLimits(max_connections=4, head_timeout_s=5.0)
    first, second = bounded_protocol(limits), bounded_protocol(limits)
    assert first.gate is not second.gate and first.gate.limits == limits and not first.gate.waiting


def test_accepted_connections_send_without_delay() -> None:
    """The listener says protocol 0, so asyncio leaves Nagle on; each connection turns it off (40 ms a request)."""
    listener = bind_listener("127.0.0.1", 0)
    listener.listen(1)
    with listener, socket.create_connection(listener.getsockname()) as _client:
        accepted, _ = listener.accept()
        with accepted:

            class Transport:
                def get_extra_info(self, name: str) -> Any:
                    return accepted if name == "socket" else None

            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0  # what asyncio would leave
            no_delay(Transport())  # type: ignore[arg-type]
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
