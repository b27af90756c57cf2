"""Abuse: one token's client reaching another token's MCP session by repeating a field.

The attack (security issue 25, finding 1): on legacy SSE, `POST /messages/?session_id=<mine>&
session_id=<victim's>` passed the binding check, which read the first id, while the SDK routed
on the last: the attacker cancelled the victim's running run_python and could inject messages
into the victim's session. Now any request repeating an identity or routing field (session ids,
the bearer token, the client name, ...) gets 400 before anything reads it, on every HTTP
transport, and every session id a request carries must belong to its token.

Real servers, two tokens: the victim is the server's own token (raw HTTP, so the test knows its
session id, as a leak would tell the attacker), mallory an added token. Each case checks the
victim's session answered correctly and kept its state, a bystander kept its own, and the
server still serves.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client

from ..conftest import TEST_TOKEN, ServerDirs, connect_http, http_server, run, server_env, text_of
from .test_abuse_tokens import token_cli

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

VICTIM_CANARY = "victim-run-finished-3e81"
VICTIM_VALUE = "victim-state-90c2"
BYSTANDER_VALUE = "bystander-state-5a7f"
INJECTED = "mallory-injected-d44b"
#: Bounds every wait on the server.
WAIT_S = 120
PROTOCOL = "2025-06-18"
JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def bearer(token: str) -> tuple[str, str]:
    return ("Authorization", f"Bearer {token}")


def initialize(request_id: int | str = 1) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "initialize",
        "params": {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}},
    }


INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}


def tool_call(request_id: int | str, code: str) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": "run_python", "arguments": {"code": code}},
    }


def cancel(request_id: int | str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": request_id}}


def tool_text(message: dict[str, Any]) -> str:
    """The text of a successful tool call's answer."""
    assert "result" in message and not message["result"].get("isError"), message
    return "\n".join(block.get("text", "") for block in message["result"]["content"])


def answer_of(response: httpx2.Response) -> dict[str, Any]:
    """The JSON-RPC answer in a streamable HTTP POST's response (one SSE event, or plain JSON)."""
    assert response.status_code == 200, (response.status_code, response.text)
    if response.headers.get("content-type", "").startswith("application/json"):
        return response.json()
    data = [line.partition(":")[2] for line in response.text.splitlines() if line.startswith("data:")]
    answers = [json.loads(line) for line in data if line.strip()]
    return next(answer for answer in answers if "id" in answer)


@dataclass
class SseSession:
    """A legacy SSE stream opened by hand: its session id, and every message it has carried."""

    base: str
    token: str
    session_id: str
    received: list[dict[str, Any]]
    arrived: anyio.Event

    def post_url(self, query: str | None = None) -> str:
        return f"{self.base}/messages/?{query if query is not None else f'session_id={self.session_id}'}"

    async def post(self, http: httpx2.AsyncClient, message: dict[str, Any]) -> None:
        done = await http.post(self.post_url(), json=message, headers=[bearer(self.token)])
        assert done.status_code == 202, done.text

    async def answer(self, request_id: int | str) -> dict[str, Any]:
        with anyio.fail_after(WAIT_S):
            while True:
                for message in self.received:
                    if message.get("id") == request_id and ("result" in message or "error" in message):
                        return message
                await self.arrived.wait()
                self.arrived = anyio.Event()


