"""A front door's node agents (agent.py): their handles, started or found, and where a new session goes.

One handle per node, kept: a session id names its node and settings key (wire.new_session_id), so a
call reaches its agent without a lookup by name; a front door asks Ray for an agent by name only the
first time it meets a node (or an id of another key), and forgets a handle whose agent died.

Placement (placement.py): the nodes that could ever hold the request (its labels, the node's totals),
two of them at random, the lighter with room chosen, the others asked only when neither has room; a
session whose snapshot or workspace is on one node goes to that node's. What two agents hold is asked
of them only when one of their answers is missing or older than USABLE_LOAD_S: else their answers,
with what this front door placed on them since, choose, and no create or run waits for a round trip
(4-5 ms on this machine, a third of a pooled create). The agent a session opens on answers its load
with the open (`heard`); the others whose answers placing it used are older than KNOWN_LOAD_S are
asked again once the create is done (`settle`: not beside its open, whose agent they would
slow), as the node table is (node_table.py), so a front door in use places by answers a moment old.
An agent a stale answer misjudged refuses (NoRoomNow), and the create is placed again on fresh
answers: staleness can cost a second placement or a cold start where a warm sandbox was free, never
an overfull node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import ray
from anyio.abc import TaskGroup
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coderunner.cluster.agent import NodeAgent
from coderunner.cluster.placement import Request, backend_resource, best_of, no_room
from coderunner.cluster.pool_key import pool_key
from coderunner.cluster.session_channel import AgentChannel, or_else
from coderunner.cluster.wire import NAMESPACE, NODE_TAG_CHARS, AgentLoad, agent_name, route_of
from coderunner.errors import SessionError

log = logging.getLogger(__name__)

#: Concurrent calls one agent serves: every session's long polls of jobs, file pieces, status, for all
#: the sessions of its node (each held call is a coroutine on its event loop, not a thread).
AGENT_CONCURRENCY = 2048
#: Bound on an agent's start on its node (a Ray worker process, then its manager: dirs, backend, pool).
AGENT_START_S = 120.0
#: How many agents a placement asks first (best of two).
CHOICES = 2
#: An agent's answer to a visit this old at most places sessions without asking it first (the node
#: table's FRESH_S: a node that stopped answering is met about as late either way).
USABLE_LOAD_S = 10.0
#: An answer older than this is asked again in the background once it has placed something: other front
#: doors place there too, its sessions close and its pool refills.
KNOWN_LOAD_S = 2.0

AgentActor = ray.remote(NodeAgent)


class Agents:
    """The agents of one front door's settings, one per node, by node id."""

    def __init__(self, settings_sent: dict[str, Any], defaults: Request) -> None:
        self.settings_sent = settings_sent
        self.key = pool_key(settings_sent)
        #: A session with the default options: its backend and labels say which nodes may hold ours.
        self.defaults = defaults
        self._handles: dict[tuple[str, str], Any] = {}
        self._node_ids: dict[str, str] = {}
        #: Each node's agent's last answer to a visit (monotonic time, load), with what was placed there since.
        self._known: dict[str, tuple[float, AgentLoad]] = {}
        #: Nodes whose agents are being asked again in the background.
        self._refreshing: set[str] = set()
        #: Nodes whose answers placed something while aging, by id: asked again once that settles.
        self._aging: dict[str, dict[str, Any]] = {}
        #: Placements on each node not settled yet (a create opening, a run going), by node id.
        self._placing: Counter[str] = Counter()
        #: The session channel to an agent, if the front door has one yet (agent_link.py): visits take it.
        self.channel_of: Callable[[Any], AgentChannel | None] = lambda handle: None
        #: Told of each handle forgotten (its agent died): what the front door keeps of it goes too.
        self.forgotten: Callable[[Any], None] = lambda handle: None

    # --- handles ---------------------------------------------------------------------------------

    def start(self, node_id: str) -> Any:
        """This front door's agent on `node_id`, started if none runs (blocking: a worker thread)."""
        handle = self._handles.get((node_id, self.key))
        if handle is None:
            handle = AgentActor.options(
                name=agent_name(node_id, self.key), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_restarts=0, max_concurrency=AGENT_CONCURRENCY,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(self.settings_sent, self.key)  # fmt: skip
            self._handles[(node_id, self.key)] = handle
        return handle

    async def _started(self, node_id: str) -> Any:
        """`start` from the event loop: the handle kept, or (the first time) started in a worker thread."""
        handle = self._handles.get((node_id, self.key))
        return handle if handle is not None else await anyio.to_thread.run_sync(self.start, node_id)

    def of_session(self, session_id: str) -> tuple[str, Any] | None:
        """(node id, agent) of a session id, found by name only the first time (blocking: a worker thread);
        None for an id no agent could hold (not one of ours, its node or agent gone): never starts one."""
        route = route_of(session_id)
        if route is None:
            return None
        tag, key = route
        node_id = self._node_ids.get(tag) or self._learn_node(tag)
        if node_id is None:
            return None
        handle = self._handles.get((node_id, key))
        if handle is None:
            try:
                handle = ray.get_actor(agent_name(node_id, key), namespace=NAMESPACE)
            except ValueError:
                return None
            self._handles[(node_id, key)] = handle
        return node_id, handle

    def _learn_node(self, tag: str) -> str | None:
        for node in ray.nodes():
            self._node_ids[node["NodeID"][:NODE_TAG_CHARS]] = node["NodeID"]
        return self._node_ids.get(tag)

    def forget(self, node_id: str, handle: Any) -> None:
        """Its agent died: the next session on that node starts a new one."""
        for place, known in list(self._handles.items()):
            if place[0] == node_id and known is handle:
                del self._handles[place]
        self._known.pop(node_id, None)
        self.forgotten(handle)

    # --- placement -------------------------------------------------------------------------------

    async def visit_all(self, nodes: list[dict[str, Any]]) -> None:
        """Start (or visit, so that it stays) the agent of every node that may hold this front door's
        sessions: their warm pools fill before the first create."""
        for node in nodes:
            offers = node.get("Resources", {}).get(backend_resource(self.defaults.backend), 0) >= 1
            if node.get("Alive") and offers and self.defaults.labelled(node):
                with contextlib.suppress(Exception):
                    await self._load(node)

    async def place(
        self, request: Request, nodes: list[dict[str, Any]], warm_wanted: bool, home: str | None = None,
        run: bool = False, fresh: bool = False,
    ) -> tuple[str, Any]:  # fmt: skip
        """(node id, agent) for a new session (a one-shot `run`): `home`'s if given, else the best of two
        with room (placement.best_of), by their last answers unless `fresh` (an agent chosen so refused:
        NoRoomNow). Each placement but `home`'s is `settle`d once its create or run is over."""
        if home is not None:
            return home, await self._started(home)
        fitting = [node for node in nodes if node.get("Alive") and request.fits(node)]
        random.shuffle(fitting)
        known = None if fresh else self._known_answers(fitting[:CHOICES])
        chosen = best_of(request, known, warm_wanted, run) if known else None
        if known is not None and chosen is not None:
            self._spend(chosen, request, warm_wanted, run)
            self._note_aging([node for node, _ in known])
            self._placing[chosen] += 1
            return chosen, self._handles[(chosen, self.key)]
        answers: list[tuple[dict[str, Any], AgentLoad]] = []
        failures: list[Exception] = []

        async def ask(node: dict[str, Any], found: list[tuple[dict[str, Any], AgentLoad]]) -> None:
            try:
                found.append((node, await self._load(node)))
            except Exception as exc:  # its agent would not start: the others may hold the session
                failures.append(exc)

        for first in range(0, len(fitting), CHOICES):
            found: list[tuple[dict[str, Any], AgentLoad]] = []
            async with anyio.create_task_group() as group:
                for node in fitting[first : first + CHOICES]:
                    group.start_soon(ask, node, found)
            answers += found
            chosen = best_of(request, found, warm_wanted, run)
            if chosen is not None:
                self._spend(chosen, request, warm_wanted, run)
                self._placing[chosen] += 1
                return chosen, self._handles[(chosen, self.key)]
        if failures and not answers:
            raise failures[0]
        raise no_room(request, answers)

    async def _load(self, node: dict[str, Any], again: bool = True) -> AgentLoad:
        """What `node`'s agent holds (a visit: it starts if need be). An agent found dead (a visit changes
        nothing, so asking again is harmless) is forgotten and the node's next one asked, once."""
        node_id = node["NodeID"]
        handle = await self._started(node_id)
        try:
            with anyio.fail_after(AGENT_START_S):
                load = await self._visit(handle)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            raise cause if isinstance(cause, SessionError) else SessionError(f"node {node_id[:12]}: {exc}") from None
        except TimeoutError:
            raise SessionError(f"the agent of node {node_id[:12]} did not start within {AGENT_START_S:g}s") from None
        except ray.exceptions.RayError as exc:
            self.forget(node_id, handle)
            if again and isinstance(exc, ray.exceptions.RayActorError):
                return await self._load(node, again=False)
            raise SessionError(f"the agent of node {node_id[:12]} is gone ({type(exc).__name__}); try again") from None
        self._known[node_id] = (time.monotonic(), load)
        return load

    async def _visit(self, handle: Any) -> AgentLoad:
        """A visit, by the agent's session channel or by Ray (session_channel.or_else)."""
        load: AgentLoad = await or_else(self.channel_of(handle), "visit", (), lambda: handle.visit.remote())
        return load

    def _known_answers(self, nodes: list[dict[str, Any]]) -> list[tuple[dict[str, Any], AgentLoad]] | None:
        """Each of `nodes` with its agent's answer of under USABLE_LOAD_S ago; None unless every one has one."""
        now = time.monotonic()
        answers = []
        for node in nodes:
            node_id = node["NodeID"]
            at, load = self._known.get(node_id, (float("-inf"), None))
            if load is None or now - at > USABLE_LOAD_S or (node_id, self.key) not in self._handles:
                return None
            answers.append((node, load))
        return answers

    def _note_aging(self, nodes: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        for node in nodes:
            if now - self._known.get(node["NodeID"], (float("-inf"), None))[0] > KNOWN_LOAD_S:
                self._aging[node["NodeID"]] = node

    def heard(self, node_id: str, load: AgentLoad) -> None:
        """An agent's load as its answer to an open said (the session counted): as good as a visit's, unless
        other placements on it are still under way (its answer would drop what they spent)."""
        if self._placing[node_id] <= 1:
            self._known[node_id] = (time.monotonic(), load)

    def settle(self, node_id: str, task_group: TaskGroup) -> None:
        """A placement on `node_id` is over (opened, refused or failed; a run ended). Then the agents whose aging
        answers placed something and that no answer made fresh since are asked again, in `task_group`: after
        the create, not beside its open, whose agent they would slow."""
        self._placing[node_id] -= 1
        if self._placing[node_id] <= 0:
            del self._placing[node_id]
        now = time.monotonic()
        aging, self._aging = self._aging, {}
        for aging_id, node in aging.items():
            at, _ = self._known.get(aging_id, (float("-inf"), None))
            if now - at > KNOWN_LOAD_S and aging_id not in self._refreshing:
                self._refreshing.add(aging_id)
                task_group.start_soon(self._refresh_quietly, node)

    async def _refresh_quietly(self, node: dict[str, Any]) -> None:
        try:
            await self._load(node)
        except Exception as exc:  # its agent is gone or busy starting: the next placement without an answer asks
            log.info("asking the agent of node %s again: %r", node["NodeID"][:12], exc)
            self._known.pop(node["NodeID"], None)
        finally:
            self._refreshing.discard(node["NodeID"])

    def _spend(self, node_id: str, request: Request, warm_wanted: bool, run: bool) -> None:
        """Count a session (a run) placed on `node_id` in its known answer, for the placements that follow
        it before the agent is asked again."""
        found = self._known.get(node_id)
        if found is None:
            return
        at, load = found
        self._known[node_id] = (at, dataclasses.replace(
            load, sessions=load.sessions + 1, cpus=load.cpus + request.cpus,
            memory_mb=load.memory_mb + (request.memory_mb or 0),
            warm=load.warm - 1 if warm_wanted and not run and load.warm > 0 else load.warm,
            ready_runs=load.ready_runs - 1 if run and load.ready_runs > 0 else load.ready_runs,
        ))  # fmt: skip
