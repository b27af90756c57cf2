"""A session's calls at the front door (cluster/remote_session.py) by its agent's session channel, on real
sockets, and what they do when the channel cannot carry them: nothing sent goes by Ray; a call cut off
halfway asks Ray whether the agent lives, and says the session was lost only if it did not."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray

from coderunner.cluster.agent_link import AgentLink
from coderunner.cluster.remote_session import RemoteSession
from coderunner.cluster.session_channel import ChannelAddress, ChannelServer
from coderunner.cluster.wire import NodeInfo, SessionInfo
from coderunner.config import load_settings
from coderunner.errors import SessionError
from coderunner.sandbox.base import Limits
from coderunner.sessions.sandbox_options import SandboxOptions

pytestmark = pytest.mark.anyio

SESSION = "s1"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Remote:
    """`method.remote(*args)` of a Ray actor handle: a coroutine, as Ray's ObjectRef is awaited."""

    def __init__(self, method: Any) -> None:
        self.method = method

    def remote(self, *args: Any) -> Any:
        return self.method(*args)


class Agent:
    """A node agent reached both ways: by Ray (`call.remote`, `ping.remote`) and by its channel server,
    each call noted with the way it came."""

    def __init__(self) -> None:
        self.server = ChannelServer(self._over_channel)
        self.ways: list[tuple[str, str]] = []
        self.alive = True
        self.call = Remote(lambda *args: self._call("ray", *args))
        self.ping = Remote(self._ping)
        self.channel = Remote(lambda: self.server.start("127.0.0.1"))

    async def _over_channel(self, name: str, args: tuple[Any, ...]) -> Any:
        assert name == "call"
        return await self._call("channel", *args)

    async def _call(self, way: str, session_id: str, method: str, args: Sequence[Any] = ()) -> Any:
        self.ways.append((way, method))
        if method == "slow":
            await anyio.sleep(30)
        return f"{method} answered"

    async def _ping(self) -> str:
        if not self.alive:
            raise ray.exceptions.RayActorError()
        return "node"


async def session_of(agent: Agent, group: Any) -> tuple[RemoteSession, AgentLink]:
    settings = load_settings(Path(os.devnull), export_dir="")
    options = SandboxOptions(network="none", limits=Limits(), timeout_s=60, client="alice")
    info = SessionInfo(SESSION, "alice/1", options, NodeInfo("n" * 56, "10.0.0.7"), generation=0)
    link = AgentLink(agent, group)
    with anyio.fail_after(10):
        while link.channel is None:
            await anyio.sleep(0.01)
    return RemoteSession(agent, info, settings, group, link=link), link


async def test_a_sessions_calls_take_the_channel_and_go_by_ray_when_it_cannot_connect() -> None:
    agent = Agent()
    async with anyio.create_task_group() as group:
        session, link = await session_of(agent, group)
        assert await session.acall("status") == "status answered"
        assert agent.ways == [("channel", "status")]
        assert link.channel is not None
        address = link.channel.address
        agent.server.close()
        link.channel.close()
        await anyio.sleep(0.05)
        # The agent listens no more (nothing could be sent): Ray carries the call, and the session lives on.
        link.channel = type(link.channel)(ChannelAddress(address.host, address.port, address.key))
        assert await session.acall("status") == "status answered"
        assert agent.ways[-1] == ("ray", "status") and not session.closed
        group.cancel_scope.cancel()


@pytest.mark.parametrize("alive", [True, False])
async def test_a_call_cut_off_halfway_is_not_sent_again_and_ray_says_whether_the_session_lives(alive: bool) -> None:
    agent = Agent()
    async with anyio.create_task_group() as group:
        session, _ = await session_of(agent, group)
        agent.alive = alive

        async def cut_off() -> None:
            await anyio.sleep(0.2)
            agent.server.close()  # the agent's end of every connection, with the call under way

        group.start_soon(cut_off)
        with pytest.raises(SessionError) as failed:
            await session.acall("slow")
        assert agent.ways == [("channel", "slow")]  # never sent again, by Ray or otherwise
        if alive:
            assert "was cut off on its way" in str(failed.value) and "whether it ran is unknown" in str(failed.value)
            assert not session.closed
        else:
            assert f"session {SESSION} was lost with" in str(failed.value)
            assert session.closed
        group.cancel_scope.cancel()


async def test_a_link_closed_from_a_worker_thread_ends_its_connection_on_its_loop() -> None:
    """A session learns in a worker thread that its agent died (RemoteSession.gone): the front door then drops
    its link, whose connection must be ended on the event loop that owns it."""
    agent = Agent()
    async with anyio.create_task_group() as group:
        session, link = await session_of(agent, group)
        assert await session.acall("status") == "status answered"
        assert len(agent.server._writers) == 1
        await anyio.to_thread.run_sync(link.close)
        with anyio.fail_after(5):
            while agent.server._writers:
                await anyio.sleep(0.01)
        group.cancel_scope.cancel()
