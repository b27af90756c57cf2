"""Sessions and their manager: the only place that owns mutable server state.

A Session is a workspace plus a sandboxed kernel that may be replaced (timeout restart,
death, reset) while the session and its files live on. The SessionManager hands out
high-entropy handles, creates the default session on first use, enforces the session
limit, and on start removes what a killed server left behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from . import hostfs
from .callers import LOCAL_CALLER, client_of_key
from .client_tokens import tokens_dir
from .config import MIN_MEMORY_MB, Settings
from .exports import ExportError, client_folder, folder_owner, prepare_export_dir
from .files import SandboxFiles
from .kernel import Kernel, ProgressCallback, RunOutcome, RunStatus
from .mounts import MountError, MountSpec, check_distinct, check_sandbox_path, resolve_mount
from .oneshot import OneShotRunner
from .output import OutputCollector, WorkspaceWriter
from .owners import LOCAL_CLIENT
from .results import ExecutionResult
from .sandbox import (
    SESSION_PACKAGES,
    LimitReport,
    Limits,
    Mount,
    SandboxBackend,
    SandboxSpec,
    UidPool,
    ensure_private_dir,
    per_sandbox_uids,
)
from .sandbox_mounts import ExportPlan, MountsError, SandboxMounts, prepare_mounts
from .session_dirs import SandboxDirs, open_sandbox_dirs, remove_stale_dirs
from .startup_hooks import disable_startup_hooks
from .workspace import Workspace, WorkspaceError, named_workspace_dir

log = logging.getLogger(__name__)

#: Bound on closing every session at server shutdown.
SHUTDOWN_TIMEOUT_S = 10.0
#: Bound on waiting for a running call to notice its session is being closed.
CLOSE_WAIT_S = 5.0
#: Bound on a quick guest call (setting variables), and the margin added to a slow one's own bound.
GUEST_MARGIN_S = 15.0
SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")


class SessionError(Exception):
    """A request about sessions that cannot be served; the message says what to do instead."""


class GuestCallError(SessionError):
    """A guest tool refused its input or failed; the message is the reason."""


class SessionBusy(SessionError):
    """Another call holds the session's kernel."""


@dataclass(frozen=True)
class SessionOptions:
    network: str
    limits: Limits
    timeout_s: float
    mounts: tuple[Mount, ...] = ()
    #: A named session's workspace can be persistent: it outlives the session and the server.
    name: str | None = None
    persistent: bool = False
    #: The client that owns its exports and its persistent name (owners.py).
    client: str = LOCAL_CLIENT


@dataclass
class SessionStatus:
    session_id: str
    name: str | None
    persistent: bool
    alive: bool
    busy: bool
    uptime_s: float
    kernel_uptime_s: float
    memory_used_mb: float | None
    usage: dict[str, float | None]
    idle_s: float
    restarts: int
    network: str
    timeout_s: float
    workspace: str
    mounts: list[dict[str, str]]
    limits: dict[str, LimitReport]
    isolation: str


