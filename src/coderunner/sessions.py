"""Sessions and their manager: the only place that owns mutable server state.

A Session is a workspace plus a sandboxed kernel that may be replaced (timeout restart,
death, reset) while the session and its files live on. The SessionManager hands out
high-entropy handles, creates the default session on first use, enforces the session
limit, and on start removes what a killed server left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from .callers import LOCAL_CALLER
from .config import MIN_MEMORY_MB, Settings
from .files import SandboxFiles
from .kernel import Kernel, ProgressCallback, RunOutcome, RunStatus
from .mounts import MountError, MountSpec, check_distinct, prepare_export_dir, resolve_mount
from .oneshot import OneShotRunner
from .output import OutputCollector, WorkspaceWriter
from .results import ExecutionResult
from .sandbox.base import SESSION_PACKAGES, LimitReport, Limits, Mount, SandboxBackend, SandboxSpec
from .sandbox.identity import ensure_private_dir
from .workspace import Workspace, WorkspaceError, remove_workspace

log = logging.getLogger(__name__)

#: Bound on closing every session at server shutdown.
SHUTDOWN_TIMEOUT_S = 10.0
#: Bound on waiting for a running call to notice its session is being closed.
CLOSE_WAIT_S = 5.0
#: Bound on a quick guest call (setting variables), and the margin added to a slow one's own bound.
GUEST_MARGIN_S = 15.0
LOCK_NAME = "lock"
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
    workspace: Workspace
    runtime_dir: Path
    backend: SandboxBackend
    settings: Settings
    task_group: TaskGroup
    lock_fd: int
    #: The client that created it (see callers.py): whose listing and default session it is in.
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

    @property
    def spec(self) -> SandboxSpec:
        return SandboxSpec(
            name=self.workspace.path.name,
            workspace=self.workspace.path,
            runtime_dir=self.runtime_dir,
            limits=self.options.limits,
            network=self.options.network,
            mounts=self.options.mounts,
        )

    @property
    def files(self) -> SandboxFiles:
        """The session's files as the host may touch them: workspace and mounts, symlink-safe."""
        workspace = Mount(self.workspace.path, self.backend.workspace_path, writable=True)
        return SandboxFiles([workspace, *self.options.mounts], owner=self.backend.host_owner)

    async def start_kernel(self) -> None:
        kernel = Kernel(self.backend, self.spec, self.task_group, generation=self._generation)
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
            yield
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
                writer=WorkspaceWriter(self.workspace.path, self.backend.workspace_path, self.backend.host_owner),
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
                notice="some output was lost: a single message exceeded the host's 32 MiB limit",
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
            self.workspace.remove()
            _remove_session_dirs(self.runtime_dir)
            with contextlib.suppress(OSError):
                os.close(self.lock_fd)

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
            ],
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
        #: Throwaway sandboxes for execute_code / validate_code (set up on entry).
        self.oneshot: OneShotRunner

    async def __aenter__(self) -> SessionManager:
        ensure_private_dir(self.settings.runtime_dir, self.backend.dir_mode)
        ensure_private_dir(self.settings.workspaces_dir, self.backend.dir_mode)
        self.base_mounts = self._configured_mounts()
        removed = remove_stale_sessions(self.settings.runtime_dir, self.settings.workspaces_dir, self.backend)
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
        )

    def _protected_paths(self) -> list[Path]:
        """Paths no mount may overlap: other sessions' workspaces and sockets, the sandbox env, the HTTP token."""
        settings = self.settings
        return [settings.runtime_dir, settings.workspaces_dir, settings.sandbox_env, settings.token_file]

    def _configured_mounts(self) -> list[Mount]:
        """The server-wide mounts: the export folder (rw) plus the configured ones. Raises MountError."""
        identity = self.backend.identity
        specs = list(self.settings.mounts)
        if self.settings.export_dir is not None:
            export = prepare_export_dir(self.settings.export_dir, identity)
            specs.insert(0, MountSpec(host=export, sandbox=self.settings.export_mount, mode="rw"))
        mounts = [resolve_mount(spec, protected=self._protected_paths(), identity=identity) for spec in specs]
        check_distinct(mounts)
        return mounts

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
            check_distinct([*self.base_mounts, *mounts])
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
        lock_fd, run_dir, workspace = self.open_dirs(options)
        session = Session(
            session_id=session_id,
            options=options,
            workspace=workspace,
            runtime_dir=run_dir,
            backend=self.backend,
            settings=self.settings,
            task_group=self._task_group,
            lock_fd=lock_fd,
            owner=owner,
        )
        self._sessions[session_id] = session
        try:
            await session.start_kernel()
        except BaseException:
            self._sessions.pop(session_id, None)
            await session.close()
            raise
        log.info("session %s… started", session_id[:6])
        return session

    def open_dirs(self, options: SessionOptions) -> tuple[int, Path, Workspace]:
        """A sandbox's host side: its locked runtime dir (sockets) and its workspace, both handed to
        the sandbox user. Raises SessionError; a dead server's leftovers are found by the lock."""
        short = secrets.token_hex(4)
        runtime_dir = self.settings.runtime_dir / short
        runtime_dir.mkdir(mode=self.backend.dir_mode)
        lock_fd = _hold_lock(runtime_dir / LOCK_NAME)
        run_dir = runtime_dir / "run"
        run_dir.mkdir(mode=0o700)
        give(run_dir, self.backend.host_owner)
        workspace_dir = self.settings.workspaces_dir / (f"named-{options.name}" if options.persistent else short)
        try:
            workspace = Workspace.create(
                workspace_dir, options.limits.disk_mb, self.settings.workspace_quota, persistent=options.persistent
            )
        except (OSError, WorkspaceError) as exc:
            _remove_session_dirs(run_dir)
            if not options.persistent:
                remove_workspace(workspace_dir)
            os.close(lock_fd)
            raise SessionError(f"could not open the session workspace: {exc}") from None
        give(workspace.path, self.backend.host_owner)
        return lock_fd, run_dir, workspace

    def close_dirs(self, lock_fd: int, run_dir: Path, workspace: Workspace) -> None:
        workspace.remove()
        _remove_session_dirs(run_dir)
        with contextlib.suppress(OSError):
            os.close(lock_fd)

    async def resolve(self, session_id: str | None, owner: str = LOCAL_CALLER) -> Session:
        """The named session, or `owner`'s default one (created on first use).

        A session id is an unguessable handle: whoever holds it may use it, whichever client
        made it. Only the default session and the listing are per client.
        """
        if session_id:
            session = self._sessions.get(session_id)
            if session is None:
                raise SessionError(
                    f"unknown or expired session_id {session_id!r}: call list_sessions to see open sessions, "
                    "create_session for a new one, or omit session_id to use the default session"
                )
            return session
        async with self._default_lock:
            default_id = self._default_ids.get(owner)
            if default_id is None or default_id not in self._sessions:
                default_id = (await self.create(owner=owner)).session_id
                self._default_ids[owner] = default_id
            return self._sessions[default_id]

    async def close(self, session_id: str) -> None:
        session = await self.resolve(session_id)
        self._sessions.pop(session_id, None)
        if self._default_ids.get(session.owner) == session_id:
            del self._default_ids[session.owner]
        await session.close()

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
                tg.start_soon(session.close)

    def list(self, owner: str | None = None) -> list[Session]:
        """Every open session, or those `owner` created."""
        return [s for s in self._sessions.values() if owner is None or s.owner == owner]

    def is_default(self, session: Session) -> bool:
        return self._default_ids.get(session.owner) == session.session_id


