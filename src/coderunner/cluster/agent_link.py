"""AgentLink: what one front door keeps of one node agent: its long poll, its session channel, its life watch.

The long poll (agent_watch.py) brings what the agent's sessions publish; the channel (session_channel.py)
carries their calls in a third of a Ray call's time. The channel's address and key are asked of the agent
once, by Ray, in the background when the link is made: calls made before the answer, or while no
connection can be made, go by Ray, so a link never makes a call wait for the channel.

The life watch is one Ray call kept waiting on the agent (`alive`, answered every LIFE_WAIT_S and made
again): when the agent dies, Ray fails it at once, and the link tells the front door (`on_death`), which
starts the node's next agent while the dead one's watcher still waits for it (host.py), whether or not any
of its sessions is being called.

One idea: a front door's ways to one agent, the fast one used when it is there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import ray
from anyio.abc import TaskGroup

from coderunner.cluster.agent_watch import ANSWER_S, AgentWatch
from coderunner.cluster.session_channel import AgentChannel, ChannelAddress

log = logging.getLogger(__name__)

#: How long the life watch's call waits on the agent before it is answered and made again.
LIFE_WAIT_S = 120.0
#: After a life watch's call failed otherwise than by the agent's death (the cluster slow to answer), the pause
#: before the next.
LIFE_RETRY_S = 5.0

#: Told that the agent died (the handle, and the error Ray gave).
OnDeath = Callable[[Any, BaseException], Awaitable[None]]


class AgentLink:
    """One front door's long poll of `agent`, once its address came its channel, and (`on_death`) its life watch."""

    def __init__(self, agent: Any, task_group: TaskGroup, on_death: OnDeath | None = None) -> None:
        self.agent = agent
        self._loop = asyncio.get_running_loop()
        self.channel: AgentChannel | None = None
        self.watch = AgentWatch(agent, task_group, lambda: self.channel)
        self._life = anyio.CancelScope()
        task_group.start_soon(self._ask_address)
        if on_death is not None:
            task_group.start_soon(self._watch_life, on_death)

    async def _watch_life(self, on_death: OnDeath) -> None:
        """Until the link closes: one call waiting on the agent, made again when answered; its death told once
        (outside the watch's scope: what the front door does then closes this link)."""
        died: BaseException | None = None
        with self._life:
            while died is None:
                try:
                    with anyio.fail_after(LIFE_WAIT_S + ANSWER_S):
                        await self.agent.alive.remote(LIFE_WAIT_S)
                except ray.exceptions.ActorDiedError as exc:
                    died = exc
                except Exception as exc:  # not its death (a slow cluster, a timeout): look again in a while
                    log.info("the life watch of an agent: %r", exc)
                    await anyio.sleep(LIFE_RETRY_S)
        if died is not None:
            log.info("an agent died: %r", died)
            await on_death(self.agent, died)

    async def _ask_address(self) -> None:
        try:
            with anyio.fail_after(ANSWER_S):
                address: ChannelAddress = await self.agent.channel.remote()
        except Exception as exc:  # an agent that does not answer: its calls go by Ray (which will say why)
            log.info("no session channel to an agent: %r", exc)
            return
        self.channel = AgentChannel(address)

    def close(self) -> None:
        """End its channel's connection and its life watch; from any thread (a session learns its agent died in a
        worker thread)."""
        if self.channel is not None:
            self._loop.call_soon_threadsafe(self.channel.close)
        self._loop.call_soon_threadsafe(self._life.cancel)