@dataclass
class Session:
    session_id: str
    options: SessionOptions
    dirs: SandboxDirs
    backend: SandboxBackend
    settings: Settings
    task_group: TaskGroup
    #: The caller that created it (see callers.py): whose listing and default session it is in; its
    #: token's client is the only one that may use it.
    owner: str = LOCAL_CALLER
    kernel: Kernel | None = None
    created_at: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    restarts: int = 0
    busy: bool = False
    closed: bool = False
    #: Set while kernel_reset stops a running call, so that call's reply says why it ended.
    _resetting: bool = False
    _generation: int = 0
    _lock: anyio.Lock = field(default_factory=anyio.Lock)
    #: Its mounts as the sandbox gets them (staged on a root server) and its export outbox.
    sandbox_mounts: SandboxMounts | None = None
    #: What the last copy-out to the export folder did, for the reply.
    export_note: str | None = None
    #: A reopened workspace's start-up files and packages (startup_hooks.py), for create_session's reply.
    startup: dict[str, Any] | None = None

    @property
    def mounts(self) -> tuple[Mount, ...]:
        return self.sandbox_mounts.mounts if self.sandbox_mounts is not None else self.options.mounts

    async def copy_out(self) -> None:
        """Copy new files in the outbox to the client's export folder (a worker thread: it is file I/O)."""
        plan = self.sandbox_mounts
        if plan is None or plan.exporter is None:
            return
        try:
            with anyio.CancelScope(shield=True):
                report = await anyio.to_thread.run_sync(plan.export)
        except OSError as exc:
            self.export_note = f"copying to the export folder failed: {exc}"
            return
        self.export_note = plan.note(report)

    def _export_status(self) -> list[dict[str, str]]:
        plan = self.sandbox_mounts
        if plan is None or plan.exporter is None or plan.export_mount is None:
            return []
        target = str(plan.exporter.target)
        return [{"sandbox": plan.export_mount, "host": target, "mode": "rw", "exported": "after each call"}]

    @property
    def workspace(self) -> Workspace:
        return self.dirs.workspace

    @property
    def spec(self) -> SandboxSpec:
        return sandbox_spec(self.options, self.dirs, self.mounts)

    @property
    def files(self) -> SandboxFiles:
        """The session's files as the host may touch them: workspace and mounts, symlink-safe."""
        workspace = Mount(self.workspace.path, self.backend.workspace_path, writable=True)
        plan = self.sandbox_mounts
        if plan is None:
            return SandboxFiles([workspace, *self.options.mounts], owner=self.dirs.owner)
        return SandboxFiles([workspace, *plan.host_view], owner=self.dirs.owner, owners=plan.owners)

    async def start_kernel(self) -> None:
        kernel = Kernel(self.backend, self.spec, self.task_group, self.dirs, generation=self._generation)
        self._generation += 1
        await kernel.start(self.settings.startup_timeout_s)
        if self.closed:  # closed while the kernel was starting
            await kernel.shutdown()
            raise SessionError(f"session {self.session_id} was closed")
        self.kernel = kernel

    async def _replace_kernel(self) -> None:
        """Kill the current kernel (if any) and start a fresh one; workspace files are kept."""
        with anyio.CancelScope(shield=True):
            if self.kernel is not None:
                await self.kernel.shutdown()
                self.kernel = None
            if self.closed:
                raise SessionError(f"session {self.session_id} was closed")
            self.restarts += 1
            await self.start_kernel()

    @contextlib.asynccontextmanager
    async def _exclusive(self, wait_s: float) -> AsyncIterator[None]:
        """One call at a time per kernel; a caller that cannot get in within `wait_s` is told so."""
        with anyio.move_on_after(wait_s) as scope:
            await self._lock.acquire()
        if scope.cancelled_caught:
            raise SessionBusy(
                f"session {self.session_id} is busy with another call; try again when it finishes "
                "(or use another session)"
            )
        try:
            if self.closed:
                raise SessionError(f"session {self.session_id} was closed")
            self.busy = True
            self.export_note = None
            try:
                yield
            finally:
                await self.copy_out()
        finally:
            self.busy = False
            self.last_used = time.monotonic()
            self._lock.release()

    async def run(
        self,
        code: str,
        timeout_s: float | None,
        progress: ProgressCallback | None,
        variables: dict[str, Any] | None = None,
    ) -> ExecutionResult:
        """Run `code`, after setting `variables` (checked names, JSON values) as globals."""
        timeout = min(timeout_s or self.options.timeout_s, self.settings.max_timeout_s)
        async with self._exclusive(wait_s=timeout):
            if self.kernel is None or not self.kernel.alive:
                await self._replace_kernel()
            if variables:
                await self._guest_call_held("variables", {"values": variables}, GUEST_MARGIN_S)
            assert self.kernel is not None
            output = OutputCollector(
                limit_chars=self.settings.output_limit_chars,
                spill_limit_bytes=self.settings.spill_limit_bytes,
                image_limit_bytes=self.settings.image_limit_bytes,
                writer=WorkspaceWriter(self.workspace.path, self.backend.workspace_path, self.dirs.owner),
            )
            try:
                outcome = await self.kernel.execute(
                    code,
                    output,
                    timeout_s=timeout,
                    interrupt_grace_s=self.settings.interrupt_grace_s,
                    progress=progress,
                    progress_interval_s=self.settings.progress_interval_s,
                )
            except anyio.get_cancelled_exc_class():
                if self.kernel.wedged or not self.kernel.alive:
                    await self._replace_kernel()
                raise
            finally:
                output.close()
            return await self._settle(outcome, timeout)

    async def _settle(self, outcome: RunOutcome, timeout: float) -> ExecutionResult:
        """Turn what happened into words, restarting the kernel where it cannot go on."""
        if outcome.status is RunStatus.INTERRUPTED:
            return ExecutionResult(
                outcome,
                notice=f"timed out after {timeout:g}s: interrupted; the kernel and its state are kept",
            )
        if outcome.status is RunStatus.UNRESPONSIVE:
            await self._replace_kernel()
            return ExecutionResult(
                outcome,
                notice=(
                    f"timed out after {timeout:g}s and ignored the interrupt for "
                    f"{self.settings.interrupt_grace_s:g}s: kernel restarted; state lost "
                    "(variables and imports), workspace files kept"
                ),
                state_lost=True,
            )
        if self.closed:
            return ExecutionResult(outcome, notice="the session was closed during this call", state_lost=True)
        if self._resetting:
            # kernel_reset is waiting for this call to end; it starts the fresh kernel itself.
            return ExecutionResult(outcome, notice="stopped by kernel_reset: state lost", state_lost=True)
        if outcome.status is RunStatus.DIED:
            assert self.kernel is not None
            process = self.kernel.process
            if process is not None and process.oom_killed():
                cause = f"killed for exceeding its memory limit of {self.options.limits.memory_mb} MiB"
            else:
                cause = f"exit code {outcome.exit_code}; killed, crashed or out of memory"
            await self._replace_kernel()
            return ExecutionResult(
                outcome,
                notice=f"kernel died ({cause}); state lost; a fresh kernel is ready, workspace files kept",
                state_lost=True,
            )
        if outcome.output_lost:
            return ExecutionResult(
                outcome,
                notice="some output was lost: a message was over the host's 32 MiB limit or could not be read",
            )
        return ExecutionResult(outcome)

    async def call_guest(self, tool: str, arguments: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Run a guest tool inside this session's kernel; its answer, or GuestCallError with the reason.

        Waits for a busy kernel within `timeout_s`, then answers busy; never leaves a name behind
        in the user's namespace or history.
        """
        async with self._exclusive(wait_s=timeout_s):
            if self.kernel is None or not self.kernel.alive:
                await self._replace_kernel()
            return await self._guest_call_held(tool, arguments, timeout_s)

    async def _guest_call_held(self, tool: str, arguments: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """call_guest for a caller that already holds the kernel."""
        assert self.kernel is not None
        call = (
            f"await __import__('coderunner_guest.dispatch', fromlist=['call']).call({tool!r}, "
            f"{json.dumps(arguments)!r})"
        )
        output = OutputCollector(limit_chars=self.settings.output_limit_chars, spill_limit_bytes=0, image_limit_bytes=0)
        try:
            outcome = await self.kernel.execute(
                call, output, timeout_s=timeout_s, interrupt_grace_s=self.settings.interrupt_grace_s, silent=True
            )
        except anyio.get_cancelled_exc_class():
            if self.kernel.wedged or not self.kernel.alive:
                await self._replace_kernel()
            raise
        settled = await self._settle(outcome, timeout_s)
        payload = outcome.guest_payload
        if payload is None:
            detail = settled.notice or output.text().strip()[-1500:] or "no answer"
            raise GuestCallError(f"{tool} did not complete: {detail}")
        if not payload.get("ok"):
            raise GuestCallError(f"{tool}: {payload.get('error', 'failed')}")
        result = payload.get("result")
        return result if isinstance(result, dict) else {"result": result}

    async def install_packages(self, packages: list[str], timeout_s: float) -> dict[str, Any]:
        """pip into this session's own package folder (in its workspace), from inside its sandbox."""
        if self.options.network != "internet":
            raise SessionError(
                f"install_packages needs network, and session {self.session_id} has network "
                f"'{self.options.network}': create a session with create_session(network='internet') and install "
                "there (code in that session can then reach the internet)"
            )
        target = f"{self.backend.workspace_path}/{SESSION_PACKAGES}"
        arguments = {"packages": packages, "target": target, "timeout_s": timeout_s}
        return await self.call_guest("packages", arguments, timeout_s + GUEST_MARGIN_S)

    async def reset(self) -> None:
        """Fresh interpreter state, even while a call runs: interrupt it, and kill it if it ignores that."""
        if not self._lock.locked():
            async with self._exclusive(wait_s=self.settings.interrupt_grace_s):
                await self._replace_kernel()
            return
        self._resetting = True
        try:
            if self.kernel is not None:
                self.kernel.interrupt()
            try:
                async with self._exclusive(wait_s=self.settings.interrupt_grace_s):
                    await self._replace_kernel()
                return
            except SessionBusy:
                if self.kernel is not None and self.kernel.process is not None:
                    await self.kernel.process.kill()
            async with self._exclusive(wait_s=self.settings.startup_timeout_s):
                await self._replace_kernel()
        finally:
            self._resetting = False

    async def close(self) -> None:
        self.closed = True
        with anyio.CancelScope(shield=True):
            if self._lock.locked() and self.kernel is not None and self.kernel.process is not None:
                # A call is running: kill the sandbox so that call sees the death and returns,
                # then take the kernel down once it has let go.
                await self.kernel.process.kill()
                with anyio.move_on_after(CLOSE_WAIT_S):
                    async with self._lock:
                        pass
            if self.kernel is not None:
                await self.kernel.shutdown()
                self.kernel = None
            await self.copy_out()
            if self.sandbox_mounts is not None and not await anyio.to_thread.run_sync(self.sandbox_mounts.close):
                log.warning("session %s…: a staged mount would not detach; its dirs are left", self.session_id[:6])
                return
            await anyio.to_thread.run_sync(self.dirs.close)

    def usage(self) -> dict[str, float | None]:
        """What the session uses, in the units of its limits."""
        process = self.kernel.process if self.kernel is not None else None
        cgroup = process.cgroup if process is not None else None
        try:
            disk = os.statvfs(self.workspace.path)
            disk_used: float | None = round((disk.f_blocks - disk.f_bfree) * disk.f_frsize / 2**20, 1)
        except OSError:
            disk_used = None
        if self.workspace.image is None:
            disk_used = _dir_size_mb(self.workspace.path)
        return {
            "memory_mb": _memory_used_mb(self.kernel) if self.kernel is not None and self.kernel.alive else None,
            "memory_peak_mb": round(peak / 2**20, 1) if cgroup and (peak := cgroup.memory_peak_bytes()) else None,
            "pids": cgroup.pids_current() if cgroup is not None else None,
            "disk_mb": disk_used,
        }

    def status(self) -> SessionStatus:
        kernel = self.kernel
        alive = kernel is not None and kernel.alive
        now = time.monotonic()
        return SessionStatus(
            session_id=self.session_id,
            name=self.options.name,
            persistent=self.options.persistent,
            alive=alive,
            busy=self.busy,
            uptime_s=now - self.created_at,
            kernel_uptime_s=(now - kernel.started_at) if kernel is not None and alive else 0.0,
            memory_used_mb=_memory_used_mb(kernel) if kernel is not None and alive else None,
            usage=self.usage(),
            idle_s=0.0 if self.busy else now - self.last_used,
            restarts=self.restarts,
            network=self.options.network,
            timeout_s=self.options.timeout_s,
            workspace=self.backend.workspace_path,
            mounts=[
                {"sandbox": m.sandbox, "host": str(m.host), "mode": "rw" if m.writable else "ro"}
                for m in self.options.mounts
            ]
            + self._export_status(),
            limits={
                **self.backend.limit_reports(self.options.limits),
                "disk_mb": LimitReport(self.workspace.size_mb, self.workspace.enforced_by),
            },
            isolation=self.backend.describe_isolation(),
        )


class SessionManager:
    """Owns every session of one server process, and the task group their sandboxes run in."""

    def __init__(self, settings: Settings, backend: SandboxBackend) -> None:
        self.settings = settings
        self.backend = backend
        self._sessions: dict[str, Session] = {}
        #: Each client's default session: caller key -> session id.
        self._default_ids: dict[str, str] = {}
        self._default_lock = anyio.Lock()
        self._task_group: TaskGroup | None = None
        self.base_mounts: list[Mount] = []
        #: A root server's per-sandbox host uids (None: all sandboxes run as one user).
        self.users = UidPool() if per_sandbox_uids(settings.sandbox_user) else None
        #: Throwaway sandboxes for execute_code / validate_code (set up on entry).
        self.oneshot: OneShotRunner

    async def __aenter__(self) -> SessionManager:
        ensure_private_dir(self.settings.runtime_dir, self.backend.dir_mode)
        ensure_private_dir(self.settings.workspaces_dir, self.backend.dir_mode)
        self.base_mounts = self._configured_mounts()
        removed = remove_stale_dirs(self.settings.runtime_dir, self.settings.workspaces_dir, self.backend.remove_stale)
        if removed:
            log.info("removed %d session dir(s) left by a server that is gone", removed)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._reap_idle)
        self.oneshot = OneShotRunner(
            backend=self.backend,
            task_group=self._task_group,
            output_limit_bytes=self.settings.output_limit_chars,
            open_dirs=self.open_dirs,
            close_dirs=self.close_dirs,
            spec_for=sandbox_spec,
            mounts_for=self.sandbox_mounts,
            max_concurrent=self.settings.max_oneshot_runs,
            max_per_caller=self.settings.max_oneshot_runs_per_client,
        )
        return self

    async def _reap_idle(self) -> None:
        """Close sessions nobody used for idle_timeout_s (their sandboxes hold memory and disk)."""
        limit = self.settings.idle_timeout_s
        while True:
            await anyio.sleep(min(max(limit / 4, 0.5), 30.0))
            now = time.monotonic()
            for session in list(self._sessions.values()):
                if not session.busy and now - session.last_used > limit:
                    log.info("closing session %s… after %.0fs idle", session.session_id[:6], now - session.last_used)
                    with contextlib.suppress(SessionError):
                        await self.close(session.session_id)

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.move_on_after(SHUTDOWN_TIMEOUT_S, shield=True):
            await self.close_all()
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()
        await self._task_group.__aexit__(None, None, None)

    def options(
        self,
        network: str | None = None,
        memory_mb: int | None = None,
        cpus: float | None = None,
        timeout_s: float | None = None,
        mounts: list[MountSpec] | None = None,
        name: str | None = None,
        persistent: bool = False,
        client: str = LOCAL_CLIENT,
    ) -> SessionOptions:
        if name is not None and not SESSION_NAME.fullmatch(name):
            raise SessionError(f"session name {name!r}: use 1-40 letters, digits, '.', '_' or '-'")
        if persistent and name is None:
            raise SessionError("a persistent session needs a name (its workspace is found by it next time)")
        network = network or self.settings.network
        problem = self.backend.network_problem(network)
        if problem:
            raise SessionError(problem)
        if memory_mb is not None and memory_mb < MIN_MEMORY_MB:
            raise SessionError(f"memory_mb must be at least {MIN_MEMORY_MB} (a kernel with numpy maps ~420 MiB)")
        if cpus is not None and cpus <= 0:
            raise SessionError("cpus must be positive")
        if timeout_s is not None and not 0 < timeout_s <= self.settings.max_timeout_s:
            raise SessionError(f"timeout_s must be between 0 and {self.settings.max_timeout_s:g} seconds")
        return SessionOptions(
            network=network,
            limits=Limits(
                memory_mb=memory_mb or self.settings.memory_mb,
                cpus=cpus or self.settings.cpus,
                pids=self.settings.pids,
                tmp_mb=self.settings.tmp_mb,
                disk_mb=self.settings.disk_mb,
            ),
            timeout_s=timeout_s or self.settings.timeout_s,
            mounts=(*self.base_mounts, *self._session_mounts(mounts or [])),
            name=name,
            persistent=persistent,
            client=client,
        )

    def export_plan(self, client: str) -> ExportPlan | None:
        """Where `client`'s sandboxes save exports (export_mount) and where those land on the host."""
        export_dir = self.settings.export_dir
        if export_dir is None:
            return None
        root = prepare_export_dir(export_dir)
        return ExportPlan(
            mount=self.settings.export_mount,
            target=client_folder(root, client),
            limit_bytes=self.settings.export_limit_mb * 2**20,
            owner=folder_owner(root, None),
        )

    def sandbox_mounts(self, options: SessionOptions, dirs: SandboxDirs, fresh: bool = True) -> SandboxMounts:
        """A sandbox's mounts (staged in its host-only dir on a root server) and its outbox; raises
        SessionError. Runs in a worker thread (mount syscalls, an id-map helper process)."""
        try:
            return prepare_mounts(options.mounts, dirs.top, dirs.workspace.path, dirs.owner,
                                  self.export_plan(options.client), fresh_workspace=fresh)  # fmt: skip
        except (MountsError, ExportError, OSError) as exc:
            raise SessionError(f"could not prepare the sandbox's folders: {exc}") from None

    def _protected_paths(self) -> list[Path]:
        """Paths no mount may overlap: other sessions' workspaces and sockets, the sandbox env, the HTTP tokens."""
        settings = self.settings
        return [settings.runtime_dir, settings.workspaces_dir, settings.sandbox_env, settings.token_file,
                tokens_dir(settings.token_file)]  # fmt: skip

    def _configured_mounts(self) -> list[Mount]:
        """The server-wide configured mounts (the export outbox is per sandbox). Raises MountError."""
        identity = self.backend.identity
        mounts = [resolve_mount(spec, protected=self._protected_paths(), identity=identity)
                  for spec in self.settings.mounts]  # fmt: skip
        check_distinct([*mounts, *self._export_mount()])
        if self.settings.export_dir is not None:
            try:
                prepare_export_dir(self.settings.export_dir)  # at start: a bad folder is told at once
            except ExportError as exc:
                raise MountError(exc.strerror) from None
        return mounts

    def _export_mount(self) -> list[Mount]:
        """The export mount's sandbox path, so that no other mount takes it."""
        if self.settings.export_dir is None:
            return []
        return [Mount(Path("/"), check_sandbox_path(self.settings.export_mount), writable=True)]

    def _session_mounts(self, specs: list[MountSpec]) -> list[Mount]:
        """Mounts asked for by create_session: only under a folder the configuration allows."""
        roots = [root.expanduser().resolve() for root in self.settings.allowed_mount_roots]
        mounts = []
        for spec in specs:
            try:
                mount = resolve_mount(spec, protected=self._protected_paths(), identity=self.backend.identity)
            except MountError as exc:
                raise SessionError(str(exc)) from None
            if not any(mount.host == root or root in mount.host.parents for root in roots):
                allowed = ", ".join(str(root) for root in roots) or "none are configured (allowed_mount_roots)"
                raise SessionError(f"{mount.host} may not be mounted: sessions may mount only under {allowed}")
            mounts.append(mount)
        try:
            check_distinct([*self.base_mounts, *self._export_mount(), *mounts])
        except MountError as exc:
            raise SessionError(str(exc)) from None
        return mounts

    async def create(self, options: SessionOptions | None = None, owner: str = LOCAL_CALLER) -> Session:
        options = options or self.options()
        if len(self._sessions) >= self.settings.max_sessions:
            raise SessionError(
                f"session limit reached ({self.settings.max_sessions} open): close one with close_session "
                "or raise max_sessions in the configuration"
            )
        held = sum(session.owner == owner for session in self._sessions.values())
        if owner != LOCAL_CALLER and held >= self.settings.max_sessions_per_client:
            raise SessionError(
                f"this client already holds {held} sessions, its share of this server: close one with "
                "close_session (list_sessions shows them), or raise max_sessions_per_client in the configuration"
            )
        assert self._task_group is not None, "SessionManager used outside its `async with`"
        session_id = secrets.token_urlsafe(18)
        dirs = await self.open_dirs(options)
        workspace = dirs.workspace
        try:
            # File walks and mount syscalls (and, for an id mapping, a helper process): off the loop.
            startup = (
                await anyio.to_thread.run_sync(disable_startup_hooks, workspace.path) if workspace.reopened else None
            )
            mounts = await anyio.to_thread.run_sync(self.sandbox_mounts, options, dirs, not workspace.reopened)
        except OSError as exc:
            await self.close_dirs(dirs)
            raise SessionError(f"could not check the reopened workspace's start-up files: {exc}") from None
        except BaseException:
            await self.close_dirs(dirs)
            raise
        session = Session(
            session_id=session_id,
            options=options,
            dirs=dirs,
            backend=self.backend,
            settings=self.settings,
            task_group=self._task_group,
            owner=owner,
            sandbox_mounts=mounts,
            startup=startup.as_dict() if startup is not None else None,
        )
        self._sessions[session_id] = session
        try:
            await session.start_kernel()
        except BaseException:
            self._sessions.pop(session_id, None)
            await self._close_session(session)
            raise
        log.info("session %s… started", session_id[:6])
        return session

    async def open_dirs(self, options: SessionOptions) -> SandboxDirs:
        """A sandbox's host side (see session_dirs.py), made in a worker thread: creating a capped
        workspace runs mkfs and mount. Raises SessionError."""
        stable = f"named/{options.client}/{options.name}" if options.persistent else None
        user = self.users.allocate(stable) if self.users is not None else self.backend.identity

        def make_workspace(key: str, owner: tuple[int, int] | None) -> Workspace:
            if options.persistent:
                assert options.name is not None
                path = named_workspace_dir(self.settings.workspaces_dir, options.client, options.name,
                                           self.backend.dir_mode)  # fmt: skip
            else:
                path = self.settings.workspaces_dir / key
            workspace = Workspace.create(
                path, options.limits.disk_mb, self.settings.workspace_quota, persistent=options.persistent
            )
            try:
                if owner is not None:
                    _adopt(workspace, owner)
            except BaseException:
                workspace.remove()
                raise
            return workspace

        def make() -> SandboxDirs:
            return open_sandbox_dirs(
                self.settings.runtime_dir,
                network=options.network,
                dir_mode=self.backend.dir_mode,
                user=user,
                make_workspace=make_workspace,
            )

        try:
            return await anyio.to_thread.run_sync(make)
        except (OSError, WorkspaceError) as exc:
            if self.users is not None:
                self.users.release(user)
            raise SessionError(f"could not open the session workspace: {exc}") from None

    async def close_dirs(self, dirs: SandboxDirs) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(dirs.close)
        if self.users is not None:
            self.users.release(dirs.user)

    async def _close_session(self, session: Session) -> None:
        await session.close()
        if self.users is not None:
            self.users.release(session.dirs.user)

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
                default_id = (await self.create(self.options(client=client), owner=owner)).session_id
                self._default_ids[owner] = default_id
            return self._sessions[default_id]

    def _owned(self, session_id: str, owner: str | None) -> Session:
        """The open session `session_id`, if `owner`'s client may use it (None: the server itself)."""
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionError(
                f"unknown or expired session_id {session_id!r}: call list_sessions to see open sessions, "
                "create_session for a new one, or omit session_id to use the default session"
            )
        if owner is not None and client_of_key(session.owner) != client_of_key(owner):
            raise SessionError(
                f"session_id {session_id!r} belongs to another client (it was created with another bearer "
                "token) and only that client may use it: omit session_id to use your own default session, "
                "or create_session for a new one"
            )
        return session

    async def close(self, session_id: str, owner: str | None = None) -> None:
        """Close a session: for `owner` only if its client may use it (None: the server, e.g. idle reaping)."""
        session = self._owned(session_id, owner)
        self._sessions.pop(session_id, None)
        if self._default_ids.get(session.owner) == session_id:
            del self._default_ids[session.owner]
        await self._close_session(session)

    async def release_caller(self, owner: str) -> None:
        """A client went away: close its default session (sessions it created keep their handles)."""
        session_id = self._default_ids.pop(owner, None)
        if session_id is not None and session_id in self._sessions:
            log.info("client gone: closing its default session %s…", session_id[:6])
            with contextlib.suppress(SessionError):
                await self.close(session_id)

    async def close_all(self) -> None:
        sessions = list(self._sessions.values())
        self._sessions.clear()
        self._default_ids.clear()
        async with anyio.create_task_group() as tg:
            for session in sessions:
                tg.start_soon(self._close_session, session)

    def list(self, owner: str | None = None) -> list[Session]:
        """Every open session, or those `owner` created."""
        return [s for s in self._sessions.values() if owner is None or s.owner == owner]

    def is_default(self, session: Session) -> bool:
        return self._default_ids.get(session.owner) == session.session_id


