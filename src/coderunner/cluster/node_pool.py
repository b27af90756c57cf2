"""Warm pools per node: a few session actors started ahead on each node, claimed by a create.

As kubernetes-sigs/agent-sandbox's SandboxWarmPool and SandboxClaim: a NodePool actor (detached, pinned
to its node) keeps `size` pooled SessionActors ready (each with a started sandbox and a warm kernel,
named `session-<id>` from the start). A front door's create with the default options asks the pools
for one; the pool hands its id out once (claims are made one at a time in the pool actor) and starts a
replacement. The front door then opens the session in that actor, which adopts its warm sandbox. A pool
that has none answers None and the create starts cold, placed by Ray's scheduler.

A pooled session is built from the settings of the front door that made its pool and keeps them, so a
pool is named by the key of those settings too (`pool-<node id>-<key>`, pool_key.py): front doors with
the same settings share a node's pool, one with other settings (another allowlist, other limits or
timeouts, the same user's after a change and a restart) has a pool of its own. A pool that no front
door has visited for ORPHAN_S (its settings changed, or its front doors are gone) ends its sessions and
itself; a front door visits its pools at each scan (ClusterHost._keep_pools).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from typing import Any

import anyio
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from coderunner.cluster.actor import SessionActor
from coderunner.cluster.placement import Request, backend_resource
from coderunner.cluster.pool_key import pool_key
from coderunner.cluster.wire import NAMESPACE, SessionInfo, actor_name
from coderunner.sessions.sandbox_options import SandboxOptions

log = logging.getLogger(__name__)

#: Bound on one pooled actor's start (its process, manager, sandbox and kernel).
PRESTART_S = 120.0
#: Bound on asking one node's pool for a ready session.
CLAIM_S = 5.0
#: Pause after a failed start before the next try (a full node, a broken backend).
RETRY_S = 10.0
#: A pool no front door visited for this long ends its sessions and itself (front doors visit every
#: POOL_SCAN_S, host.py: 30 s), and how often it looks.
ORPHAN_S = 300.0
ORPHAN_CHECK_S = 30.0
#: After ending its sessions, how long a retiring pool waits for those kills to leave before it exits.
RETIRE_GRACE_S = 2.0

PooledActor = ray.remote(SessionActor)


def pool_name(node_id: str, key: str) -> str:
    """The pool of `node_id` for front doors whose settings have `key` (pool_key.py)."""
    return f"pool-{node_id}-{key}"


class NodePool:
    """Keeps `size` pooled session actors ready on one node (a Ray actor itself: `ray.remote(NodePool)`),
    all started from `settings`, for the front doors whose settings have its key."""

    def __init__(
        self, settings: dict[str, Any], node_id: str, size: int, actor_options: dict[str, Any],
        orphan_s: float = ORPHAN_S,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.node_id = node_id
        self.size = size
        self.actor_options = actor_options
        self.orphan_s = orphan_s
        self.ready: list[tuple[str, Any]] = []
        self.starting = 0
        self.claimed = 0
        self.retiring = False
        self._visited = time.monotonic()
        self._wake = anyio.Event()
        self._running = False
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Begin filling (once; later calls only wake it). Each call is a front door's visit: a pool
        visited within `orphan_s` stays."""
        self._visited = time.monotonic()
        if not self._running:
            self._running = True
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._fill()), loop.create_task(self._retire_when_orphaned())]
        self._wake.set()

    async def claim(self) -> tuple[str, Any] | None:
        """A ready session actor's id and handle, handed out once; None when none is ready."""
        self._visited = time.monotonic()
        if self.retiring or not self.ready:
            return None
        session_id, actor = self.ready.pop(0)
        self.claimed += 1
        self._wake.set()
        return session_id, actor

    async def stats(self) -> dict[str, Any]:
        return {"node": self.node_id, "size": self.size, "ready": len(self.ready), "starting": self.starting,
                "claimed": self.claimed, "retiring": self.retiring}  # fmt: skip

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

    async def _retire_when_orphaned(self) -> None:
        while time.monotonic() - self._visited < self.orphan_s:
            await anyio.sleep(min(ORPHAN_CHECK_S, self.orphan_s))
        log.info("node %s: no front door used this pool for %.0fs: ending it", self.node_id[:12], self.orphan_s)
        await self.retire()

    async def retire(self) -> None:
        """Stop filling, end every ready session (nobody will claim them: their settings are nobody's now),
        then end this actor (its name is free again for a front door with these settings)."""
        self.retiring = True
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()  # a start under way kills what it began (_start_one)
        for _, actor in self.ready:
            kill(actor)
        self.ready.clear()
        await anyio.sleep(RETIRE_GRACE_S)  # the kills are requests: let them leave before the process goes
        end_process()

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
        except BaseException:  # cancelled: the pool retires, and nobody else knows this actor
            kill(actor)
            raise
        if not ready:
            kill(actor)
            return None
        return session_id, actor


def kill(actor: Any) -> None:
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)


def end_process() -> None:
    """A retired pool's exit (Ray then frees its name: it is never restarted, max_restarts=0)."""
    os._exit(0)


PoolActor = ray.remote(NodePool)


class NodePools:
    """A front door's view of the pools of its settings: one per live node that offers the backend, found
    or made by name (`pool-<node id>-<key of its settings>`)."""

    def __init__(self, settings_sent: dict[str, Any], size: int, request: Request) -> None:
        self.settings_sent = settings_sent
        self.key = pool_key(settings_sent)
        self.size = size
        self.request = request
        # Pinned to their node: the labels chose the node (ensure), the actors need no selector.
        self.actor_options = {key: value for key, value in request.actor_options().items() if key != "label_selector"}
        self.pools: dict[str, Any] = {}
        self._turn = 0

    def ensure(self) -> None:
        """Find or start the pool of every live node that offers the backend and carries the front door's
        labels, and visit it, so that it stays (blocking: a worker thread). Every time, not only for nodes
        not met yet: a pool that ended (no front door for a while) is started again."""
        for node in ray.nodes():
            node_id = node["NodeID"]
            offers = node.get("Resources", {}).get(backend_resource(self.request.backend), 0) >= 1
            if not node.get("Alive") or not offers or not self.request.labelled(node):
                continue
            handle: Any = PoolActor.options(
                name=pool_name(node_id, self.key), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(self.settings_sent, node_id, self.size, self.actor_options)  # fmt: skip
            handle.start.remote()
            self.pools[node_id] = handle

    async def take(self, options: SandboxOptions, owner: str, bound_s: float) -> tuple[Any, SessionInfo] | None:
        """A pooled session opened for `owner` (its actor and its SessionInfo), or None: none ready, or it
        could not open (then the create starts cold). The claim brings this front door's settings key: a
        pooled session started with other settings refuses it and ends."""
        claimed = await self.claim(CLAIM_S)
        if claimed is None:
            return None
        _, actor = claimed
        try:
            with anyio.fail_after(bound_s):
                info: SessionInfo = await actor.open.remote(options, owner, None, self.key)
        except (ValueError, TimeoutError, ray.exceptions.RayError) as exc:
            log.info("a pooled session could not be opened (%r): starting one cold", exc)
            return None
        return actor, info

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
