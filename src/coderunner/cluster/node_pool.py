"""Warm pools per node: a few session actors started ahead on each node, claimed by a create.

As kubernetes-sigs/agent-sandbox's SandboxWarmPool and SandboxClaim: a NodePool actor (one per node,
named `pool-<node id>`, detached, pinned to its node) keeps `size` pooled SessionActors ready
(each with a started sandbox and a warm kernel, named `session-<id>` from the start). A front
door's create with the default options asks the pools for one; the pool hands its id out once
(claims are made one at a time in the pool actor) and starts a replacement. The front door then
opens the session in that actor, which adopts its warm sandbox. A pool that has none answers None
and the create starts cold, placed by Ray's scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import anyio
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coderunner.cluster.actor import SessionActor
from coderunner.cluster.placement import Request, backend_resource
from coderunner.cluster.wire import NAMESPACE, actor_name

log = logging.getLogger(__name__)

#: Bound on one pooled actor's start (its process, manager, sandbox and kernel).
PRESTART_S = 120.0
#: Pause after a failed start before the next try (a full node, a broken backend).
RETRY_S = 10.0

PooledActor = ray.remote(SessionActor)


def pool_name(node_id: str) -> str:
    return f"pool-{node_id}"


class NodePool:
    """Keeps `size` pooled session actors ready on one node (a Ray actor itself: `ray.remote(NodePool)`)."""

    def __init__(self, settings: dict[str, Any], node_id: str, size: int, actor_options: dict[str, Any]) -> None:
        self.settings = settings
        self.node_id = node_id
        self.size = size
        self.actor_options = actor_options
        self.ready: list[tuple[str, Any]] = []
        self.starting = 0
        self.claimed = 0
        self._wake = anyio.Event()
        self._running = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Begin filling (once; later calls only wake it)."""
        if not self._running:
            self._running = True
            self._task = asyncio.get_running_loop().create_task(self._fill())
        self._wake.set()

    async def claim(self) -> tuple[str, Any] | None:
        """A ready session actor's id and handle, handed out once; None when none is ready."""
        if not self.ready:
            return None
        session_id, actor = self.ready.pop(0)
        self.claimed += 1
        self._wake.set()
        return session_id, actor

    async def stats(self) -> dict[str, Any]:
        return {"node": self.node_id, "size": self.size, "ready": len(self.ready), "starting": self.starting,
                "claimed": self.claimed}  # fmt: skip

    async def _fill(self) -> None:
        while True:
            while len(self.ready) + self.starting < self.size:
                self.starting += 1
                try:
                    started = await self._start_one()
                finally:
                    self.starting -= 1
                if started is None:
                    await anyio.sleep(RETRY_S)
                    break
                self.ready.append(started)
            self._wake = anyio.Event()
            await self._wake.wait()

    async def _start_one(self) -> tuple[str, Any] | None:
        session_id = secrets.token_urlsafe(18)
        actor: Any = PooledActor.options(
            name=actor_name(session_id), namespace=NAMESPACE, lifetime="detached", max_restarts=0,
            max_concurrency=64, scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False),
            **self.actor_options,
        ).remote(self.settings, session_id, pooled=True)  # fmt: skip
        try:
            with anyio.fail_after(PRESTART_S):
                ready = await actor.prestart.remote(PRESTART_S)
        except Exception as exc:
            log.warning("node %s: a pooled session did not start: %r", self.node_id[:12], exc)
            ready = False
        if not ready:
            ray.kill(actor, no_restart=True)
            return None
        return session_id, actor


PoolActor = ray.remote(NodePool)


class NodePools:
    """A front door's view of the pools: one per live node that offers the backend, found or made by name."""

    def __init__(self, settings_sent: dict[str, Any], size: int, request: Request) -> None:
        self.settings_sent = settings_sent
        self.size = size
        self.request = request
        # Pinned to their node: the labels chose the node (ensure), the actors need no selector.
        self.actor_options = {key: value for key, value in request.actor_options().items() if key != "label_selector"}
        self.pools: dict[str, Any] = {}
        self._turn = 0

    def ensure(self) -> None:
        """Find or start the pool of every live node that offers the backend and carries the front door's
        labels (blocking: a worker thread)."""
        for node in ray.nodes():
            node_id = node["NodeID"]
            offers = node.get("Resources", {}).get(backend_resource(self.request.backend), 0) >= 1
            if not node.get("Alive") or not offers or not self.request.labelled(node) or node_id in self.pools:
                continue
            handle: Any = PoolActor.options(
                name=pool_name(node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(self.settings_sent, node_id, self.size, self.actor_options)  # fmt: skip
            handle.start.remote()
            self.pools[node_id] = handle

    async def claim(self, wait_s: float) -> tuple[str, Any] | None:
        """A ready pooled session's id and actor handle from some node's pool (each asked in turn), or None."""
        order = list(self.pools.items())
        self._turn = (self._turn + 1) % max(len(order), 1)
        for node_id, handle in order[self._turn :] + order[: self._turn]:
            try:
                with anyio.fail_after(wait_s):
                    claimed: tuple[str, Any] | None = await handle.claim.remote()
            except Exception as exc:  # its node is gone: ensure() finds it again if it comes back
                log.info("pool of node %s: %r", node_id[:12], exc)
                self.pools.pop(node_id, None)
                continue
            if claimed is not None:
                return claimed
        return None