def sandbox_spec(options: SessionOptions, dirs: SandboxDirs, mounts: tuple[Mount, ...]) -> SandboxSpec:
    """What a backend needs to start a sandbox with these options in these dirs, with these mounts
    (as the sandbox gets them: staged on a root server)."""
    return SandboxSpec(
        name=dirs.key,
        workspace=dirs.workspace.path,
        runtime_dir=dirs.run_dir,
        host_dir=dirs.host_dir,
        limits=options.limits,
        network=options.network,
        mounts=mounts,
        user=dirs.user,
    )


def _adopt(workspace: Workspace, owner: tuple[int, int]) -> None:
    """Hand the workspace to the sandbox's host user, by fd; a reopened persistent one whose files
    belong to another uid (an older server's) is re-owned entry by entry, links never followed."""
    with hostfs.dir_fd(workspace.path) as fd:
        if workspace.persistent and (os.fstat(fd).st_uid, os.fstat(fd).st_gid) != owner:
            if not hostfs.chown_tree(fd, owner):
                log.warning("workspace %s: some entries (too deep, or too many) keep their old owner", workspace.path)
        else:
            os.fchown(fd, *owner)


def _memory_used_mb(kernel: Kernel) -> float | None:
    """The sandbox's cgroup usage where there is one, else the resident memory of its process tree."""
    if kernel.process is None:
        return None
    return kernel.process.memory_used_mb() or _tree_rss_mb(kernel.process.pid)


def _dir_size_mb(path: Path) -> float | None:
    """Bytes under `path`, walked by fds without following links (bounded by hostfs.walk)."""
    try:
        with hostfs.dir_fd(path) as fd:
            total, _complete = hostfs.tree_size(fd)
    except OSError:
        return None
    return round(total / 2**20, 1)


def _tree_rss_mb(pid: int) -> float | None:
    """Resident memory of a process and all its descendants, from /proc."""
    total_kb = 0
    pending = [pid]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            with open(f"/proc/{current}/status") as handle:
                for line in handle:
                    if line.startswith("VmRSS:"):
                        total_kb += int(line.split()[1])
                        break
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as handle:
                    pending.extend(int(child) for child in handle.read().split())
        except (OSError, ValueError):
            continue
    return round(total_kb / 1024, 1) if seen else None
