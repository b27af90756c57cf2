"""Abuse of a node agent's session channel (cluster/session_channel.py) by a process that reaches its port
without the agent's key: a pickle that would write a canary, sent where a proof or a call is read, is
never unpickled; a silent peer is cut; a flood of connections cannot shut out the front door. Meanwhile a
front door's call under way is answered and the channel serves on. (Whether a sandbox reaches the port at
all: tests/cluster/test_cluster_auth.py probes every listener of a node, this one included.)"""

from __future__ import annotations

import asyncio
import os
import pickle
import secrets
import socket
import struct
from pathlib import Path
from typing import Any

import pytest

from coderunner.cluster import session_channel
from coderunner.cluster.session_channel import CHALLENGE_BYTES, AgentChannel, ChannelServer

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class WritesCanary:
    """Unpickled, it would write its canary file: proof that a frame was read as data."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"echo crossed > {self.path}",))


async def serve(name: str, args: tuple[Any, ...]) -> Any:
    if name == "after":
        await asyncio.sleep(args[0])
    return args[-1]


def frame(value: Any) -> bytes:
    body = pickle.dumps(value)
    return struct.pack("!I", len(body)) + body


async def attack(host: str, port: int, payload: bytes, read_challenge: bool) -> bytes:
    """Send `payload` (once the agent's challenge came, if `read_challenge`) and read until the agent hangs up."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        if read_challenge:
            await reader.readexactly(CHALLENGE_BYTES)
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    except ConnectionError:
        return b""
    finally:
        writer.close()


async def test_a_peer_without_the_key_gets_nothing_unpickled_and_the_front_door_is_served_throughout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_channel, "HANDSHAKE_S", 0.5)
    monkeypatch.setattr(session_channel, "MAX_CONNECTIONS", 8)
    canary = tmp_path / "canary"
    server = ChannelServer(serve)
    address = await server.start("127.0.0.1")
    door = AgentChannel(address)
    assert await door.call("echo", (1,)) == 1
    bystander = asyncio.ensure_future(door.call("after", (3.0, "still here")))
    poison = frame((1, "echo", (WritesCanary(canary),)))
    # A call frame at once; a call frame once the challenge came; a guessed proof, then call frames. The agent
    # says nothing but its random challenge (unread ones arrive here) and hangs up.
    for payload, read_challenge in ((poison, False), (poison, True), (secrets.token_bytes(64) + poison, True)):
        said = await attack(address.host, address.port, payload * 3, read_challenge)
        assert len(said) == (0 if read_challenge else CHALLENGE_BYTES), said
    # A silent peer is cut within the handshake's bound.
    reader, writer = await asyncio.open_connection(address.host, address.port)
    assert len(await asyncio.wait_for(reader.read(), 5)) == CHALLENGE_BYTES
    writer.close()
    # A flood of silent connections: past the bound they are shut at once, and the front door's own
    # connection (made before) serves on; once they are cut, a new front door connects.
    flood = [socket.create_connection((address.host, address.port)) for _ in range(32)]
    try:
        assert await door.call("echo", ("through the flood",)) == "through the flood"
    finally:
        for sock in flood:
            sock.close()
    await asyncio.sleep(0.8)
    assert await AgentChannel(address).call("echo", ("new door",)) == "new door"
    assert await asyncio.wait_for(bystander, 10) == "still here"
    assert not canary.exists()
    door.close()
    server.close()
