"""The session channel (cluster/session_channel.py) on real sockets: calls answered by id, failures crossing as
the tools read them, and each way the connection ends told apart (nothing sent, or sent and cut off)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from coderunner.cluster import session_channel
from coderunner.cluster.session_channel import AgentChannel, ChannelBroken, ChannelServer, ChannelUnused, or_else
from coderunner.errors import SessionBusy, SessionError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def serve(name: str, args: tuple[Any, ...]) -> Any:
    if name == "echo":
        return args
    if name == "after":  # answers after its delay: later calls may be answered first
        await asyncio.sleep(args[0])
        return args[1]
    if name == "busy":
        raise SessionBusy("a cell is running")
    if name == "crash":
        raise ValueError("secret detail")
    if name == "huge":
        return b"x" * args[0]
    if name == "hang":
        await asyncio.Event().wait()
    raise AssertionError(name)


async def test_calls_are_answered_by_their_id_whatever_order_they_end_in() -> None:
    server = ChannelServer(serve)
    channel = AgentChannel(await server.start("127.0.0.1"))
    try:
        slow = asyncio.ensure_future(channel.call("after", (0.3, "slow")))
        fast = [asyncio.ensure_future(channel.call("after", (0.01 * n, n))) for n in range(20)]
        assert await asyncio.gather(*fast) == list(range(20))
        assert not slow.done()
        assert await slow == "slow"
        assert await channel.call("echo", ({"a": [1, 2.5, None]}, "é\udcff")) == ({"a": [1, 2.5, None]}, "é\udcff")
    finally:
        channel.close()
        server.close()


async def test_our_errors_cross_as_themselves_and_any_other_as_a_session_error_naming_only_its_kind() -> None:
    server = ChannelServer(serve)
    channel = AgentChannel(await server.start("127.0.0.1"))
    try:
        with pytest.raises(SessionBusy, match="a cell is running"):
            await channel.call("busy", ())
        with pytest.raises(SessionError, match="failed with ValueError") as crash:
            await channel.call("crash", ())
        assert "secret detail" not in str(crash.value)
        assert await channel.call("echo", (1,)) == (1,)  # the connection serves on
    finally:
        channel.close()
        server.close()


async def test_an_answer_over_the_frame_bound_is_refused_saying_so_and_the_connection_serves_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(session_channel, "MAX_FRAME_BYTES", 1 << 16)
    server = ChannelServer(serve)
    channel = AgentChannel(await server.start("127.0.0.1"))
    try:
        with pytest.raises(SessionError, match="over the session channel's 65536 bytes"):
            await channel.call("huge", (1 << 17,))
        assert await channel.call("huge", (10,)) == b"x" * 10
    finally:
        channel.close()
        server.close()


async def test_no_listener_is_nothing_sent_and_an_agent_gone_mid_call_is_a_call_cut_off() -> None:
    server = ChannelServer(serve)
    address = await server.start("127.0.0.1")
    server.close()
    await asyncio.sleep(0.05)
    with pytest.raises(ChannelUnused):
        await AgentChannel(address).call("echo", (1,))

    server = ChannelServer(serve)
    channel = AgentChannel(await server.start("127.0.0.1"))
    hanging = asyncio.ensure_future(channel.call("hang", ()))
    await asyncio.sleep(0.1)
    server.close()
    with pytest.raises(ChannelBroken):
        await asyncio.wait_for(hanging, 5)


async def test_a_front_door_with_another_key_is_refused_before_it_sends_a_call() -> None:
    served: list[str] = []

    async def record(name: str, args: tuple[Any, ...]) -> Any:
        served.append(name)
        return None

    server = ChannelServer(record)
    address = await server.start("127.0.0.1")
    stranger = AgentChannel(dataclasses.replace(address, key=b"k" * 32))
    with pytest.raises(ChannelUnused):
        await stranger.call("echo", (1,))
    assert served == []
    assert await AgentChannel(address).call("echo", ()) is None
    assert served == ["echo"]
    server.close()


async def test_front_doors_asking_at_once_get_one_address() -> None:
    server = ChannelServer(serve)
    addresses = await asyncio.gather(*(server.start("127.0.0.1") for _ in range(5)))
    assert len(set(addresses)) == 1
    assert await AgentChannel(addresses[0]).call("echo", (1,)) == (1,)
    server.close()


async def test_a_call_that_changes_nothing_goes_the_other_way_when_the_channel_cannot_carry_it() -> None:
    other: list[str] = []

    async def by_ray() -> str:
        other.append("ray")
        return "by ray"

    server = ChannelServer(serve)
    channel = AgentChannel(await server.start("127.0.0.1"))
    assert await or_else(channel, "echo", (1,), by_ray) == (1,) and other == []
    assert await or_else(None, "echo", (1,), by_ray) == "by ray"
    cut_off = asyncio.ensure_future(or_else(channel, "hang", (), by_ray))
    await asyncio.sleep(0.1)
    server.close()  # the call is cut off halfway: asked again the other way
    assert await asyncio.wait_for(cut_off, 5) == "by ray"
    assert await or_else(channel, "echo", (1,), by_ray) == "by ray"  # no listener: nothing sent
    assert other == ["ray"] * 3