def give(path: Path, owner: tuple[int, int] | None) -> None:
    """Hand a session path to the sandbox's host user (when the server runs as root)."""
    if owner is not None:
        os.chown(path, *owner)


def _hold_lock(path: Path) -> int:
    """An flock held for the session's life marks its dirs as in use by a live server."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def remove_stale_sessions(runtime_base: Path, workspaces_base: Path, backend: SandboxBackend) -> int:
    """Remove session dirs whose lock no live server holds (the server was SIGKILLed)."""
    removed = 0
    for entry in runtime_base.iterdir():
        lock = entry / LOCK_NAME
        if entry.is_symlink() or not entry.is_dir() or not lock.exists():
            continue
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live server owns it
        finally:
            os.close(fd)
        backend.remove_stale(entry.name)
        remove_workspace(workspaces_base / entry.name)  # named (persistent) workspaces have other names
        _remove_session_dirs(entry)
        removed += 1
    return removed


def _remove_session_dirs(runtime_dir: Path) -> None:
    top = runtime_dir.parent if runtime_dir.name == "run" else runtime_dir
    shutil.rmtree(top, ignore_errors=True)


def _memory_used_mb(kernel: Kernel) -> float | None:
    """The sandbox's cgroup usage where there is one, else the resident memory of its process tree."""
    if kernel.process is None:
        return None
    return kernel.process.memory_used_mb() or _tree_rss_mb(kernel.process.pid)


def _dir_size_mb(path: Path) -> float | None:
    """Bytes under `path` (no link following); bounded by the entries a workspace can hold."""
    total = 0
    try:
        for root, _dirs, files in os.walk(path):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_size
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
