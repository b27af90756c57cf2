"""ClusterHost: the SessionHost (sessions/seam.py) and OneShotHost (oneshot/host.py) of a front door whose
sessions and one-shot runs live on a Ray cluster.

Every session lives in a node agent (`agent-<node id>-<settings key>` in namespace `coderunner`,
agent.py): one detached actor per node running one SessionManager for all that node's sessions. A
session id names its agent (wire.new_session_id), so any front door reaches any session in one call
(agents.py keeps the handles), several front doors serve the same sessions and one that dies loses
none. Placement asks two agents and takes the lighter (placement.py). What a caller may see is decided
here, in the front door, exactly as on one machine: a session belongs to the client whose caller created it.

The front door itself starts no sandbox: its backend object only checks options and describes the
sandboxes (get_capabilities); the nodes run them.

One idea: the front door's SessionHost over the cluster: placement, finding a session by its id behind the owner
check, and every host call forwarded.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import logging
import secrets
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import ray
from anyio.abc import TaskGroup
from ray.exceptions import AuthenticationError

from coderunner.cluster.agent_link import AgentLink
from coderunner.cluster.agents import Agents
from coderunner.cluster.node_calls import NodeCalls
from coderunner.cluster.node_table import NodeTable
from coderunner.cluster.oneshot_exports import OneShotExports, write_here
from coderunner.cluster.placement import NoRoomNow, Request, check_fits, check_home
from coderunner.cluster.ray_auth import token_refusal
from coderunner.cluster.remote_egress import RemoteEgress
from coderunner.cluster.remote_session import CALL_S, RemoteSession, cause_of, lost_with_node
from coderunner.cluster.session_channel import ChannelBroken, ChannelUnused
from coderunner.cluster.stored import StoredOnNodes
from coderunner.cluster.wire import NAMESPACE, SessionInfo, new_session_id, of_oneshot_answer
from coderunner.config import ConfigError, Settings
from coderunner.edge.callers import LOCAL_CALLER, client_of_key
from coderunner.edge.owners import LOCAL_CLIENT
from coderunner.errors import SessionError
from coderunner.sandbox import make_backend
from coderunner.sessions.host_services import sandbox_profile
from coderunner.sessions.job_runner import JobTable
from coderunner.sessions.sandbox_options import SandboxOptions, configured_mounts, sandbox_options
from coderunner.sessions.seam import SandboxProfile, SessionHandle
from coderunner.sessions.warm_take import take_problem
from coderunner.vocabulary.network import NetworkMode
from coderunner.vocabulary.sandbox_request import DEFAULT_REQUEST, SandboxRequest

if TYPE_CHECKING:
    from coderunner.hostfs.workspaces import NamedWorkspace
    from coderunner.oneshot.runs import Language, OneShotResult
    from coderunner.sessions.egress_wiring import SessionEgress
    from coderunner.sessions.session_snapshots import Seed, Taken
    from coderunner.snapshots.store import Listing, SnapshotMeta

log = logging.getLogger(__name__)

#: Bound on joining the cluster at start.
CONNECT_S = 60.0
#: Cold session starts one front door runs at once, and how long a create waits for its turn (each is a
#: sandbox and a kernel on some node; far more at once only slow each other on the nodes).
COLD_STARTS = 16
COLD_QUEUE_S = 120.0
#: How often a front door that keeps pools warm visits every node's agent (an agent unvisited ends: agent.py).
AGENT_SCAN_S = 30.0
#: A refused session id (unknown, or another client's) is answered this long after its lookup began, whatever
#: the lookup took: well above an agent's answer (a few ms; a first lookup of its name by Ray too). Not 0.1 s:
#: on a loaded 2-core machine (a CI run) one lookup took 0.21 s, and its refusal then came late enough to tell.
REFUSAL_S = 0.5
#: How many times a create is placed when the chosen agent has no room by the time it opens (a burst's creates
#: read the same loads); the last refusal is the caller's.
PLACEMENTS = 3
#: Settings a node agent is not given: the front door alone holds the tokens.
FRONT_DOOR_ONLY = {"token", "token_file", "ray_address"}


class AgentGone(SessionError):
    """A node agent died before a create's open reached it: the create is placed again (a new agent starts)."""


