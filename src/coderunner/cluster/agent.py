"""NodeAgent: the sessions of one node, in one detached Ray actor running one long-lived SessionManager.

An actor per session cost a Ray worker process per session (about 1.6 CPU-s to start, 100 MiB held,
0.7% of a core idle); an agent per node is what the local server already is: one manager, its warm
pool, idle reaper, egress proxies, uid claims and exports, for many sessions. Front doors start it
lazily (`get_if_exists`: front doors racing to start it get the same one) pinned to its node, and
reach a session by calling it with the session id first (`call`): the id names its agent (wire.py).

One agent per (node, settings key): `agent-<node id>-<key>` (pool_key.py). A session is built from
its front door's settings (allowlist and ports, limits, timeouts, idle timeout, folders) and so is
everything the manager keeps warm for it; a warm sandbox must never reach a front door whose
settings would not have built it (the pool key's security fix). A manager built from one front
door's settings keeps that true by construction; one manager taking per-session settings would have
to split its pool, reaper and proxies by key itself. Front doors of one configuration, the usual
case, share one agent per node. Its account of reserved CPUs and memory (placement.room_for) is its
own: agents of two keys on one node each count only their sessions.

An agent nobody visited for ORPHAN_S that holds no session (the idle reaper closes those) ends its
warm pool and itself, as the per-node pools did: its name is free again for the next front door.

What front doors wait for in its sessions (a job's progress and end, a host a proxy asks about) they
follow with one long poll per front door and agent (`changes_since`, sessions/changes.py): each session
publishes its news there (session_side.py), and a session nobody is waiting on costs a poll nothing.

The calls of a session's hot path (`call`, `open`, the long poll) also come by the agent's session channel
(session_channel.py), its address and key handed to front doors by Ray (`channel`): a third of a Ray
call's time, on the same event loop as Ray's calls.

An agent that dies (SIGKILL, OOM, a crash) need not take its sessions along: their sandboxes and kernels are
processes of their own. It keeps each session's record and fds with its sandbox watcher (`_keep`,
sessions/adoption.py), which then ends at once only what was not kept, and waits `agent_handover_s` for the
next agent of the same name on the node: that one takes them over as it starts (`_take_over`). A front door
starts it as soon as it learns of the death (a call that found the agent dead, or its life watch: `alive`,
agent_link.py) and finds the session there again (host.py `reattach`).

The manager lives in one task of its own (`_hold`), as anyio's task groups need: entered and left in
the same task. Ray runs the agent's calls on one event loop, many at once (max_concurrency, host.py).

One idea: one node's sessions, for every front door, in one long-lived manager that outlives its own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio

from coderunner.cluster.oneshot_side import run_here
from coderunner.cluster.placement import NoRoomNow, Request, backend_resource, room_for
from coderunner.cluster.session_channel import ChannelAddress, ChannelServer
from coderunner.cluster.session_side import SessionSide
from coderunner.cluster.wire import NODE_LOCAL, AgentLoad, NodeInfo, SessionInfo, agent_name, oneshot_answer
from coderunner.config import Settings, load_settings
from coderunner.errors import CodeRunnerError, SessionError
from coderunner.offload import off_loop
from coderunner.oneshot.local import LocalOneShots
from coderunner.sandbox import SandboxBackend, make_backend
from coderunner.sandbox.bwrap_watch import process_watch
from coderunner.sandbox.handover import handover_path
from coderunner.sessions.adoption import record_mark
from coderunner.sessions.changes import Changed, Changes
from coderunner.sessions.manager import SessionManager
from coderunner.sessions.sandbox_options import SandboxOptions

log = logging.getLogger(__name__)

#: How often the agent forgets sessions its manager closed (idle) and looks whether it is orphaned.
WATCH_INTERVAL_S = 2.0
#: An agent no front door visited for this long, holding no session, ends (front doors visit every
#: AGENT_SCAN_S, host.py, when they keep pools warm; every call is a visit too).
ORPHAN_S = 300.0
#: The longest a front door's life watch (`alive`) waits here before it is answered and asked again.
ALIVE_WAIT_S = 300.0
#: An agent whose manager could not start (a broken backend, a missing shared mount) answers why for
#: this long, then ends, so that the next create tries again.
FAILED_END_S = 5.0
#: Opens abandoned by their front door remembered at once (each closed when its open ends).
MAX_ABANDONED = 256
#: What a session's agent serves of it (session_side.py); `info` and `close` are the agent's own.
SESSION_CALLS = frozenset({
    "start_run", "wait_job", "read_job", "cancel_run", "answer_egress", "cancel_job", "list_jobs", "reset",
    "generation", "take_snapshot", "export_changes", "read_export_piece", "forget_exports", "guest_op",
    "install_packages", "status", "list_files", "read_piece", "stage_piece", "commit_upload",
})  # fmt: skip
#: The agent's calls its session channel serves: a session's calls, the open that makes one, the long poll and
#: a front door's visit (placement's answers).
CHANNEL_CALLS = frozenset({"call", "open", "changes_since", "wake", "visit"})
#: The one-shot calls besides run_oneshot an agent serves (its LocalOneShots'), each in a sandbox of its own.
ONESHOT_CALLS = frozenset({"check_code", "language_versions"})


class NodeAgent:
    """Ray wraps this class (`ray.remote`) in the front door; it holds no Ray import of its own at load."""

    def __init__(self, settings: dict[str, Any], key: str, orphan_s: float = ORPHAN_S) -> None:
        self.key = key
        self.orphan_s = orphan_s
        self.node, self.node_entry = _this_node()
        units = int(self.node_entry.get("Resources", {}).get(backend_resource(str(settings.get("backend"))), 0))
        # The standby kernel waits for a session's first reset (see SessionSide.reset): a burst of creates
        # starts one kernel per session, not two. The node's units bound its sessions; the front doors
        # bound each client's share (this manager serves all of their clients).
        self.settings = node_settings(
            settings, reset_standby=False, max_sessions=max(units, 1), max_sessions_per_client=max(units, 1)
        )
        self._standby_after_reset = bool(settings.get("reset_standby", True))
        self.manager: SessionManager | None = None
        self._sides: dict[str, SessionSide] = {}
        #: Each open session's news (SessionNews), by its id: what front doors' long polls follow.
        self.changes = Changes()
        #: What each session and each one-shot run under way reserved of the node (placement.room_for).
        self._reserved: dict[str, Request] = {}
        self._oneshots: LocalOneShots | None = None
        #: Opens still under way whose front door stopped waiting (abandon).
        self._abandoned: set[str] = set()
        self._entered = asyncio.Event()
        self._failure: BaseException | None = None
        self._main: asyncio.Task[None] | None = None
        self._visited = time.monotonic()
        self._channel = ChannelServer(self._over_channel)
        #: Each session's record mark as last kept with the watcher (adoption.record_mark: its kernel, its proxy's
        #: decisions; kept again when it changes), and why the session would not outlive this agent then (None:
        #: it would), for `holding`.
        self._kept: dict[str, tuple[tuple[Any, ...] | None, str | None]] = {}

    async def _manager(self) -> SessionManager:
        """The node's manager, entered in a task of its own on first use."""
        self._visited = time.monotonic()
        if self._main is None:
            self._main = asyncio.get_running_loop().create_task(self._hold())
        await self._entered.wait()
        if self.manager is None:
            why = str(self._failure) if isinstance(self._failure, CodeRunnerError) else repr(self._failure)
            raise SessionError(f"the session could not start on node {self.node.label}: {why}")
        return self.manager

    async def _hold(self) -> None:
        try:
            backend = make_backend(self.settings)
            async with SessionManager(self.settings, backend) as manager:
                self.manager = manager
                await self._take_over(manager, backend)
                self._entered.set()
                while self._reserved or self._sides or time.monotonic() - self._visited < self.orphan_s:
                    await anyio.sleep(min(WATCH_INTERVAL_S, self.orphan_s))
                    self._forget_closed()
                    for session_id in list(self._sides):
                        self._keep(session_id)  # a kernel replaced in the background (its death, a timeout)
                log.info("node %s: no front door for %.0fs and no session: ending", self.node.label, self.orphan_s)
        except BaseException as exc:
            self._failure = self._failure or exc
            raise
        finally:
            self._entered.set()
            asyncio.get_running_loop().call_later(FAILED_END_S if self.manager is None else 0.2, end_process)

    async def _take_over(self, manager: SessionManager, backend: SandboxBackend) -> None:
        """Before anything else: the sessions this node's previous agent of the same name kept for its successor,
        if it died and its watcher still waits (their room reserved again); and, with agent_handover_s, this
        agent's own kept for the next should it die too."""
        if self.settings.agent_handover_s <= 0:
            return  # its predecessor (of the same name: the same settings, agent_handover_s in) kept nothing either
        path = await off_loop(handover_path, self.settings.runtime_dir, agent_name(self.node.node_id, self.key))
        if backend.name == "bwrap":
            await off_loop(process_watch().watcher.hand_over_on_exit, path, self.settings.agent_handover_s)
        try:
            adopted = await manager.adopt(path, self.settings.startup_timeout_s)
        except Exception:  # never the end of this agent: what was not taken over ends as without a hand-over
            log.exception("node %s: taking over the previous agent's sessions failed", self.node.label)
            return
        for session, record in adopted:
            request: dict[str, Any] = record.extra.get("request") or {}
            try:
                self._reserved[session.session_id] = Request(
                    **{**request, "labels": tuple(tuple(pair) for pair in request.get("labels", ()))}
                )
            except TypeError:  # none, or not what this version writes: reserved as its options say
                self._reserved[session.session_id] = Request.of(session.options, backend.name)
            self._sides[session.session_id] = SessionSide(
                manager, session, self.node, self.settings.transfer_limit_bytes, self._standby_after_reset, self.changes
            )
            self._keep(session.session_id)
            log.info("node %s: session %s… taken over from the previous agent", self.node.label, session.session_id[:6])

    def _keep(self, session_id: str) -> None:
        """Keep a session's record and fds with the watcher, should this agent die (sessions/adoption.py): again
        whenever its kernel or its proxy's decisions changed since; nothing while agent_handover_s is 0."""
        if self.settings.agent_handover_s <= 0:
            return
        side, manager = self._sides.get(session_id), self.manager
        if side is None or side.session is None or manager is None:
            return
        mark = record_mark(side.session)
        if session_id in self._kept and self._kept[session_id][0] == mark:
            return
        request = self._reserved.get(session_id)
        try:
            why_not = manager.keep_whole(side.session, {"request": dataclasses.asdict(request)} if request else {})
        except OSError as exc:  # the watcher could not be told: it ends with this agent, as without a hand-over
            why_not = f"its watcher could not be told ({exc})"
            log.warning("session %s… would not outlive this agent: %s", session_id[:6], why_not)
        self._kept[session_id] = (mark, why_not)

    def _forget_closed(self) -> None:
        """Sessions the manager closed (idle reaper) or a call closed: their room is free again."""
        for session_id in [sid for sid, side in self._sides.items() if not side.open]:
            self._sides.pop(session_id, None)
            self._reserved.pop(session_id, None)
            self._kept.pop(session_id, None)
            self.changes.drop(session_id)

    def load(self) -> AgentLoad:
        """What this agent's sessions hold (placement.best_of)."""
        self._forget_closed()
        held = list(self._reserved.values())
        warm = self.manager.pool.stats().ready if self.manager is not None else 0
        ready_runs = self._oneshots.runner.ahead.stats().ready if self._oneshots is not None else 0
        return AgentLoad(self.node.node_id, len(held), sum(r.cpus for r in held),
                         sum(r.memory_mb or 0 for r in held), warm, ready_runs)  # fmt: skip

    async def visit(self) -> AgentLoad:
        """A front door's visit: starts the manager (and its warm pool) if need be; what it holds now."""
        await self._manager()
        return self.load()

    async def ping(self) -> str:
        return self.node.node_id

    async def alive(self, wait_s: float) -> str:
        """Answers after `wait_s` (at most ALIVE_WAIT_S): a front door keeps one such call waiting on each agent
        it holds sessions on, so that Ray tells it at once when this agent dies (agent_link.py). Not a visit: an
        agent with no session still ends after ORPHAN_S."""
        await anyio.sleep(min(max(wait_s, 0.0), ALIVE_WAIT_S))
        return self.node.node_id

    async def channel(self) -> ChannelAddress:
        """Where this agent's session channel listens (started at the first ask) and its key: for front doors
        only, who ask by Ray's authenticated calls."""
        self._visited = time.monotonic()
        return await self._channel.start(self.node.address)

    async def _over_channel(self, name: str, args: tuple[Any, ...]) -> Any:
        if name not in CHANNEL_CALLS:
            raise SessionError(f"a node agent's session channel has no call {name!r}")
        return await getattr(self, name)(*args)

    async def open(
        self, session_id: str, options: SandboxOptions, owner: str, seed: Any, request: Request
    ) -> SessionInfo:
        """Create session `session_id` (from the warm pool when `options` are the defaults) if this
        node has room for `request` beside the sessions it holds."""
        manager = await self._manager()
        self._forget_closed()
        if not room_for(request, self.node_entry, self.load()):
            raise NoRoomNow(
                f"node {self.node.label} has no room for this session now (it asks for {request.describe()}); try again"
            )
        self._reserved[session_id] = request
        try:
            session = await manager.create(options, owner=owner, seed=seed, session_id=session_id)
        except CodeRunnerError as exc:
            self._reserved.pop(session_id, None)
            raise SessionError(str(exc)) from None
        except BaseException:
            self._reserved.pop(session_id, None)
            raise
        try:
            side = SessionSide(
                manager, session, self.node, self.settings.transfer_limit_bytes, self._standby_after_reset, self.changes
            )
        except BaseException:
            self._reserved.pop(session_id, None)
            with anyio.CancelScope(shield=True):
                await manager.close(session_id)
            raise
        self._sides[session_id] = side
        self._keep(session_id)
        if session_id in self._abandoned:  # its front door stopped waiting: nobody would ever close it
            self._abandoned.discard(session_id)
            await self.call(session_id, "close")
            raise SessionError(f"the session {session_id!r} was abandoned by its front door while it started")
        info = side.info()
        info.status = await side.status()  # the create's reply shows it: one call fewer
        info.load = self.load()  # and the next placement's answer from here: no visit
        return info

    async def run_oneshot(
        self, run_id: str, request: Request, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """A one-shot run (oneshot_side.run_here) if this node has room for `request` now, its answer as plain
        data (wire.oneshot_answer). A front door that stops waiting cancels this call, and with it the run (its
        sandbox is killed as on one machine)."""
        async with self._run_room(run_id, request) as oneshots:
            return oneshot_answer(*await run_here(oneshots, self.settings, args, kwargs))

    async def oneshot_call(self, run_id: str, request: Request, method: str, args: tuple[Any, ...]) -> Any:
        """A check_code or language_versions of this node's one-shot runs, if it has room for `request` now."""
        if method not in ONESHOT_CALLS:
            raise SessionError(f"a node agent has no one-shot call {method!r}")
        async with self._run_room(run_id, request) as oneshots:
            return await getattr(oneshots, method)(*args)

    @contextlib.asynccontextmanager
    async def _run_room(self, run_id: str, request: Request) -> AsyncIterator[LocalOneShots]:
        """The node's one-shot runs, with `request` reserved for this one while it goes."""
        manager = await self._manager()
        self._forget_closed()
        if not room_for(request, self.node_entry, self.load()):
            raise NoRoomNow(
                f"node {self.node.label} has no room for this run now (it asks for {request.describe()}); try again"
            )
        self._reserved[run_id] = request
        try:
            if self._oneshots is None:
                self._oneshots = LocalOneShots.for_manager(manager)
            yield self._oneshots
        finally:
            self._reserved.pop(run_id, None)
            self._visited = time.monotonic()

    async def abandon(self, session_id: str) -> None:
        """A front door stopped waiting for the open of `session_id` (its bound, a cancel): close it once
        it is open (now, or when its open ends), so that no session is left that nobody knows of."""
        if session_id in self._sides:
            with contextlib.suppress(SessionError):
                await self.call(session_id, "close")
        elif len(self._abandoned) < MAX_ABANDONED:
            self._abandoned.add(session_id)

    async def changes_since(self, versions: dict[str, int | None], timeout_s: float, waiter: str) -> Changed:
        """A front door's one long poll of this agent: the news of the sessions it follows (keys: their ids)
        that differ from the versions it has, at once or as the first comes (sessions/changes.py)."""
        self._visited = time.monotonic()
        return await self.changes.changes_since(versions, timeout_s, waiter)

    async def wake(self, waiter: str) -> None:
        """A front door's poll `waiter` follows too few sessions now: it ends, and the next asks about all."""
        self.changes.wake(waiter)

    async def call(self, session_id: str, method: str, args: Sequence[Any] = ()) -> Any:
        """One front-door call of session `session_id` (SESSION_CALLS, `info` or `close`) with `args`. They
        come as one list, not as Ray arguments each: Ray serializes each of its arguments on its own, about
        35 us apiece on the caller's event loop (a run's call had ten)."""
        self._visited = time.monotonic()
        side = self._sides.get(session_id)
        if side is None and not self._entered.is_set():  # a new agent: its predecessor's are taken over first
            await self._manager()
            side = self._sides.get(session_id)
        if side is None or not side.open:
            raise SessionError(f"unknown or expired session_id {session_id!r}")
        if method == "info":
            return side.info()
        if method == "close":
            try:
                return await side.close()
            finally:
                self._sides.pop(session_id, None)
                self._reserved.pop(session_id, None)
                self._kept.pop(session_id, None)
                self.changes.drop(session_id)
        if method not in SESSION_CALLS:
            raise SessionError(f"a node agent has no call {method!r}")
        try:
            return await getattr(side, method)(*args)
        finally:
            self._keep(session_id)

    async def holding(self) -> dict[str, Any]:
        """What it holds, for tests and benches (not a visit): its process, its open sessions, its warm sandboxes ready,
        how many creates took one, and its session channel's port (None: no front door asked for it yet) and
        the calls it carried."""
        self._forget_closed()
        stats = self.manager.pool.stats() if self.manager is not None else None
        return {"node": self.node.node_id, "key": self.key, "sessions": list(self._sides), "pid": os.getpid(),
                "pool_size": self.settings.pool_size, "warm": stats.ready if stats else 0,
                "taken": stats.taken if stats else 0,
                "runs": self._oneshots.ready_counts() if self._oneshots is not None else None,
                "channel": self._channel.address.port if self._channel.address is not None else None,
                "channel_calls": self._channel.answered,
                "kept": {sid: why or "kept" for sid, (_, why) in self._kept.items() if sid in self._sides}}  # fmt: skip


def end_process() -> None:
    """An agent's exit (Ray then frees its name: it is never restarted, max_restarts=0)."""
    os._exit(0)


def _this_node() -> tuple[NodeInfo, dict[str, Any]]:
    import ray  # imported here: the class itself must load where ray is absent (a front door's checks)

    node_id = ray.get_runtime_context().get_node_id()
    entry: dict[str, Any] = next((node for node in ray.nodes() if node.get("NodeID") == node_id), {})
    return NodeInfo(node_id, ray.util.get_node_ip_address()), entry


def node_settings(sent: dict[str, Any], **fixed: Any) -> Settings:
    """The front door's settings with this node's own NODE_LOCAL ones (its disks, its sandbox environment)."""
    local = load_settings()
    mine = {name: getattr(local, name) for name in NODE_LOCAL}
    if sent.get("export_dir") is None:  # no export folder at the front door: no outbox in its sandboxes
        mine["export_dir"] = None
    return Settings.model_validate({**sent, **mine, **fixed, "ray_address": None})
