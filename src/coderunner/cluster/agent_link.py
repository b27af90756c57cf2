"""AgentLink: what one front door keeps of one node agent: its long poll and its session channel.

The long poll (agent_watch.py) brings what the agent's sessions publish; the channel (session_channel.py)
carries their calls in a third of a Ray call's time. The channel's address and key are asked of the agent
once, by Ray, in the background when the link is made: calls made before the answer, or while no
connection can be made, go by Ray, so a link never makes a call wait for the channel.

One idea: a front door's ways to one agent, the fast one used when it is there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
from anyio.abc import TaskGroup

from coderunner.cluster.agent_watch import ANSWER_S, AgentWatch
from coderunner.cluster.session_channel import AgentChannel, ChannelAddress

log = logging.getLogger(__name__)


class AgentLink:
    """One front door's long poll of `agent` and, once its address came, its channel."""

    def __init__(self, agent: Any, task_group: TaskGroup) -> None:
        self.agent = agent
        self._loop = asyncio.get_running_loop()
        self.channel: AgentChannel | None = None
        self.watch = AgentWatch(agent, task_group, lambda: self.channel)
        task_group.start_soon(self._ask_address)

    async def _ask_address(self) -> None:
        try:
            with anyio.fail_after(ANSWER_S):
                address: ChannelAddress = await self.agent.channel.remote()
        except Exception as exc:  # an agent that does not answer: its calls go by Ray (which will say why)
            log.info("no session channel to an agent: %r", exc)
            return
        self.channel = AgentChannel(address)

    def close(self) -> None:
        """End its channel's connection; from any thread (a session learns its agent died in a worker thread)."""
        if self.channel is not None:
            self._loop.call_soon_threadsafe(self.channel.close)