@asynccontextmanager
async def sse_session(http: httpx2.AsyncClient, url: str, token: str) -> AsyncIterator[SseSession]:
    """Open an SSE stream with `token` and read it in the background until the block ends."""
    base = url.removesuffix("/sse")
    ready = anyio.Event()
    found: list[SseSession] = []

    async def read(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        async with http.stream("GET", url, headers=[bearer(token)]) as response:
            assert response.status_code == 200
            event = ""
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    event = line.partition(":")[2].strip()
                elif line.startswith("data:"):
                    data = line.partition(":")[2].strip()
                    if event == "endpoint":
                        session_id = data.partition("session_id=")[2]
                        found.append(SseSession(base, token, session_id, [], anyio.Event()))
                        ready.set()
                    elif found:
                        found[0].received.append(json.loads(data))
                        found[0].arrived.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        with anyio.fail_after(WAIT_S):
            await ready.wait()
        try:
            yield found[0]
        finally:
            tg.cancel_scope.cancel()


async def handshake(http: httpx2.AsyncClient, session: SseSession) -> None:
    await session.post(http, initialize(1))
    assert "result" in await session.answer(1)
    await session.post(http, INITIALIZED)


@asynccontextmanager
async def bystander_on(url: str, token: str) -> AsyncIterator[Client]:
    async with connect_http(url, token=token) as bystander:
        await run(bystander, f"guarded = {BYSTANDER_VALUE!r}")
        yield bystander


async def test_a_repeated_sse_session_id_is_refused_and_the_victims_run_finishes(dirs: ServerDirs) -> None:
    env = server_env(dirs, CODERUNNER_DETACH_AFTER_S="3600")
    mallory_token = token_cli(env, "add", "mallory")
    bystander_token = token_cli(env, "add", "bystander")
    with http_server(env, transport="sse") as url:
        async with (
            httpx2.AsyncClient(timeout=httpx2.Timeout(30, read=None)) as http,
            bystander_on(url, bystander_token) as bystander,
            sse_session(http, url, TEST_TOKEN) as victim,
            sse_session(http, url, mallory_token) as mallory,
        ):
            await handshake(http, victim)
            await victim.post(http, tool_call(2, f"guarded = {VICTIM_VALUE!r}"))
            tool_text(await victim.answer(2))
            # The victim starts something long; mallory goes for it while it runs.
            await victim.post(http, tool_call(3, f"import time; time.sleep(3); print({VICTIM_CANARY!r})"))

            mine, victims = mallory.session_id, victim.session_id
            injections = [
                cancel(3),  # what the red team did: the victim's run never answered
                tool_call(INJECTED, f"print({INJECTED!r})"),  # a request answered on the victim's stream
                {"jsonrpc": "2.0", "id": 0, "result": {"action": "accept"}},  # an answer to a server request
            ]
            for query in [
                f"session_id={mine}&session_id={victims}",
                f"session_id={victims}&session_id={mine}",
                f"session_id={mine}&session%5Fid={victims}",
                f"session_id={mine}&session_id={victims}&session_id={mine}",
            ]:
                for message in injections:
                    refused = await http.post(victim.post_url(query), json=message, headers=[bearer(mallory_token)])
                    assert refused.status_code == 400, (query, refused.status_code, refused.text)
                    assert "more than once" in refused.text
            # One of each, but not hers: refused as an unknown session.
            for query, extra in [
                (f"session%5Fid={victims}", []),
                (f"session_id={victims}", [("Mcp-Session-Id", mine)]),
            ]:
                refused = await http.post(
                    victim.post_url(query), json=cancel(3), headers=[bearer(mallory_token), *extra]
                )
                assert refused.status_code == 404, (query, refused.status_code, refused.text)

            # The victim's run finished and answered; nothing of mallory's reached the victim's stream.
            assert VICTIM_CANARY in tool_text(await victim.answer(3))
            await victim.post(http, tool_call(4, "guarded"))
            assert VICTIM_VALUE in tool_text(await victim.answer(4))
            assert INJECTED not in json.dumps(victim.received)
            # The server still serves mallory's own session and the bystander kept its state.
            await handshake(http, mallory)
            await mallory.post(http, tool_call(2, "6 * 7"))
            assert tool_text(await mallory.answer(2)).splitlines()[0] == "42"
            assert BYSTANDER_VALUE in text_of(await run(bystander, "guarded"))


async def test_repeated_identity_headers_on_streamable_http_are_refused(dirs: ServerDirs) -> None:
    env = server_env(dirs)
    mallory_token = token_cli(env, "add", "mallory")
    bystander_token = token_cli(env, "add", "bystander")
    with http_server(env) as url:
        async with (
            httpx2.AsyncClient(timeout=httpx2.Timeout(30, read=None)) as http,
            bystander_on(url, bystander_token) as bystander,
        ):

            async def open_session(token: str) -> str:
                opened = await http.post(url, json=initialize(), headers=[bearer(token), *JSON_HEADERS.items()])
                assert opened.status_code == 200, opened.text
                session_id = opened.headers["mcp-session-id"]
                done = await http.post(url, json=INITIALIZED, headers=session_headers(token, session_id))
                assert done.status_code == 202, done.text
                return session_id

            def session_headers(token: str, *session_ids: str) -> list[tuple[str, str]]:
                ids = [("Mcp-Session-Id", session_id) for session_id in session_ids]
                return [bearer(token), *JSON_HEADERS.items(), ("Mcp-Protocol-Version", PROTOCOL), *ids]

            async def call(headers: list[tuple[str, str]], code: str) -> httpx2.Response:
                return await http.post(url, json=tool_call(9, code), headers=headers)

            victims = await open_session(TEST_TOKEN)
            tool_text(answer_of(await call(session_headers(TEST_TOKEN, victims), f"guarded = {VICTIM_VALUE!r}")))
            mine = await open_session(mallory_token)

            hijack = f"guarded = {INJECTED!r}"
            for method, headers in [
                # Two session ids, hers either side of his own: end her session, or act in it.
                ("DELETE", session_headers(mallory_token, mine, victims)),
                ("DELETE", session_headers(mallory_token, victims, mine)),
                ("POST", session_headers(mallory_token, mine, victims)),
                ("GET", session_headers(mallory_token, victims, mine)),
                # Two tokens (whichever comes first), two client names, two protocol versions.
                ("POST", [*session_headers(mallory_token, victims), bearer(TEST_TOKEN)]),
                ("POST", [bearer(TEST_TOKEN), *session_headers(mallory_token, victims)]),
                (
                    "POST",
                    [*session_headers(mallory_token, mine), ("X-CodeRunner-Client", "a"), ("X-CodeRunner-Client", "b")],
                ),
                ("POST", [*session_headers(mallory_token, mine), ("Mcp-Protocol-Version", "2025-03-26")]),
            ]:
                body = json.dumps(tool_call(9, hijack)).encode() if method == "POST" else None
                refused = await http.request(method, url, content=body, headers=headers)
                assert refused.status_code == 400, (method, headers[0], refused.status_code, refused.text)
                assert "more than once" in refused.text

            # Her session lives and kept its state; his own still works; the bystander kept its state.
            kept = tool_text(answer_of(await call(session_headers(TEST_TOKEN, victims), "guarded")))
            assert VICTIM_VALUE in kept and INJECTED not in kept
            own = tool_text(answer_of(await call(session_headers(mallory_token, mine), "6 * 7")))
            assert own.splitlines()[0] == "42"
            assert BYSTANDER_VALUE in text_of(await run(bystander, "guarded"))
