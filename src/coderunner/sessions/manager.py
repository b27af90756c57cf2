"""The SessionManager: the only owner of mutable server state.

It hands out high-entropy session handles, creates each caller's default session on first use,
enforces the session limits, closes idle sessions, and on start removes what a killed server
left behind. Options come from options.py, each sandbox's host side from leases.py.

One idea: the one owner of a server's sessions: handles, limits, each caller's default session, the pool and
the clean-up of what a killed server left.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import logging
import secrets
import time
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from coderunner.config import Settings
from coderunner.edge.callers import LOCAL_CALLER, client_of_key
from coderunner.edge.owners import LOCAL_CLIENT
from coderunner.errors import SessionError
from coderunner.hostfs.dirs_sweeper import DirsSweeper
from coderunner.hostfs.exports import Exporter, client_folder
from coderunner.hostfs.private_dirs import ensure_private_dir
from coderunner.hostfs.session_dirs import remove_stale_dirs
from coderunner.hostfs.workspaces import NamedWorkspace
from coderunner.kernel.incarnation import Kernel, RunStatus
from coderunner.kernel.kernel_factory import KernelFactory
from coderunner.kernel.output_capture import OutputCollector
from coderunner.kernel.startup_hooks import disable_startup_hooks
from coderunner.offload import off_loop
from coderunner.sandbox import (
    KernelStarter,
    Mount,
    SandboxBackend,
    SandboxUnavailable,
    UidPool,
    kernel_starter,
    per_sandbox_uids,
)
from coderunner.sandbox.identity import UID_CLAIMS_DIR
from coderunner.sessions.adoption import SessionRecord, adopt_all, keep_whole
from coderunner.sessions.egress_wiring import EgressHub
from coderunner.sessions.host_services import HostServices
from coderunner.sessions.idle_room import NO_IDLE, IdleSandboxes
from coderunner.sessions.leases import SandboxLeases
from coderunner.sessions.pool import WarmPool
from coderunner.sessions.sandbox_options import SandboxOptions, configured_mounts, sandbox_options
from coderunner.sessions.seam import SandboxProfile, SessionHandle
from coderunner.sessions.session import Session
from coderunner.sessions.session_snapshots import Seed, SessionSnapshots, Taken
from coderunner.sessions.standby import StandbyBudget
from coderunner.sessions.upkeep import reap_idle, save_kept_states
from coderunner.sessions.usage import memory_used_mb
from coderunner.sessions.warm_take import StartedFrom, address_space_code, take_problem, warm_why
from coderunner.sessions.warm_up import warm_up_code
from coderunner.snapshots.store import Listing, SnapshotError, SnapshotMeta
from coderunner.vocabulary.network import NetworkMode
from coderunner.vocabulary.sandbox_request import DEFAULT_REQUEST, SandboxRequest

log = logging.getLogger(__name__)

#: Bound on closing every session at server shutdown.
SHUTDOWN_TIMEOUT_S = 10.0


class SessionManager:
    """Owns every session of one server process, and the task group their sandboxes run in."""

    def __init__(self, settings: Settings, backend: SandboxBackend, kernel_factory: KernelFactory = Kernel) -> None:
        self.settings = settings
        self.backend = backend
        #: Makes every session's kernels (the real Kernel; tests pass a scripted one).
        self.kernel_factory = kernel_factory
        self._sessions: dict[str, Session] = {}
        #: Each client's default session: caller key -> session id.
        self._default_ids: dict[str, str] = {}
        self._default_lock = anyio.Lock()
        self._task_group: TaskGroup | None = None
        self.base_mounts: list[Mount] = []
        #: The host side of every sandbox (dirs, host uid, mounts), sessions' and one-shot runs' alike.
        users = UidPool(claims_dir=UID_CLAIMS_DIR) if per_sandbox_uids(settings.sandbox_user) else None
        self.leases = SandboxLeases(settings, backend, users)
        #: Sandboxes another layer keeps idle in this manager's room (one-shot sandboxes started ahead,
        #: oneshot/local.py): counted beside the sessions, evicted first, drained on shutdown (share_room).
        self.idle: IdleSandboxes = NO_IDLE
        #: Snapshots and named workspaces: the host's calls beside sessions (set up on entry).
        self.services: HostServices
        #: What every session's standby kernel holds of memory, together (sessions/standby.py).
        self.standby_budget = StandbyBudget(settings.reset_standby_memory_mb)
        #: Sandboxes started ahead with the default options, taken by creates they can be given to (pool.py).
        self.pool: WarmPool[Pooled] = WarmPool(
            size=settings.pool_size,
            memory_budget_mb=settings.pool_memory_mb,
            start=self._start_pooled,
            discard=self._discard_pooled,
            alive=lambda pooled: pooled.session.kernel is not None and pooled.session.kernel.alive,
            # Pooled sandboxes fill only spare room: a user's session never finds max_sessions taken by them.
            room=lambda: self._in_use() + self.pool.held + self.idle.held < self.settings.max_sessions,
            measure_mb=lambda pooled: memory_used_mb(pooled.session.kernel) if pooled.session.kernel else None,
            others_mb=lambda: self.idle.held_mb,
        )
        self._pool_options: SandboxOptions | None = None
        #: Cold sessions being prepared (not yet in _sessions): their room is not the pool's.
        self._cold_starts = 0
        #: Network 'allowlist': the user's ceiling and the audit log (each sandbox's proxy is its own).
        self.egress = EgressHub(settings)
        #: Saved sessions (manage_snapshots: save, restore, fork; keep_state).
        self.snapshots = SessionSnapshots.for_settings(settings, backend)
        #: Set while close_all runs: a second caller (a signal during shutdown) waits for it.
        self._closing_all: anyio.Event | None = None
        #: The warm kernel template this server's kernels are forked from (kernel_template, bwrap only).
        self.template: KernelStarter | None = None
        #: Removes what this manager made if its process dies (hostfs/dirs_sweeper.py); told when it closed in order.
        self._sweeper: DirsSweeper | None = None

    async def __aenter__(self) -> SessionManager:
        ensure_private_dir(self.settings.runtime_dir, self.backend.dir_mode)
        ensure_private_dir(self.settings.workspaces_dir, self.backend.dir_mode)
        self.base_mounts = configured_mounts(self.settings, self.backend.identity)
        removed = remove_stale_dirs(self.settings.runtime_dir, self.settings.workspaces_dir, self.backend.remove_stale)
        if removed:
            log.info("removed %d session dir(s) left by a server that is gone", removed)
        # Should this process die, a sweeper removes what this manager made then, workspace mounts included.
        self._sweeper = await anyio.to_thread.run_sync(
            DirsSweeper, self.settings.runtime_dir, self.settings.workspaces_dir
        )
        await self.snapshots.open()
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(reap_idle, self.settings.idle_timeout_s, self.list, self.close)
        self._open_template(self._task_group)
        if self.settings.keep_state_save_idle_s > 0:
            self._task_group.start_soon(
                save_kept_states, self.settings.keep_state_save_idle_s, self.list, self.snapshots
            )
        self.services = HostServices(self.settings, self.backend, self.base_mounts, self.snapshots, self.options)
        try:
            self.leases.keep_spare(self.options(), self._task_group)  # a create's dirs and workspace, made ahead
        except SessionError as exc:  # the defaults themselves refused: each create says why
            log.warning("no session dirs made ahead: %s", exc)
        if self.pool.enabled and (self.settings.pool_take_apply or self.settings.network != NetworkMode.ALLOWLIST):
            # An allowlist sandbox's proxy is its session's alone: a pooled one's is served from its take on
            # (warm_take.py); without pool_take_apply such a sandbox starts cold.
            self._pool_options = self.options()
            self._task_group.start_soon(self.pool.run)
        return self

    def _open_template(self, task_group: TaskGroup) -> None:
        """With kernel_template: the warm template, started in the background, asked by every kernel's start."""
        if self.settings.kernel_template is False:
            return
        asked = self.settings.kernel_template is True
        self.template = kernel_starter(self.backend, self.settings.preload_imports, asked=asked)
        if self.template is not None:
            self.template.open(task_group)

    def _in_use(self) -> int:
        """Sandboxes of users' sessions, open or starting: what sandboxes kept idle may never take room from."""
        return len(self._sessions) + self._cold_starts

    @property
    def task_group(self) -> TaskGroup:
        """Where this manager's sandboxes run: a layer sharing its room starts its own here too."""
        assert self._task_group is not None, "SessionManager used outside its `async with`"
        return self._task_group

    def share_room(self, idle: IdleSandboxes) -> None:
        """Count `idle` (sandboxes another layer keeps idle, within room_ahead) in this manager's room."""
        self.idle = idle

    def room_ahead(self, count: int, member_mb: float | None) -> bool:
        """Whether `count` one-shot sandboxes started ahead fit beside the sessions and the warm pool: under
        max_sessions, and with the pool's members within pool_memory_mb (unmeasured yet: if any is left)."""
        if self._in_use() + self.pool.held + count > self.settings.max_sessions:
            return False
        left = self.settings.pool_memory_mb - self.pool.held_mb
        return left > 0 if member_mb is None else count * member_mb <= left

    async def _make_room(self) -> None:
        """A user's session takes room back from the sandboxes kept idle: one-shot ones started ahead
        first (the quicker to start again), then the warm pool's."""
        while self._in_use() + self.pool.held + self.idle.held > self.settings.max_sessions:
            if not await self.idle.evict_one() and not await self.pool.evict_one():
                return

    def shutdown_bound_s(self) -> float:
        """How long closing every session may take: longer while keep_state sessions save their state."""
        saving = any(session.options.keep_state for session in self._sessions.values())
        return SHUTDOWN_TIMEOUT_S + (self.settings.snapshot_timeout_s if saving else 0.0)

    async def __aexit__(self, *exc_info: object) -> None:
        count, began = len(self._sessions), time.monotonic()
        said = logging.INFO if count else logging.DEBUG  # a server that held none (a start refused) says one line
        log.log(said, "shutting down: closing %d session(s)", count)
        with anyio.move_on_after(self.shutdown_bound_s(), shield=True):
            await self.close_all()
        log.log(said, "closed %d session(s) in %.2fs", count, time.monotonic() - began)
        if self.template is not None:
            await self.template.close()
        await self.leases.close_spare()
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()
        await self._task_group.__aexit__(None, None, None)
        await anyio.to_thread.run_sync(self.egress.close)
        await anyio.to_thread.run_sync(self.backend.close_starts)
        if self._sweeper is not None:
            self._sweeper.close(in_order=not self._sessions)

    def options(self, request: SandboxRequest = DEFAULT_REQUEST) -> SandboxOptions:
        """Options for a session or a one-shot run: the settings' defaults with what was asked for, checked."""
        return sandbox_options(self.settings, self.backend, self.base_mounts, request)

    async def create(
        self, options: SandboxOptions | None = None, owner: str = LOCAL_CALLER, pool_wait_s: float = 0.0,
        seed: Seed | None = None, session_id: str | None = None,
    ) -> Session:  # fmt: skip
        """A new session; from the warm pool when its options can be given to a pooled sandbox as it is
        taken (warm_take.py; `pool_wait_s`: how long to wait for a pooled start under way instead of
        starting cold). Its status says which way it went and why. `seed`: start from a
        snapshot (its files before the sandbox starts, its state once the kernel is up; never pooled).
        `session_id`: the handle to give it (a cluster names its actor by it first); else a new one.

        A keep_state session whose name has saved state starts from that state."""
        options = options or self.options()
        if seed is None and options.keep_state and options.name is not None:
            seed = await self.services.kept_state(options)
        if len(self._sessions) >= self.settings.max_sessions:
            raise SessionError(
                f"session limit reached ({self.settings.max_sessions} open): close one with manage_sessions "
                "(action 'close') or raise max_sessions in the configuration"
            )
        held = sum(session.owner == owner for session in self._sessions.values())
        if owner != LOCAL_CALLER and held >= self.settings.max_sessions_per_client:
            raise SessionError(
                f"this client already holds {held} sessions, its share of this server: close one with "
                "manage_sessions (action 'list' shows them), or raise max_sessions_per_client in the configuration"
            )
        warm = await self._take_warm(options, owner, pool_wait_s, seed, session_id)
        if isinstance(warm, Session):
            return warm
        self._cold_starts += 1
        try:
            await self._make_room()
            session = await self._prepare(options, owner, seed, session_id)
            self._sessions[session.session_id] = session
        finally:
            self._cold_starts -= 1
        session.started = StartedFrom(warm=False, why=warm)
        session.busy = True  # starting: the idle reaper must not close it under a slow start
        try:
            await session.lease.open_egress(self.egress, session.task_group, session.session_id, options)
            if seed is not None:
                await self.snapshots.start(seed, session)
                await self.snapshots.load(seed, session)
                session.kept.seeded = seed
                session.kept.restored_from = seed.snapshot_id if seed.with_workspace else None
            else:
                await session.start_kernel()
            session.kept.armed = True
        except BaseException:
            self._sessions.pop(session.session_id, None)
            await self._close_session(session)
            raise
        finally:
            session.busy = False
            session.last_used = time.monotonic()
        # What the kernel holds now is what was loaded (or nothing): not worth saving until it runs.
        loaded = seed is not None and not seed.with_workspace
        session.kept.mark_saved(session.last_used, "kernel state loaded" if loaded else None)
        session.keep_standby()
        log.info("session %s… started", session.session_id[:6])
        return session

    def _warm_problem(self, options: SandboxOptions, seed: Seed | None) -> str | None:
        """Why a create with `options` may not take a pooled sandbox (None: it may, if one is ready)."""
        if self._pool_options is None:
            if not self.pool.enabled:
                return "no warm pool (pool_size 0)"
            return "no warm pool for network 'allowlist' without pool_take_apply"
        if seed is not None:
            return "started from saved state"
        if not self.settings.pool_take_apply:
            if self._pool_options == dataclasses.replace(options, client=LOCAL_CLIENT):
                return None
            return "options other than the defaults start cold without pool_take_apply"
        return take_problem(self._pool_options, options, self.backend.live_limits_problem())

    async def _take_warm(
        self, options: SandboxOptions, owner: str, pool_wait_s: float, seed: Seed | None, session_id: str | None
    ) -> Session | str:
        """A session on a pooled sandbox given `options` at take (warm_take.py), or why the create starts cold.
        A sandbox that cannot be given them after all is closed, never handed out nor put back."""
        problem = self._warm_problem(options, seed)
        if problem is not None:
            return problem
        pooled = await self.pool.take_or_wait(pool_wait_s) if pool_wait_s > 0 else self.pool.take()
        if pooled is None:
            return self.pool.why_empty()
        assert self._pool_options is not None
        session, built = pooled.session, self._pool_options.limits
        session_id = session_id or secrets.token_urlsafe(18)
        try:
            if options.limits != built:
                process = session.kernel.process if session.kernel is not None else None
                if process is None:
                    raise SandboxUnavailable("its sandbox is gone")
                await off_loop(self.backend.lower_limits, process, built, options.limits)
                lower = address_space_code(built, options.limits)
                if lower is not None:
                    await self._silent_cell(session, lower, "its memory limit")
            await session.lease.open_egress(self.egress, session.task_group, session_id, options)
        except (SessionError, SandboxUnavailable) as exc:
            log.warning("warm pool: a pooled sandbox could not be given a create's options (%s); closed", exc)
            await self._discard_pooled(pooled)
            return f"the pooled sandbox could not be given its options ({exc})"
        except BaseException:  # cancelled half-way: never leave a taken sandbox nobody holds
            with anyio.CancelScope(shield=True):
                await self._discard_pooled(pooled)
            raise
        session = self._adopt(pooled, options, owner, session_id)
        session.started = StartedFrom(warm=True, why=warm_why(self._pool_options, options))
        return session

    async def _prepare(
        self, options: SandboxOptions, owner: str, seed: Seed | None = None, session_id: str | None = None
    ) -> Session:
        """A session's host side (dirs, mounts) and its Session, its kernel not yet started; with a
        `seed`, its workspace filled and its state staged first."""
        assert self._task_group is not None, "SessionManager used outside its `async with`"
        session_id = session_id or secrets.token_urlsafe(18)
        if seed is not None:
            await off_loop(self.snapshots.resolve, seed)
        memory = seed.memory if seed is not None else None
        lease = await self.leases.lease(options, owner=memory.owner if memory is not None else None)
        workspace = lease.dirs.workspace
        try:
            if seed is not None:
                await off_loop(self.snapshots.plant, seed, lease.dirs, bulk=True)
            # File walks and mount syscalls (and, for an id mapping, a helper process): off the loop.
            startup = (
                await anyio.to_thread.run_sync(disable_startup_hooks, workspace.path) if workspace.reopened else None
            )
            fresh = not workspace.reopened and (seed is None or not seed.with_workspace)
            await lease.mount(fresh)
        except SnapshotError:
            await lease.close()
            raise
        except OSError as exc:
            await lease.close()
            raise SessionError(f"could not check the reopened workspace's start-up files: {exc}") from None
        except BaseException:
            await lease.close()
            raise
        return Session(
            session_id=session_id,
            options=options,
            lease=lease,
            backend=self.backend,
            settings=self.settings,
            task_group=self._task_group,
            owner=owner,
            kernel_factory=self.kernel_factory,
            startup=startup.as_dict() if startup is not None else (seed.startup if seed is not None else None),
            standby_budget=self.standby_budget,
        )

    async def _start_pooled(self) -> Pooled:
        """A pool member: a default sandbox with a live kernel, bound to no caller and no client."""
        assert self._pool_options is not None
        if self.template is not None:
            # Nobody waits for a pooled start: it forks from a template that is starting (a server's first
            # seconds) rather than start cold beside it, which costs seconds of CPU and a member of ~100 MiB.
            await self.template.settled()
        session = await self._prepare(self._pool_options, LOCAL_CALLER)
        try:
            session.lease.reserve_egress(self.egress)  # allowlist: served once taken, with the taker's policy
            await session.start_kernel()
            await self._warm_up(session)
        except BaseException:
            await self._close_session(session)
            raise
        # No export folder until a client takes it: closing an untaken member copies nowhere.
        plan = session.sandbox_mounts
        exporter = plan.exporter if plan is not None else None
        if plan is not None:
            plan.exporter = None
        return Pooled(session, exporter)

    async def _warm_up(self, session: Session) -> None:
        """One silent warm-up cell (sessions/warm_up.py): the one-off costs of a fresh ipykernel's
        first execute and, with preload_imports, the common imports, paid before its user arrives."""
        await self._silent_cell(session, warm_up_code(self.settings.preload_imports), "its warm-up cell")

    async def _silent_cell(self, session: Session, code: str, what: str) -> None:
        """Run the server's own `code` silently in a pooled kernel nobody uses yet; SessionError if it fails."""
        assert session.kernel is not None
        output = OutputCollector(limit_chars=self.settings.output_limit_chars, spill_limit_bytes=0, image_limit_bytes=0)
        try:
            outcome = await session.kernel.execute(
                code, output, timeout_s=self.settings.startup_timeout_s,
                interrupt_grace_s=self.settings.interrupt_grace_s, silent=True,
                keep_on_cancel=False,  # a pooled kernel whose warm-up is stopped is discarded
            )  # fmt: skip
        finally:
            output.close()
        if outcome.status is not RunStatus.OK:
            raise SessionError(f"a pooled kernel failed {what} ({outcome.status.value})")

    async def _discard_pooled(self, pooled: Pooled) -> None:
        await self._close_session(pooled.session)

    def _adopt(self, pooled: Pooled, options: SandboxOptions, owner: str, session_id: str | None = None) -> Session:
        """Bind a pool member to the caller that takes it: its id, owner and client are set now."""
        session = pooled.session
        session.session_id = session_id or secrets.token_urlsafe(18)
        session.owner = owner
        session.options = options
        if pooled.exporter is not None and session.sandbox_mounts is not None:
            # The export folder is the client's: export_dir/<client> (exports.client_folder).
            pooled.exporter.target = client_folder(pooled.exporter.target.parent, options.client)
            session.sandbox_mounts.exporter = pooled.exporter
        session.created_at = session.last_used = time.monotonic()
        self._sessions[session.session_id] = session
        session.keep_standby()  # not while pooled: the pool's memory budget counts one kernel a member
        log.info("session %s… taken from the warm pool", session.session_id[:6])
        return session

    async def _close_session(self, session: Session) -> None:
        """Save (keep_state), close and release `session`, once: a second caller (create's clean-up after a
        a close stopped its start) waits for the first, and its host uid is never given back twice."""
        if session.close_done is not None:
            await session.close_done.wait()
            return
        session.close_done = anyio.Event()
        try:
            note = await self.snapshots.save_on_close(session)
            if note is not None:
                session.kept.close_note = note
                log.info("session %s…: %s", session.session_id[:6], note)
            await session.close()
            session.lease.release_user()
            self.pool.notify()  # its room may go to the pool again
        finally:
            session.close_done.set()

    async def resolve(self, session_id: str | None, owner: str = LOCAL_CALLER, client: str = LOCAL_CLIENT) -> Session:
        """The named session, or `owner`'s default one (created on first use).

        A session belongs to the client (bearer token) that created it: any caller of that client
        may use its id, a caller of another client is refused. The default session and the
        listing are per caller (callers.py).
        """
        if session_id:
            return self._owned(session_id, owner)
        async with self._default_lock:
            default_id = self._default_ids.get(owner)
            if default_id is None or default_id not in self._sessions:
                default_id = (await self.create(self.options(SandboxRequest(client=client)), owner=owner)).session_id
                self._default_ids[owner] = default_id
            return self._sessions[default_id]

    def _owned(self, session_id: str, owner: str | None) -> Session:
        """The open session `session_id`, if `owner`'s client may use it (None: the server itself)."""
        session = self._sessions.get(session_id)
        if session is None or (owner is not None and client_of_key(session.owner) != client_of_key(owner)):
            # Another client's session gets the same answer as none at all: ids must not be probed.
            raise SessionError(
                f"unknown or expired session_id {session_id!r}: manage_sessions (action 'list') shows your open "
                "sessions, create_session makes a new one, or omit session_id to use your default session"
            )
        return session

    async def close(self, session_id: str, owner: str | None = None) -> Session:
        """Close a session: for `owner` only if its client may use it (None: the server, e.g. idle reaping)."""
        session = self._owned(session_id, owner)
        self._sessions.pop(session_id, None)
        if self._default_ids.get(session.owner) == session_id:
            del self._default_ids[session.owner]
        await self._close_session(session)
        return session

    async def release_caller(self, owner: str) -> None:
        """A client went away: close its default session (sessions it created keep their handles)."""
        session_id = self._default_ids.pop(owner, None)
        if session_id is not None and session_id in self._sessions:
            log.info("client gone: closing its default session %s…", session_id[:6])
            with contextlib.suppress(SessionError):
                await self.close(session_id)

    async def close_all(self) -> None:
        """Close every session (and the pool, and the dirs made ahead); a second caller waits for the first."""
        if self._closing_all is not None:
            await self._closing_all.wait()
            return
        self._closing_all = anyio.Event()
        try:
            await self._close_all()
        finally:
            self._closing_all.set()

    async def _close_all(self) -> None:
        await self.pool.drain()
        await self.idle.drain()
        sessions = list(self._sessions.values())
        self._sessions.clear()
        self._default_ids.clear()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.leases.close_spare)
            for session in sessions:
                tg.start_soon(self._close_session, session)

    # --- outliving this process (a node agent's sessions: sessions/adoption.py) -----------------

    def keep_whole(self, session: Session, extra: dict[str, Any]) -> str | None:
        """Have `session` outlive this process for a successor, should the process die; why not, if it cannot."""
        return keep_whole(self, session, extra)

    async def adopt(self, path: Path, timeout_s: float) -> builtins.list[tuple[Session, SessionRecord]]:
        """The sessions a dead predecessor kept for its successor (its watcher waits at `path`), now this
        manager's own, each with the record it was kept with."""
        adopted = await adopt_all(self, path, timeout_s)
        for session, _ in adopted:
            self._sessions[session.session_id] = session
        return adopted

    def is_default(self, session: SessionHandle) -> bool:
        return self._default_ids.get(session.owner) == session.session_id

    def list(self, owner: str | None = None) -> list[Session]:
        """Every open session, or those `owner` created."""
        return [s for s in self._sessions.values() if owner is None or s.owner == owner]

    # --- the host's calls beside sessions: its HostServices' (host_services.py) ----------------

    def profile(self) -> SandboxProfile:
        return self.services.profile()

    async def take_snapshot(self, session: SessionHandle, name: str) -> Taken:
        return await self.services.take_snapshot(session, name)

    async def snapshot(self, client: str, snapshot_id: str) -> SnapshotMeta:
        return await self.services.snapshot(client, snapshot_id)

    async def snapshot_listing(self, client: str) -> Listing:
        return await self.services.snapshot_listing(client)

    async def delete_snapshot(self, client: str, snapshot_id: str) -> None:
        await self.services.delete_snapshot(client, snapshot_id)

    async def snapshots_of(self, session: SessionHandle) -> builtins.list[str]:
        return await self.services.snapshots_of(session)

    async def list_workspaces(self, client: str) -> builtins.list[NamedWorkspace]:
        return await self.services.list_workspaces(client)

    async def delete_workspace(self, client: str, name: str) -> None:
        await self.services.delete_workspace(client, name)


@dataclasses.dataclass
class Pooled:
    """A warm pool member: its session, and its export copier, held back until a client takes it."""

    session: Session
    exporter: Exporter | None
