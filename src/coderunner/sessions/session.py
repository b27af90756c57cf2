"""A Session: a workspace plus a sandboxed kernel that may be replaced while the session lives on.

The kernel is replaced on a timeout it ignores, on its death, and on reset; the workspace, its
mounts and its export outbox stay. The replacement is the session's standby kernel when one is
ready (standby.py), else one started cold. One call at a time holds the kernel (`exclusive`); every
call that needs a kernel gets it from `ensure_kernel`, and a cancelled call leaves none wedged.
What a call does with the kernel it holds (cells, guest calls) is its KernelCalls' (kernel_calls.py),
which it holds and which reaches it only through those steps; the status a session reports is
session_status.py's; its snapshot bookkeeping is kept_state.py's.

One idea: a session's kernel lifecycle against one workspace (ensure, hold, replace, reset, close); cells and
guest calls on a held kernel are kernel_calls.py's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from coderunner.config import Settings
from coderunner.edge.callers import LOCAL_CALLER
from coderunner.errors import SessionBusy, SessionError
from coderunner.hostfs.sandbox_files import SandboxFiles
from coderunner.hostfs.sandbox_mounts import SandboxMounts
from coderunner.hostfs.session_dirs import SandboxDirs
from coderunner.hostfs.workspaces import Workspace
from coderunner.kernel.client import ProgressCallback
from coderunner.kernel.incarnation import Kernel
from coderunner.kernel.kernel_factory import KernelFactory
from coderunner.kernel.output_capture import WorkspaceWriter
from coderunner.kernel.process import CheckpointFailed
from coderunner.kernel.run_result import ExecutionResult
from coderunner.offload import off_loop
from coderunner.sandbox import Mount, SandboxBackend, SandboxSpec
from coderunner.sessions.egress_wiring import SessionEgress
from coderunner.sessions.job_runner import Job, JobTable, attend, cancel, duration
from coderunner.sessions.job_updates import JobUpdate, job_update, unknown_job
from coderunner.sessions.kept_state import KeptState
from coderunner.sessions.kernel_calls import GUEST_MARGIN_S, KernelCalls
from coderunner.sessions.leases import SandboxLease
from coderunner.sessions.sandbox_options import SandboxOptions
from coderunner.sessions.session_status import SessionStatus, session_status
from coderunner.sessions.standby import Standby, StandbyBudget
from coderunner.sessions.usage import session_usage
from coderunner.sessions.warm_take import StartedFrom

__all__ = ["GUEST_MARGIN_S", "Session"]  # GUEST_MARGIN_S: session_snapshots.py reads it here

log = logging.getLogger(__name__)

#: Bound on waiting for a running call to notice its session is being closed.
CLOSE_WAIT_S = 5.0
#: Bound on a kernel start that closing cancelled to let go: its sandbox killed and reaped (base.KILL_WAIT_S)
#: and its cgroup removed (cgroups.REMOVE_WAIT_S), before the dirs it works in by fd are closed.
START_CANCEL_WAIT_S = 15.0
#: A call running this long leaves room for the standby kernel's start beside it (standby.py).
STANDBY_BESIDE_CALL_S = 1.0
#: The standby's preload (preload_imports: a second or so of CPU) waits until the session has rested this
#: long after a call (an agent's think time; resets 1.5 s apart then find their standby as fast as without
#: the preload), or a call has run this long (a long job should not leave the next reset unpreloaded).
STANDBY_PRELOAD_REST_S = 3.0
STANDBY_PRELOAD_BESIDE_CALL_S = 10.0


@dataclass
class _Start:
    """A kernel start under way: closing cancels it, and waits for it to end its sandbox, before closing
    the dirs the start works in by fd (closed under it, they made its reply an EBADF)."""

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ended: anyio.Event = field(default_factory=anyio.Event)


@dataclass
class Session:
    session_id: str
    options: SandboxOptions
    #: Its sandbox's host side (leases.py): dirs, workspace and uid, mounts and outbox, egress proxy.
    lease: SandboxLease
    backend: SandboxBackend
    settings: Settings
    task_group: TaskGroup
    #: The caller that created it (see callers.py): whose listing and default session it is in; its
    #: token's client is the only one that may use it.
    owner: str = LOCAL_CALLER
    kernel: Kernel | None = None
    #: Makes each kernel incarnation (the real Kernel; tests pass a scripted one).
    kernel_factory: KernelFactory = Kernel
    created_at: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    restarts: int = 0
    busy: bool = False
    closed: bool = False
    #: Set while a kernel reset stops a running call, so that call's reply says why it ended.
    _resetting: bool = False
    _generation: int = 0
    #: The number the next kernel made gets (its sockets' and files' names): kernels are numbered in the
    #: order they are made, standbys included; `_generation` counts those that became the session's.
    _next_kernel: int = 0
    #: When the call holding the kernel began (while `busy`).
    _busy_since: float = 0.0
    _lock: anyio.Lock = field(default_factory=anyio.Lock)
    #: What the last copy-out to the export folder did, for the reply.
    export_note: str | None = None
    #: A reopened workspace's start-up files and packages (startup_hooks.py), for create_session's reply.
    startup: dict[str, Any] | None = None
    #: Its cells, each run as a job in the task group (sessions/job_runner.py); set up after construction.
    jobs: JobTable = field(init=False)
    #: The kernel generation the last reply told the caller about (None: none yet), for state_preserved.
    _reported_generation: int | None = None
    #: Where it came from, and keep_state's bookkeeping (kept_state.py).
    kept: KeptState = field(default_factory=KeptState)
    #: The kernel start under way, if any (see _Start).
    _start: _Start | None = None
    #: Set once the manager began closing it; done when closed (a session is closed and released once).
    close_done: anyio.Event | None = None
    #: Its standby kernel, started ahead for the next reset or restart (standby.py); set up after construction.
    standby: Standby = field(init=False)
    #: The server's budget for every session's standby (the manager's; None: not counted).
    standby_budget: StandbyBudget | None = None
    #: Its cells and guest calls, run on the kernel it holds (kernel_calls.py); set up after construction.
    calls: KernelCalls = field(init=False)
    #: Whether its sandbox was taken warm from the pool or started cold, and why (warm_take.py).
    started: StartedFrom | None = None

    def __post_init__(self) -> None:
        self.jobs = JobTable(self.task_group)
        self.calls = KernelCalls(self, self.settings, self.jobs, self.backend.workspace_path)
        self.standby = Standby(
            settings=self.settings,
            task_group=self.task_group,
            make=self._new_kernel,
            quiet=lambda: not self.busy or time.monotonic() - self._busy_since >= STANDBY_BESIDE_CALL_S,
            enabled=self.settings.reset_standby and self.backend.private_files,
            budget=self.standby_budget,
            settled=self._settled,
            starter_ready=self._starter_ready,
        )

    async def _starter_ready(self) -> None:
        starter = self.backend.kernel_starter
        if starter is not None:
            await starter.settled()

    def _settled(self) -> bool:
        """Rested STANDBY_PRELOAD_REST_S since its last call, or in one for STANDBY_PRELOAD_BESIDE_CALL_S."""
        if self.busy:
            return time.monotonic() - self._busy_since >= STANDBY_PRELOAD_BESIDE_CALL_S
        return time.monotonic() - self.last_used >= STANDBY_PRELOAD_REST_S

    @property
    def seeded(self) -> Any:
        """The snapshots.Seed it started from (restore, fork, keep_state), with what the load reported."""
        return self.kept.seeded

    @property
    def restored_from(self) -> str | None:
        return self.kept.restored_from

    @property
    def close_note(self) -> str | None:
        return self.kept.close_note

    @property
    def generation(self) -> int:
        """How many kernels this session has had (a standby counts once swapped in): each (re)start, loss or reset
        makes a new one."""
        return self._generation

    @property
    def resetting(self) -> bool:
        """A kernel reset is stopping the running call (that call's reply says why it ended)."""
        return self._resetting

    @property
    def kernel_reported(self) -> bool:
        return self._reported_generation is not None

    def kernel_state(self, lost: bool = False) -> tuple[int, bool]:
        """(generation, state_preserved) for a reply: preserved if nothing was `lost` and the kernel is
        the one the previous reply named. Every reply that reports it moves the mark."""
        previous = self._reported_generation
        preserved = not lost and previous in (None, self._generation)
        self._reported_generation = self._generation
        return self._generation, preserved

    @property
    def dirs(self) -> SandboxDirs:
        return self.lease.dirs

    @property
    def sandbox_mounts(self) -> SandboxMounts | None:
        """Its mounts as the sandbox gets them (staged on a root server) and its export outbox."""
        return self.lease.mounts

    @property
    def egress(self) -> SessionEgress | None:
        """Network 'allowlist': the session's own policy proxy and its decisions (None otherwise)."""
        return self.lease.egress

    @property
    def mounts(self) -> tuple[Mount, ...]:
        return self.sandbox_mounts.mounts if self.sandbox_mounts is not None else self.options.mounts

    async def copy_out(self) -> None:
        """Copy new files in the outbox to the client's export folder (a worker thread: it is file I/O).

        An empty outbox (one directory read on the loop) needs no thread: most calls export nothing,
        and the hop was a tenth of a warm call's server time."""
        plan = self.sandbox_mounts
        if plan is None or plan.nothing_to_export():
            return
        try:
            with anyio.CancelScope(shield=True):
                report = await off_loop(plan.export)
        except OSError as exc:
            self.export_note = f"copying to the export folder failed: {exc}"
            return
        self.export_note = plan.note(report)

    @property
    def workspace(self) -> Workspace:
        return self.dirs.workspace

    @property
    def sandbox_uid(self) -> int | None:
        """The host uid its sandbox runs as, when it has one of its own (a root server)."""
        return self.dirs.user.uid if self.dirs.user is not None else None

    def reply_writer(self) -> WorkspaceWriter:
        """Where output too big for a reply spills: the workspace, owned by the sandbox's user."""
        return WorkspaceWriter(self.workspace.path, self.backend.workspace_path, self.dirs.owner)

    def note_restored_from(self, text: str) -> None:
        self.kept.restored_from = text

    # --- its jobs, as the tools ask about them: by id, each answer a JobUpdate (job_updates.py) -------

    async def start_run(
        self, code: str, timeout_s: float | None, variables: dict[str, Any] | None = None, wait_s: float = 0.0,
        *, owner: str = "",
    ) -> JobUpdate:  # fmt: skip
        """Start `code` as this session's job (after setting `variables` as globals) and wait up to `wait_s` for
        its end: one that ended comes whole and is forgotten. A caller cancelled meanwhile cancels the cell."""
        job = await self.calls.start_run(code, timeout_s, variables, owner)
        return await self._attended(job, wait_s)

    async def wait_job(self, job_id: str, wait_s: float) -> JobUpdate:
        """The run's own wait for its job's end, as start_run's (the caller cancelled cancels the cell)."""
        job = self.jobs.get(job_id)
        return unknown_job(job_id) if job is None else await self._attended(job, wait_s)

    async def _attended(self, job: Job, wait_s: float) -> JobUpdate:
        await attend(job, wait_s, cancel_wait_s=self.calls.cancel_wait_s)
        update = job_update(job, self.generation, self.calls.job_result)
        if not job.running:
            self.jobs.forget(job)
        return update

    async def read_job(self, job_id: str, wait_s: float = 0.0, take: bool = True) -> JobUpdate:
        """Up to `wait_s` for the job's end, then where it stands and (`take`) what is new in it since the last
        read. A read makes the job detached: a cancelled reader leaves it running, and a second run is told at
        once that the session is busy with it."""
        job = self.jobs.get(job_id)
        if job is None:
            return unknown_job(job_id)
        job.detached = True  # read by another than its run's own wait: its run answered with its id
        if job.running and wait_s > 0:
            with anyio.move_on_after(wait_s):
                await job.done.wait()
        return job_update(job, self.generation, self.calls.job_result, read=take)

    async def cancel_job(self, job_id: str) -> None:
        """Interrupt one of its jobs; a kernel that ignores that is restarted (within KernelCalls.cancel_wait_s)."""
        job = self.jobs.get(job_id)
        if job is not None:
            await cancel(job, self.calls.cancel_wait_s)

    async def list_jobs(self) -> list[dict[str, Any]]:
        return [job.describe() for job in self.jobs.jobs.values()]

    def holds_job(self, job_id: str) -> bool:
        return job_id in self.jobs.jobs

    # --- cells and guest calls: its KernelCalls' ------------------------------------------------

    async def run(
        self, code: str, timeout_s: float | None, progress: ProgressCallback | None,
        variables: dict[str, Any] | None = None,
    ) -> ExecutionResult:  # fmt: skip
        """Run `code` to its end (no detaching): its result. A cancelled caller interrupts the cell."""
        return await self.calls.run(code, timeout_s, progress, variables)

    async def call_guest(self, tool: str, arguments: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Run a guest tool inside this session's kernel; its answer, or GuestCallError with the reason."""
        return await self.calls.call_guest(tool, arguments, timeout_s)

    def held(self, wait_s: float) -> contextlib.AbstractAsyncContextManager[None]:
        """The live kernel to oneself with no cell running (a snapshot)."""
        return self.calls.held(wait_s)

    async def call_guest_held(self, tool: str, arguments: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """call_guest for a caller inside `held`."""
        return await self.calls.call_guest_held(tool, arguments, timeout_s)

    async def guest_op(
        self, tool: str, op: str, args: dict[str, Any], timeout_s: float, *,
        paths: Iterable[str] = (), input_path: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """One op of a guest tool (pdf_ops, image_ops, browser), its sandbox paths confined first."""
        return await self.calls.guest_op(tool, op, args, timeout_s, paths=paths, input_path=input_path)

    async def install_packages(self, packages: list[str], timeout_s: float) -> dict[str, Any]:
        """pip into this session's own package folder (in its workspace), from inside its sandbox."""
        return await self.calls.install_packages(packages, timeout_s)

    @property
    def spec(self) -> SandboxSpec:
        """What the backend needs to start this session's next kernel."""
        return self.lease.spec(self.options)

    @property
    def files(self) -> SandboxFiles:
        """The session's files as the host may touch them: workspace and mounts, symlink-safe."""
        workspace = Mount(self.workspace.path, self.backend.workspace_path, writable=True)
        plan = self.sandbox_mounts
        if plan is None:
            return SandboxFiles([workspace, *self.options.mounts], owner=self.dirs.owner)
        return SandboxFiles([workspace, *plan.host_view], owner=self.dirs.owner, owners=plan.owners)

    def _new_kernel(self) -> Kernel:
        """A kernel not yet started, numbered after every other, in a sandbox under a name no other kernel
        of this session holds (the live one and a standby each have one of the session's two)."""
        spec = self.spec
        taken = {kernel.spec.name for kernel in (self.kernel, *self.standby.kernels()) if kernel is not None}
        if spec.name in taken:
            spec = spec.twin()
        kernel = self.kernel_factory(self.backend, spec, self.task_group, self.dirs, generation=self._next_kernel)
        self._next_kernel += 1
        return kernel

    def keep_standby(self) -> None:
        """Have a standby kernel started ahead, at a quiet moment (if the setting and the backend allow)."""
        self.standby.want()

    async def start_kernel(self) -> None:
        """Start this session's first kernel (create_session); later ones come from ensure_kernel."""
        kernel = self._new_kernel()
        self._generation += 1
        await self._cancellable_start(kernel, lambda: kernel.start(self.settings.startup_timeout_s))
        self.kernel = kernel

    async def restore_kernel(self, image_dir: Path, connection: dict[str, Any]) -> None:
        """Start this session's first kernel as a copy of a checkpointed one (a memory snapshot)."""
        generation = int(connection["generation"])
        kernel = self.kernel_factory(self.backend, self.spec, self.task_group, self.dirs, generation=generation)
        self._generation = self._next_kernel = generation + 1
        try:
            await self._cancellable_start(
                kernel, lambda: kernel.restore(image_dir, connection, self.settings.snapshot_timeout_s)
            )
        except CheckpointFailed as exc:
            raise SessionError(f"could not restore the snapshot's kernel: {exc}") from None
        self.kernel = kernel

    async def _cancellable_start(self, kernel: Kernel, start: Callable[[], Awaitable[None]]) -> None:
        """Run `start` (of `kernel`) so that close can stop it: a closed session's start ends its sandbox
        and raises SessionError; close waits for that before closing the dirs the start uses."""
        if self.closed:
            raise SessionError(f"session {self.session_id} was closed")
        starting = _Start()
        self._start = starting
        try:
            with starting.scope:
                await start()  # cancelled by close: the kernel ends its own sandbox (Kernel._attach)
            if self.closed:  # closed while it started (or just after)
                with anyio.CancelScope(shield=True):
                    await kernel.shutdown()
                raise SessionError(f"session {self.session_id} was closed")
        finally:
            self._start = None
            starting.ended.set()

    async def replace_kernel(self) -> None:
        """Kill the current kernel (if any) and put a fresh one in its place, the standby if one is ready,
        else one started cold; workspace files are kept. Then a new standby is wanted."""
        with anyio.CancelScope(shield=True):
            if self.kernel is not None:
                await self.kernel.shutdown()
                self.kernel = None
            if self.closed:
                raise SessionError(f"session {self.session_id} was closed")
            self.restarts += 1
            fresh = await self.standby.take()
            if fresh is not None:
                self._generation += 1
                self.kernel = fresh
                if self.closed:  # closed during its swap-in: close shuts it down once this call lets go
                    raise SessionError(f"session {self.session_id} was closed")
            else:
                # None ready: a start under way would only share the CPU with this one (and take a name).
                if not await self.standby.stop():
                    raise SessionError(f"session {self.session_id}: its standby kernel's start would not stop")
                await self.start_kernel()
            self.standby.want()

    async def ensure_kernel(self) -> Kernel:
        """The live kernel, started afresh first if there is none or it died (caller holds the lock)."""
        if self.kernel is None or not self.kernel.alive:
            await self.replace_kernel()
        assert self.kernel is not None
        return self.kernel

    def held_kernel(self) -> Kernel:
        """The kernel a caller holding the lock got from ensure_kernel (or its replacement)."""
        assert self.kernel is not None
        return self.kernel

    async def recover_from_cancel(self) -> None:
        """A call was cancelled mid-run: a kernel left wedged or dead is replaced before the lock goes."""
        if self.kernel is not None and (self.kernel.wedged or not self.kernel.alive):
            await self.replace_kernel()

    @contextlib.asynccontextmanager
    async def exclusive(self, wait_s: float) -> AsyncIterator[None]:
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
            self._busy_since = time.monotonic()
            self.export_note = None
            try:
                yield
            finally:
                await self.copy_out()
        finally:
            self.busy = False
            self.last_used = time.monotonic()
            self._lock.release()

    async def job_turn(self, wait_s: float) -> None:
        """Return once no cell runs; refuse at once while one runs detached (waiting behind a job could
        take hours), and after `wait_s` behind one whose call still waits for it (it ends or detaches).

        No await follows a return before the caller registers its own job: two callers cannot both pass.
        """
        with anyio.move_on_after(wait_s):
            while (job := self.jobs.running()) is not None and not job.detached:
                with anyio.move_on_after(0.1):  # polled: the job may detach rather than end
                    await job.done.wait()
        job = self.jobs.running()
        if job is None:
            return
        if job.detached:
            raise SessionBusy(
                f"session {self.session_id} is busy with job {job.job_id} (running {duration(job.elapsed_s())}): "
                "manage_jobs (wait or cancel), or use another session"
            )
        raise SessionBusy(
            f"session {self.session_id} is busy with another call; try again when it finishes (or use another session)"
        )

    async def reset(self) -> None:
        """Fresh interpreter state, even while a call runs: interrupt it, and kill it if it ignores that."""
        if not self._lock.locked():
            async with self.exclusive(wait_s=self.settings.interrupt_grace_s):
                await self.replace_kernel()
            return
        self._resetting = True
        try:
            if self.kernel is not None:
                self.kernel.interrupt()
            try:
                async with self.exclusive(wait_s=self.settings.interrupt_grace_s):
                    await self.replace_kernel()
                return
            except SessionBusy:
                if self.kernel is not None and self.kernel.process is not None:
                    await self.kernel.process.kill()
            async with self.exclusive(wait_s=self.settings.startup_timeout_s):
                await self.replace_kernel()
        finally:
            self._resetting = False

    async def close(self) -> None:
        self.closed = True
        with anyio.CancelScope(shield=True):
            if not await self.standby.close():
                log.warning("session %s…: its standby's start would not stop; its dirs are left", self.session_id[:6])
                return
            starting = self._start
            if starting is not None:
                # A kernel is starting (create_session, a reset, a restart): stop it and let it end
                # its sandbox first. Its dirs are never closed under it: rather left, if it never lets go.
                starting.scope.cancel()
                with anyio.move_on_after(START_CANCEL_WAIT_S):
                    await starting.ended.wait()
                if not starting.ended.is_set():
                    log.warning("session %s…: its kernel start would not stop; its dirs are left", self.session_id[:6])
                    return
            if self._lock.locked():
                # A call is running: kill the sandbox so that call sees the death and returns,
                # then take the kernel down once it has let go.
                if self.kernel is not None and self.kernel.process is not None:
                    await self.kernel.process.kill()
                with anyio.move_on_after(CLOSE_WAIT_S):
                    async with self._lock:
                        pass
            self.jobs.cancel_all("the session was closed")  # one still waiting for the kernel, if any
            if self.kernel is not None:
                await self.kernel.shutdown()
                self.kernel = None
            await self.copy_out()
            if not await self.lease.release():  # egress proxy, mounts, dirs
                log.warning("session %s…: a staged mount would not detach; its dirs are left", self.session_id[:6])

    def usage(self) -> dict[str, float | None]:
        """What the session uses, in the units of its limits."""
        return session_usage(self.kernel, self.workspace)

    async def status(self) -> SessionStatus:
        """Where it stands now (its cgroup, /proc and workspace read in a worker thread)."""
        return await off_loop(session_status, self)
