"""AgentWatch: a front door's one long poll of one node agent, routing what changed to its sessions.

A front door waits on a node for a running job's progress and end, and for the hosts a proxy asks its
user about. Each of the agent's sessions publishes that as its news (agent.py `changes_since`,
sessions/changes.py); this keeps ONE call to the agent waiting for the first change among the sessions
that follow it now (those with a running job or a call that can ask), hands each changed session its
news and tells those the agent no longer holds that they were dropped. A session with nothing under way
does not follow, so an idle front door makes no call at all, and an idle session costs a poll nothing.

A session that starts to follow while the call waits without it wakes that call (`wake`): it returns,
and the next asks about every follower. Both calls go by the agent's session channel when the front door
has one (agent_link.py), else by Ray; a poll the channel dropped is asked again by Ray (a poll changes
nothing). An agent that stops answering ends the watch: each follower
is told why (`lost`), and the next follow starts a new one.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup

from coderunner.cluster.session_channel import AgentChannel, or_else
from coderunner.cluster.wire import SessionNews
from coderunner.sessions.changes import Changed

log = logging.getLogger(__name__)

#: How long one poll waits on the agent for a change (then asks again: a front door gone leaves nothing longer).
POLL_WAIT_S = 30.0
#: Bound on an agent's answer beyond the wait it was asked for.
ANSWER_S = 30.0


class Follower(Protocol):
    """A session at the front door, told what its agent published for it."""

    def news(self, news: SessionNews) -> None: ...

    def dropped(self) -> None: ...

    def lost(self, exc: BaseException) -> None: ...


class AgentWatch:
    """The long poll of one agent for this front door's sessions on it, their keys their session ids.
    `channel`: the agent's session channel as the front door has it now (None: calls go by Ray)."""

    def __init__(
        self, agent: Any, task_group: TaskGroup, channel: Callable[[], AgentChannel | None] = lambda: None
    ) -> None:
        self.agent = agent
        self._channel = channel
        self._group = task_group
        self._followers: dict[str, Follower] = {}
        #: The version of each session's news seen last (kept while it does not follow: a follow that
        #: comes back asks from there, and an unchanged session costs no answer).
        self._versions: dict[str, int | None] = {}
        #: The sessions the call under way asks about (None: no call under way).
        self._asked: frozenset[str] | None = None
        self._polling = False
        #: The name of this watch's wait on the agent (what `wake` ends).
        self._name = secrets.token_hex(8)
        self.polls = 0

    def follow(self, key: str, follower: Follower) -> None:
        """Route `key`'s news to `follower` from now on (again: nothing)."""
        if self._followers.get(key) is follower:
            return
        self._followers[key] = follower
        self._versions.setdefault(key, None)
        if not self._polling:
            self._polling = True
            self._group.start_soon(self._poll)
        elif self._asked is not None and key not in self._asked:
            self._group.start_soon(self._wake)

    def unfollow(self, key: str, follower: Follower) -> None:
        if self._followers.get(key) is follower:
            del self._followers[key]

    def forget(self, key: str) -> None:
        """The session is closed: nothing of it is kept."""
        self._followers.pop(key, None)
        self._versions.pop(key, None)

    def following(self, key: str) -> bool:
        return key in self._followers

    async def _call(self, name: str, *args: Any) -> Any:
        """`name(*args)` of the agent, by its session channel or by Ray (session_channel.or_else)."""
        return await or_else(self._channel(), name, args, lambda: getattr(self.agent, name).remote(*args))

    async def _wake(self) -> None:
        with contextlib.suppress(Exception), anyio.move_on_after(ANSWER_S):
            await self._call("wake", self._name)

    async def _poll(self) -> None:
        """While a session follows: one call waiting on the agent, its answer routed, again."""
        try:
            while self._followers:
                asked = {key: self._versions.get(key) for key in self._followers}
                self._asked = frozenset(asked)
                self.polls += 1
                try:
                    with anyio.fail_after(POLL_WAIT_S + ANSWER_S):
                        changed: Changed = await self._call("changes_since", asked, POLL_WAIT_S, self._name)
                except Exception as exc:  # the agent is gone, or does not answer: every follower hears it
                    log.info("the long poll of an agent: %r", exc)
                    followers = list(self._followers.values())
                    self._followers.clear()
                    self._asked, self._polling = None, False  # a follow from here on starts a new poll
                    for follower in followers:
                        follower.lost(exc)
                    return
                self._asked = None
                self._route(changed)  # a follow from a follower's news joins the next call
        except BaseException:
            self._asked = None
            raise
        finally:
            if not self._followers:
                self._polling = False

    def _route(self, changed: Changed) -> None:
        for key, (version, news) in changed.values.items():
            self._versions[key] = version
            follower = self._followers.get(key)
            if follower is not None:
                follower.news(news)
        for key in changed.gone:
            self._versions.pop(key, None)
            follower = self._followers.pop(key, None)
            if follower is not None:
                follower.dropped()