class ClusterHost:
    """Sessions on a Ray cluster, as the tools see them. Use as `async with ClusterHost(settings)`."""

    def __init__(self, settings: Settings) -> None:
        if settings.network_ceiling == NetworkMode.INTERNET:
            raise ConfigError(
                "cluster mode refuses max_network 'internet': such a sandbox reaches its node's own addresses, "
                "Ray's ports among them, and whoever reaches those runs code on every node. Use 'allowlist' "
                "(its proxy never connects to the node, loopback or private addresses) with allowed_domains."
            )
        if (settings.mounts or settings.allowed_mount_roots) and not settings.mounts_shared:
            raise ConfigError(
                "cluster mode refuses mounts and allowed_mount_roots unless mounts_shared is set: a session's "
                "mounts are bound from the disk of the node that holds it, never from this front door's. Put "
                "those folders on storage every node sees at the same paths and set mounts_shared = true."
            )
        self.settings = settings
        self.backend = make_backend(settings)  # checks options and describes sandboxes; starts none
        self.base_mounts = configured_mounts(settings, self.backend.identity)
        self._sessions: dict[str, RemoteSession] = {}
        #: One long poll and one session channel per agent for all of its sessions here (agent_link.py), by
        #: the handle's id.
        self._links: dict[int, AgentLink] = {}
        self._default_ids: dict[str, str] = {}
        self._default_lock = anyio.Lock()
        self._task_group: TaskGroup | None = None
        self.oneshot_jobs: JobTable
        #: Cold starts under way at once: the rest queue for a turn.
        self._cold_starts = anyio.Semaphore(COLD_STARTS)
        self._settings_sent = settings.model_dump(exclude=FRONT_DOOR_ONLY)
        self._node_calls = NodeCalls(settings, self._settings_sent)
        #: One-shot runs of this front door under way at once (more wait for a turn, within their bound).
        self._oneshot_slots = anyio.CapacityLimiter(settings.max_oneshot_runs)
        self.stored = StoredOnNodes(self._node_calls, self.backend.name, settings.snapshots_shared)
        self._defaults = self.options()
        #: The node agents of these settings; each keeps pool_size warm sandboxes (its manager's own pool)
        #: for the default options, unless 'allowlist' (never kept warm).
        self._agents = Agents(
            self._settings_sent, Request.of(self._defaults, self.backend.name, settings.ray_node_labels)
        )
        self._agents.channel_of = lambda agent: self._link(agent).channel
        self._agents.forgotten = self._unlink
        self._warm = settings.pool_size > 0 and self._defaults.network != NetworkMode.ALLOWLIST
        #: Ray's node table as of seconds ago: creates and one-shot runs read it without a GCS call.
        self._nodes = NodeTable()

    async def __aenter__(self) -> ClusterHost:
        with anyio.fail_after(CONNECT_S):
            await anyio.to_thread.run_sync(self._connect)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self.oneshot_jobs = JobTable(self._task_group)
        if self._warm:
            self._task_group.start_soon(self._keep_agents)
        return self

    async def _keep_agents(self) -> None:
        """Start or visit every node's agent now (their pools fill), and again now and then (nodes come and go)."""
        while True:
            try:
                await self._agents.visit_all(await self._nodes.refresh())
            except Exception as exc:  # the cluster is unreachable for a moment: the next round tries again
                log.warning("node agents: %r", exc)
            await anyio.sleep(AGENT_SCAN_S)

    def _connect(self) -> None:
        address = self.settings.ray_address
        # Ray prints the cluster's notices to stdout: a stdio server holds fd 1 for the MCP channel
        # (serve.py) until the SDK serves it.
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
        except (ConnectionError, AuthenticationError) as exc:
            if (refusal := token_refusal(address)) is not None:
                raise refusal from exc  # the token was missing or wrong: say so, not "failed to connect"
            raise
        log.info("cluster mode: joined the Ray cluster at %s (%d nodes)", address, len(ray.nodes()))

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.move_on_after(CALL_S, shield=True):
            await self.close_all()
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()
        await self._task_group.__aexit__(None, None, None)
        await anyio.to_thread.run_sync(ray.shutdown)

    async def close_all(self) -> None:
        """Close the callers' default sessions; sessions made with create_session stay for other front
        doors (the idle reaper on their node closes what nobody uses)."""
        for owner in list(self._default_ids):
            await self.release_caller(owner)

    # --- sessions --------------------------------------------------------------------------------

    def options(self, request: SandboxRequest = DEFAULT_REQUEST) -> SandboxOptions:
        return sandbox_options(self.settings, self.backend, self.base_mounts, request)

    async def create(
        self, options: SandboxOptions | None = None, owner: str = LOCAL_CALLER, pool_wait_s: float = 0.0,
        seed: Seed | None = None,
    ) -> RemoteSession:  # fmt: skip
        options = options or self.options()
        self._check_room(owner)
        warm_wanted = seed is None and self._could_be_warm(options)
        home = await self._home(options, seed)
        request = Request.of(options, self.backend.name, self.settings.ray_node_labels)
        nodes = await self._fitting_nodes(request)
        if home is not None:
            check_home(request, home, nodes)
        try:
            with anyio.fail_after(COLD_QUEUE_S):
                await self._cold_starts.acquire()
        except TimeoutError:
            raise SessionError(
                f"{COLD_STARTS} sessions at a time start through this front door and more were waiting: this one "
                f"waited {COLD_QUEUE_S:g}s for its turn; try again in a moment"
            ) from None
        try:
            placed = 0
            while True:
                node, agent = await self._agents.place(request, nodes, warm_wanted, home, fresh=placed > 0)
                placed += 1
                try:
                    return await self._open(agent, node, options, owner, seed, request)
                except NoRoomNow:  # filled by creates that chose it beside this one: placed again, fresh loads
                    if placed >= PLACEMENTS or home is not None:
                        raise
                except AgentGone:  # its agent died before the open reached it: placed again (a new agent)
                    if placed >= PLACEMENTS:
                        raise
                finally:
                    if home is None:
                        self._agents.settle(node, self._group())
        except Exception:
            self._nodes.stale()  # the next create asks Ray for the nodes again
            raise
        finally:
            self._cold_starts.release()

    async def _fitting_nodes(self, request: Request) -> list[dict[str, Any]]:
        """The cluster's nodes (the front door's copy, node_table.py), if one could ever hold `request`: else
        refused, as Ray's table says now."""
        nodes = await self._nodes.current(self._group())
        try:
            check_fits(request, nodes)
        except SessionError:
            nodes = await self._nodes.refresh()
            check_fits(request, nodes)
        return nodes

    def _could_be_warm(self, options: SandboxOptions) -> bool:
        """Whether a node agent's warm pool could serve a create with `options` (warm_take.py; placement then
        prefers an agent with a warm sandbox ready). The agent's manager decides for good."""
        if not self._warm:
            return False
        asked = dataclasses.replace(options, client=LOCAL_CLIENT)
        if not self.settings.pool_take_apply:
            return asked == self._defaults
        return take_problem(self._defaults, asked, None) is None

    async def _open(
        self, agent: Any, node: str, options: SandboxOptions, owner: str, seed: Seed | None, request: Request
    ) -> RemoteSession:
        """The session opened by `node`'s agent (from its warm pool when it can)."""
        session_id = new_session_id(node, self._agents.key)
        bound = self.settings.startup_timeout_s + CALL_S + (self.settings.snapshot_timeout_s if seed else 0.0)
        link = self._link(agent)
        try:
            with anyio.fail_after(bound):
                info: SessionInfo = await self._opened(link, session_id, options, owner, seed, request)
        except TimeoutError:
            await _abandon(agent, session_id)
            raise SessionError(f"the session did not start within {bound:g}s on its node") from None
        except anyio.get_cancelled_exc_class():
            await _abandon(agent, session_id)
            raise
        except ray.exceptions.RayTaskError as exc:
            raise cause_of(exc) from None
        except AgentGone:
            self._agents.forget(node, agent)
            raise
        except ray.exceptions.RayError as exc:
            self._agents.forget(node, agent)
            raise SessionError(
                f"the agent of node {node[:12]} was lost while the session started ({type(exc).__name__}); try again"
            ) from None
        if info.load is not None:
            self._agents.heard(node, info.load)
        session = self._session_of(agent, info, link)
        self._sessions[session_id] = session
        log.info("session %s… started on node %s", session_id[:6], info.node.label)
        return session

    async def _opened(
        self, link: AgentLink, session_id: str, options: SandboxOptions, owner: str, seed: Seed | None,
        request: Request,
    ) -> SessionInfo:  # fmt: skip
        """The agent's open, by its session channel when there is one (else, or if it cannot connect, by Ray).
        AgentGone: its channel was refused and Ray says it died, so it was gone before the open was sent."""
        if link.channel is not None:
            try:
                opened: SessionInfo = await link.channel.call("open", (session_id, options, owner, seed, request))
                return opened
            except ChannelUnused:
                try:
                    opened = await link.agent.open.remote(session_id, options, owner, seed, request)
                    return opened
                except ray.exceptions.RayActorError as exc:
                    raise AgentGone(f"the session's node agent was gone ({type(exc).__name__}); try again") from None
            except ChannelBroken as exc:  # whether it opened is unknown: Ray says whether the agent lives
                with anyio.fail_after(CALL_S):
                    await link.agent.ping.remote()
                await _abandon(link.agent, session_id)
                raise SessionError(f"the session's start was cut off on its node ({exc}); try again") from None
        opened = await link.agent.open.remote(session_id, options, owner, seed, request)
        return opened

    async def _home(self, options: SandboxOptions, seed: Seed | None) -> str | None:
        """The node a session must start on: the one holding its snapshot or its persistent workspace
        (None: wherever Ray places it)."""
        if seed is not None:
            node, _ = await self.stored.snapshot_node(seed.client, seed.snapshot_id)
            return node
        if options.persistent and options.name is not None:
            return await self.stored.workspace_node(options.client, options.name)
        return None

    def _check_room(self, owner: str) -> None:
        open_here = [session for session in self._sessions.values() if not session.closed]
        if len(open_here) >= self.settings.max_sessions:
            raise SessionError(
                f"session limit reached ({self.settings.max_sessions} open through this front door): close one "
                "with manage_sessions (action 'close') or raise max_sessions in the configuration"
            )
        held = sum(session.owner == owner for session in open_here)
        if owner != LOCAL_CALLER and held >= self.settings.max_sessions_per_client:
            raise SessionError(
                f"this client already holds {held} sessions, its share of this server: close one with "
                "manage_sessions (action 'list' shows them), or raise max_sessions_per_client in the configuration"
            )

    def _group(self) -> TaskGroup:
        assert self._task_group is not None, "ClusterHost used outside its `async with`"
        return self._task_group

    async def resolve(
        self, session_id: str | None, owner: str = LOCAL_CALLER, client: str = LOCAL_CLIENT
    ) -> RemoteSession:
        if session_id:
            return await self._owned(session_id, owner)
        async with self._default_lock:
            default_id = self._default_ids.get(owner)
            session = self._sessions.get(default_id) if default_id is not None else None
            if session is None or session.closed:
                session = await self.create(self.options(SandboxRequest(client=client)), owner=owner)
                self._default_ids[owner] = session.session_id
            return session

    async def _owned(self, session_id: str, owner: str | None) -> RemoteSession:
        """The session `session_id`, kept here or found by name, if `owner`'s client may use it (only then kept).
        Another client's id, kept here or not, is looked up as an unknown one is, and refused as late."""
        began = anyio.current_time()
        session = self._sessions.get(session_id)
        if session is not None and session.closed and session.agent_died and _may_use(session.owner, owner):
            await self.reattach(session, session.agent)  # its agent died in a call that could not ask (a thread's)
        if session is None or session.closed or not _may_use(session.owner, owner):
            session = await self._find(session_id, owner)
            if session is None:
                await anyio.sleep_until(began + REFUSAL_S)
                raise SessionError(
                    f"unknown or expired session_id {session_id!r}: manage_sessions (action 'list') shows your "
                    "open sessions, create_session makes a new one, or omit session_id to use your default session"
                )
            self._sessions[session_id] = session
        return session

    async def _find(self, session_id: str, owner: str | None) -> RemoteSession | None:
        """A session another front door made, asked of the agent its id names, if `owner`'s client may use it."""
        found = await anyio.to_thread.run_sync(self._agents.of_session, session_id)
        if found is None:
            return None
        node, agent = found
        try:
            with anyio.fail_after(CALL_S):
                info: SessionInfo = await agent.call.remote(session_id, "info")
        except (TimeoutError, ray.exceptions.RayError) as exc:
            if isinstance(exc, ray.exceptions.RayError) and not isinstance(exc, ray.exceptions.RayTaskError):
                self._agents.forget(node, agent)
            return None
        if not _may_use(info.owner, owner):
            return None
        return self._session_of(agent, info, self._link(agent))

    def _session_of(self, agent: Any, info: SessionInfo, link: AgentLink) -> RemoteSession:
        return RemoteSession(agent, info, self.settings, self._group(), self._agents.forget, link, self.reattach)

    async def reattach(self, session: RemoteSession, dead: Any) -> bool:
        """`session`'s agent `dead` died while its node lives: start the node's next agent, which takes over what
        the dead one kept for it (its watcher waits agent_handover_s: cluster/agent.py), and find the session
        there. True once `session` calls that agent (another call may have got there first)."""
        if session.agent is not dead and not session.closed:
            return True
        self._agents.forget(session.node, dead)
        bound = self.settings.startup_timeout_s + CALL_S
        try:
            with anyio.fail_after(bound):
                agent = await anyio.to_thread.run_sync(self._agents.start, session.node)
                info: SessionInfo = await agent.call.remote(session.session_id, "info")
        except (TimeoutError, ray.exceptions.RayError) as exc:
            log.info("session %s… was not taken over on node %s: %r", session.session_id[:6], session.node[:12], exc)
            return False
        if session.agent is dead:
            session.rebind(agent, info, self._link(agent))
            log.info("session %s… taken over by node %s's next agent", session.session_id[:6], info.node.label)
        return True

    def _unlink(self, agent: Any) -> None:
        """`agent` died: its link goes (its connection, if any, is closed), and its id may be reused. From any
        thread (Agents.forget)."""
        link = self._links.get(id(agent))
        if link is not None and link.agent is agent:
            del self._links[id(agent)]
            link.close()

    def _link(self, agent: Any) -> AgentLink:
        """This front door's long poll and session channel of `agent` (the link holds the handle: its id is not
        reused meanwhile)."""
        link = self._links.get(id(agent))
        if link is None:
            link = self._links[id(agent)] = AgentLink(agent, self._group(), self._agent_died)
        return link

    async def _agent_died(self, dead: Any, exc: BaseException) -> None:
        """`dead` died (its link's life watch): if this front door holds sessions on it and its node lives, start
        the node's next agent now, which takes over what the dead one kept while its watcher still waits
        (agent_handover_s), and rebind them there: a session nobody calls meanwhile is not lost for want of a
        call. A take-over that fails leaves each to its next call, which says what became of it."""
        mine = [session for session in self._sessions.values() if session.agent is dead and not session.closed]
        if not mine or self.settings.agent_handover_s <= 0:
            return
        if await anyio.to_thread.run_sync(lost_with_node, exc, mine[0].node):
            return
        for session in mine:
            await self.reattach(session, dead)

    async def close(self, session_id: str, owner: str | None = None) -> RemoteSession:
        session = await self._owned(session_id, owner)
        self._sessions.pop(session_id, None)
        if self._default_ids.get(session.owner) == session_id:
            del self._default_ids[session.owner]
        await session.close()
        return session

    def is_default(self, session: SessionHandle) -> bool:
        return self._default_ids.get(session.owner) == session.session_id

    async def release_caller(self, owner: str) -> None:
        session_id = self._default_ids.pop(owner, None)
        if session_id is not None and session_id in self._sessions:
            with contextlib.suppress(SessionError):
                await self.close(session_id)

    def list(self, owner: str | None = None) -> Sequence[RemoteSession]:
        """The open sessions this front door made or found (a caller's own are always among them)."""
        return [s for s in self._sessions.values() if not s.closed and (owner is None or s.owner == owner)]

    def profile(self) -> SandboxProfile:
        return sandbox_profile(self.settings, self.backend, self.base_mounts, self.options())

    # --- snapshots and persistent workspaces: kept by the node that made them (stored.py) -----------

    async def take_snapshot(self, session: SessionHandle, name: str) -> Taken:
        remote = self._remote(session)
        taken: Taken = await remote.acall("take_snapshot", name, timeout_s=self.settings.snapshot_timeout_s + CALL_S)
        self.stored.remember(session.options.client, taken.meta.snapshot_id, remote.node)
        return taken

    async def snapshot(self, client: str, snapshot_id: str) -> SnapshotMeta:
        _, meta = await self.stored.snapshot_node(client, snapshot_id)
        return meta

    async def snapshot_listing(self, client: str) -> Listing:
        return await self.stored.listing(client)

    async def delete_snapshot(self, client: str, snapshot_id: str) -> None:
        await self.stored.delete(client, snapshot_id)

    async def snapshots_of(self, session: SessionHandle) -> builtins.list[str]:
        remote = self._remote(session)
        found: Listing = await self._node_calls.run_on(remote.node, "snapshot_listing", session.options.client)
        return [meta.snapshot_id for meta in found.snapshots if meta.source_session == session.session_id[:8]]

    async def list_workspaces(self, client: str) -> builtins.list[NamedWorkspace]:
        return [workspace for _, workspace in await self.stored.workspaces(client)]

    async def delete_workspace(self, client: str, name: str) -> None:
        node = await self.stored.workspace_node(client, name)
        if node is None:
            raise SessionError(f"no persistent workspace {name!r}: manage_workspaces (action 'list') shows yours")
        await self._node_calls.run_on(node, "delete_workspace", client, name)

    def _remote(self, session: SessionHandle) -> RemoteSession:
        assert isinstance(session, RemoteSession), "a session of another host"
        return session

    # --- one-shot runs: calls of a node agent, placed as a session would be (oneshot_side.py) ----------

    async def run_oneshot(
        self, language: Language, code: str, options: SandboxOptions, *, stdin: bytes = b"",
        variables: dict[str, Any] | None = None, caller: str | None = None,
        on_egress: Callable[[SessionEgress], None] | None = None,
    ) -> OneShotResult:  # fmt: skip
        mirror = None
        if options.network == NetworkMode.ALLOWLIST and on_egress is not None:
            # The node's proxy decides; the call sees its decisions through a mirror (the reply's `network`
            # line). Nobody is asked: a one-shot run's list is the whole ceiling (policy_for), so its proxy
            # never meets a host inside allowed_domains but outside its list, here as on one machine.
            ceiling = self.settings.egress.ceiling
            mirror = RemoteEgress("one-shot", ceiling.narrowed(options.allow) if options.allow else ceiling)
            on_egress(mirror)  # type: ignore[arg-type]  # the part of SessionEgress the tools use
        args, kwargs = (language, code, options), {"stdin": stdin, "variables": variables}
        result, delta, exports = of_oneshot_answer(await self._on_agent(options, "run_oneshot", args, kwargs))
        if mirror is not None:
            mirror.apply(delta)
        return await self._exported_here(result, exports, options)

    async def _exported_here(
        self, result: OneShotResult, exports: OneShotExports | None, options: SandboxOptions
    ) -> OneShotResult:
        """A one-shot's files, exported on its node, written into this machine's export folder."""
        if exports is not None and self.settings.export_dir is not None:
            limit = self.settings.export_limit_mb * 2**20
            note = await anyio.to_thread.run_sync(
                write_here, exports, self.settings.export_dir, options.client, limit, result.exported
            )
            return dataclasses.replace(result, exported=note)
        return result

    async def check_code(
        self, language: Language, code: str, options: SandboxOptions, caller: str | None = None
    ) -> builtins.list[dict[str, Any]]:
        found: builtins.list[dict[str, Any]] = await self._on_agent(
            options, "oneshot_call", "check_code", (language, code, options)
        )
        return found

    async def language_versions(self, options: SandboxOptions) -> dict[str, Any]:
        found: dict[str, Any] = await self._on_agent(options, "oneshot_call", "language_versions", (options,))
        return found

    async def _on_agent(self, options: SandboxOptions, method: str, *args: Any) -> Any:
        """NodeAgent.`method`(run id, request, *args) on an agent with room for a sandbox of `options` (the
        best of two, placed again if it filled meanwhile), within the run's bound. A caller that stops
        waiting (a cancelled job, a client gone, the bound) cancels it on the node, and so its sandbox."""
        request = Request.of(options, self.backend.name, self.settings.ray_node_labels)
        nodes = await self._fitting_nodes(request)
        bound = options.timeout_s + self.settings.startup_timeout_s + CALL_S
        async with self._oneshot_slots:
            placed = 0
            while True:
                node, agent = await self._agents.place(request, nodes, warm_wanted=False, run=True, fresh=placed > 0)
                placed += 1
                try:
                    return await self._run_on(agent, node, method, args, request, bound)
                except NoRoomNow:  # filled by runs that chose it beside this one: placed again, fresh loads
                    if placed >= PLACEMENTS:
                        raise
                finally:
                    self._agents.settle(node, self._group())

    async def _run_on(
        self, agent: Any, node: str, method: str, args: tuple[Any, ...], request: Request, bound: float
    ) -> Any:
        """One placement's call of a one-shot run on `node`'s agent: its answer, or why not as a SessionError
        (NoRoomNow: it had no room by the time the call came)."""
        ref = getattr(agent, method).remote(secrets.token_hex(8), request, *args)
        try:
            with anyio.fail_after(bound):
                return await ref
        except ray.exceptions.RayTaskError as exc:
            raise cause_of(exc) from None
        except ray.exceptions.RayError as exc:
            self._agents.forget(node, agent)
            self._nodes.stale()
            raise SessionError(
                f"the run was lost with the agent of node {node[:12]} ({type(exc).__name__}); try again"
            ) from None
        except TimeoutError:
            await _cancel(ref)
            raise SessionError(f"the run did not end within {bound:g}s on its node; it was stopped") from None
        except BaseException:
            await _cancel(ref)
            raise

    def ready_counts(self) -> dict[str, int] | None:
        """None: the sandboxes started ahead are the node agents' (each run's agent is placement's choice)."""
        return None


def _may_use(session_owner: str, owner: str | None) -> bool:
    return owner is None or client_of_key(session_owner) == client_of_key(owner)


async def _cancel(ref: Any) -> None:
    """Cancel an agent's one-shot call whatever happens to its caller: the run's task on the agent is
    cancelled, and it kills its sandbox as a cancelled run does on one machine."""
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await anyio.to_thread.run_sync(ray.cancel, ref)


async def _abandon(agent: Any, session_id: str) -> None:
    """Tell an agent this front door stopped waiting for its open of `session_id` (it closes the session)."""
    with anyio.move_on_after(CALL_S, shield=True), contextlib.suppress(Exception):
        await agent.abandon.remote(session_id)
