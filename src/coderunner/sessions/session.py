"""A Session: a workspace plus a sandboxed kernel that may be replaced while the session lives on.

The kernel is replaced on a timeout it ignores, on its death, and on reset; the workspace, its
mounts and its export outbox stay. One call at a time holds the kernel (`_exclusive`); every
call that needs a kernel gets it from `_ensure_kernel`, and a cancelled call leaves none wedged.
"""

from __future__ import annotations

import contextlib
import json
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
from coderunner.egress.ceiling import install_way_out
from coderunner.egress.gateway import SessionEgress
from coderunner.errors import GuestCallError, SessionBusy, SessionError
from coderunner.hostfs.leases import SandboxLease
from coderunner.hostfs.sandbox_files import SandboxFiles
from coderunner.hostfs.sandbox_mounts import SandboxMounts
from coderunner.hostfs.session_dirs import SandboxDirs
from coderunner.hostfs.workspaces import Workspace
from coderunner.kernel.incarnation import CheckpointFailed, Kernel, ProgressCallback, RunOutcome, RunStatus
from coderunner.kernel.output_capture import OutputCollector, WorkspaceWriter
from coderunner.kernel.run_result import ExecutionResult
from coderunner.kernel.seam import KernelFactory
from coderunner.offload import off_loop
from coderunner.policy.sandbox_options import SandboxOptions
from coderunner.sandbox import SESSION_PACKAGES, LimitReport, Mount, SandboxBackend, SandboxSpec
from coderunner.sessions.job_runner import Job, JobOutput, JobStatus, JobTable, attend, cancel, duration, label_of
from coderunner.sessions.usage import session_usage

log = logging.getLogger(__name__)

#: Bound on waiting for a running call to notice its session is being closed.
CLOSE_WAIT_S = 5.0
#: Bound on a kernel start that closing cancelled to let go: its sandbox killed and reaped (base.KILL_WAIT_S)
#: and its cgroup removed (cgroups.REMOVE_WAIT_S), before the dirs it works in by fd are closed.
START_CANCEL_WAIT_S = 15.0
#: Bound on a quick guest call (setting variables), and the margin added to a slow one's own bound.
GUEST_MARGIN_S = 15.0


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
    kernel_generation: int = 0
    #: The running job, if any (its id, kind, elapsed time, first line of code).
    job: dict[str, Any] | None = None
    #: The snapshot it was restored or forked from; keep_state: its state is saved at close.
    restored_from: str | None = None
    keep_state: bool = False
    #: keep_state: when the state was last saved, or why not.
    state_note: str | None = None


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
    #: Set while kernel_reset stops a running call, so that call's reply says why it ended.
    _resetting: bool = False
    _generation: int = 0
    _lock: anyio.Lock = field(default_factory=anyio.Lock)
    #: What the last copy-out to the export folder did, for the reply.
    export_note: str | None = None
    #: A reopened workspace's start-up files and packages (startup_hooks.py), for create_session's reply.
    startup: dict[str, Any] | None = None
    #: Its cells, each run as a job in the task group (sessions/jobs.py); set up after construction.
    jobs: JobTable = field(init=False)
    #: The kernel generation the last reply told the caller about (None: none yet), for state_preserved.
    _reported_generation: int | None = None
    #: keep_state: the kernel holds the session's state (loaded, or nothing was saved), so closing may
    #: save it; False until then, so a failed load never overwrites the saved state with an empty one.
    state_armed: bool = False
    #: The snapshot this session was restored or forked from, if any.
    restored_from: str | None = None
    #: The snapshots.Seed it started from (restore, fork, keep_state), with what the load reported.
    seeded: Any = None
    #: What closing did beyond stopping it (keep_state: whether the state was saved), for the reply.
    close_note: str | None = None
    #: keep_state: `last_used` when the state was last saved or loaded (None: never), and what that did.
    _state_mark: float | None = None
    state_note: str | None = None
    #: The kernel start under way, if any (see _Start).
    _start: _Start | None = None
    #: Set once the manager began closing it; done when closed (a session is closed and released once).
    close_done: anyio.Event | None = None

    def __post_init__(self) -> None:
        self.jobs = JobTable(self.task_group)

    @property
    def state_dirty(self) -> bool:
        """keep_state: the kernel has run something since its state was last saved or loaded."""
        return self._state_mark is None or self.last_used != self._state_mark

    def mark_state_saved(self, note: str | None = None) -> None:
        """The kernel's state as of now is saved (or loaded, or was just tried): not dirty until it runs again."""
        self._state_mark = self.last_used
        if note is not None:
            self.state_note = note

    @property
    def generation(self) -> int:
        """How many kernels this session has started: each (re)start, loss or reset makes a new one."""
        return self._generation

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
        """Copy new files in the outbox to the client's export folder (a worker thread: it is file I/O)."""
        plan = self.sandbox_mounts
        if plan is None or plan.exporter is None:
            return
        try:
            with anyio.CancelScope(shield=True):
                report = await off_loop(plan.export)
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
    def sandbox_uid(self) -> int | None:
        """The host uid its sandbox runs as, when it has one of its own (a root server)."""
        return self.dirs.user.uid if self.dirs.user is not None else None

    def reply_writer(self) -> WorkspaceWriter:
        """Where output too big for a reply spills: the workspace, owned by the sandbox's user."""
        return WorkspaceWriter(self.workspace.path, self.backend.workspace_path, self.dirs.owner)

    def note_restored_from(self, text: str) -> None:
        self.restored_from = text

    def job(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def list_jobs(self) -> list[Job]:
        return list(self.jobs.jobs.values())

    def forget_job(self, job: Job) -> None:
        self.jobs.forget(job)

    async def cancel_job(self, job: Job) -> None:
        """Interrupt one of its jobs; a kernel that ignores that is restarted (within _cancel_wait_s)."""
        await cancel(job, self._cancel_wait_s)

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

    async def start_kernel(self) -> None:
        """Start this session's first kernel (create_session); later ones come from _ensure_kernel."""
        kernel = self.kernel_factory(self.backend, self.spec, self.task_group, self.dirs, generation=self._generation)
        self._generation += 1
        await self._cancellable_start(kernel, lambda: kernel.start(self.settings.startup_timeout_s))
        self.kernel = kernel

    async def restore_kernel(self, image_dir: Path, connection: dict[str, Any]) -> None:
        """Start this session's first kernel as a copy of a checkpointed one (a memory snapshot)."""
        generation = int(connection["generation"])
        kernel = self.kernel_factory(self.backend, self.spec, self.task_group, self.dirs, generation=generation)
        self._generation = generation + 1
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

    async def _ensure_kernel(self) -> Kernel:
        """The live kernel, started afresh first if there is none or it died (caller holds the lock)."""
        if self.kernel is None or not self.kernel.alive:
            await self._replace_kernel()
        assert self.kernel is not None
        return self.kernel

    def _held_kernel(self) -> Kernel:
        """The kernel a caller holding the lock got from _ensure_kernel (or its replacement)."""
        assert self.kernel is not None
        return self.kernel

    async def _recover_from_cancel(self) -> None:
        """A call was cancelled mid-run: a kernel left wedged or dead is replaced before the lock goes."""
        if self.kernel is not None and (self.kernel.wedged or not self.kernel.alive):
            await self._replace_kernel()

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

    async def _job_turn(self, wait_s: float) -> None:
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
                "wait_job, cancel_job, or use another session"
            )
        raise SessionBusy(
            f"session {self.session_id} is busy with another call; try again when it finishes (or use another session)"
        )

    async def start_run(
        self, code: str, timeout_s: float | None, variables: dict[str, Any] | None = None, owner: str = ""
    ) -> Job:
        """Start `code` as this session's job (after setting `variables` as globals); the caller attends it."""
        timeout = min(timeout_s or self.options.timeout_s, self.settings.max_timeout_s)
        await self._job_turn(timeout)
        if self.closed:
            raise SessionError(f"session {self.session_id} was closed")
        self.last_used = time.monotonic()  # not idle while its job waits to be scheduled
        output = JobOutput(
            limit_chars=self.settings.output_limit_chars,
            spill_limit_bytes=self.settings.spill_limit_bytes,
            image_limit_bytes=self.settings.image_limit_bytes,
            writer=self.reply_writer(),
            defer_files=True,  # kernel.execute drains its file writes off the event loop
        )
        job = Job(
            job_id=self.jobs.new_id(), kind="python", label=label_of(code), owner=owner or self.owner,
            session_id=self.session_id, output=output,
        )  # fmt: skip

        async def work(job: Job) -> ExecutionResult:
            return await self._run_job(job, code, timeout, variables, output)

        return self.jobs.start(job, work, _python_status)

    async def run(
        self,
        code: str,
        timeout_s: float | None,
        progress: ProgressCallback | None,
        variables: dict[str, Any] | None = None,
    ) -> ExecutionResult:
        """Run `code` to its end (no detaching): its result. A cancelled caller interrupts the cell."""
        job = await self.start_run(code, timeout_s, variables)

        async def tick(job: Job) -> None:
            if progress is not None and job.output is not None and job.executing_since is not None:
                await progress(job.elapsed_s(), job.output)

        try:
            await attend(job, None, tick, self.settings.progress_interval_s, self._cancel_wait_s)
        finally:
            self.jobs.forget(job)
        return self.job_result(job)

    @property
    def _cancel_wait_s(self) -> float:
        """Bound on a cancelled cell's end: its interrupt grace, then perhaps a fresh kernel's start."""
        return self.settings.interrupt_grace_s + self.settings.startup_timeout_s + 5.0

    def job_result(self, job: Job) -> ExecutionResult:
        """A finished python job's result; one ended without one (cancelled) gets one from its output.

        Raises the refusal of a job that never ran (the session closed, or busy behind another call).
        """
        if isinstance(job.result, ExecutionResult):
            return job.result
        if job.failure is not None:
            raise job.failure
        assert job.output is not None
        outcome = RunOutcome(status=RunStatus.INTERRUPTED, output=job.output, duration_s=job.elapsed_s())
        return ExecutionResult(outcome, notice=job.notice, state_lost=job.state_lost)

    async def _run_job(
        self, job: Job, code: str, timeout: float, variables: dict[str, Any] | None, output: OutputCollector
    ) -> ExecutionResult:
        async with self._exclusive(wait_s=timeout):
            kernel = await self._ensure_kernel()
            job.generation = self._generation
            if variables:
                await self._guest_call_held("variables", {"values": variables}, GUEST_MARGIN_S)
                kernel = self._held_kernel()  # the same one, or its replacement if that call ended it
            job.executing_since = time.monotonic()
            try:
                outcome = await kernel.execute(
                    code,
                    output,
                    timeout_s=timeout,
                    interrupt_grace_s=self.settings.interrupt_grace_s,
                )
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):
                    await self._recover_from_cancel()
                job.state_lost = self._generation != job.generation
                if job.state_lost:
                    job.notice = (
                        f"cancelled: the cell ignored the interrupt for {self.settings.interrupt_grace_s:g}s: "
                        "kernel restarted; state lost (variables and imports), workspace files kept"
                    )
                else:
                    job.notice = "cancelled: interrupted; the kernel and its state are kept"
                raise
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

        Waits for a busy kernel within `timeout_s`, then answers busy (at once while a job runs);
        never leaves a name behind in the user's namespace or history.
        """
        await self._job_turn(timeout_s)
        async with self._exclusive(wait_s=timeout_s):
            await self._ensure_kernel()
            return await self._guest_call_held(tool, arguments, timeout_s)

    @contextlib.asynccontextmanager
    async def held(self, wait_s: float) -> AsyncIterator[None]:
        """The live kernel to oneself with no cell running (a snapshot): waits like a guest call, and
        refuses at once while a job runs detached."""
        await self._job_turn(wait_s)
        async with self._exclusive(wait_s=wait_s):
            await self._ensure_kernel()
            yield

    async def call_guest_held(self, tool: str, arguments: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """call_guest for a caller inside `held`."""
        return await self._guest_call_held(tool, arguments, timeout_s)

    async def guest_op(
        self, tool: str, op: str, args: dict[str, Any], timeout_s: float, *,
        paths: Iterable[str] = (), input_path: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """One op of a guest tool (pdf_ops, image_ops, browser). The args named in `paths`, and
        `input_path`, are sandbox paths: confined to this session's files by the host before the call."""
        payload: dict[str, Any] = {"op": op}
        files = self.files
        args = await off_loop(files.confine, args, paths)  # walks the workspace: stats, readlinks
        if input_path is not None:
            payload["input_path"] = (await off_loop(files.resolve, input_path)).sandbox_path
        payload["args"] = args
        return await self.call_guest(tool, payload, timeout_s)

    async def _guest_call_held(self, tool: str, arguments: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """call_guest for a caller that already holds the kernel."""
        kernel = self._held_kernel()
        call = (
            f"await __import__('coderunner_guest.dispatch', fromlist=['call']).call({tool!r}, "
            f"{json.dumps(arguments)!r})"
        )
        output = OutputCollector(limit_chars=self.settings.output_limit_chars, spill_limit_bytes=0, image_limit_bytes=0)
        try:
            outcome = await kernel.execute(
                call, output, timeout_s=timeout_s, interrupt_grace_s=self.settings.interrupt_grace_s, silent=True
            )
        except anyio.get_cancelled_exc_class():
            await self._recover_from_cancel()
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
        if self.options.network == "none":
            raise SessionError(
                f"install_packages needs network, and session {self.session_id} has network 'none': "
                f"{install_way_out(self.settings.network_ceiling)}"
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
            starting = self._start
            if starting is not None:
                # A kernel is starting (create_session, kernel_reset, a restart): stop it and let it end
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

    def status(self) -> SessionStatus:
        kernel = self.kernel
        alive = kernel is not None and kernel.alive
        now = time.monotonic()
        usage = self.usage()  # one walk of /proc: memory_used_mb is its memory_mb
        return SessionStatus(
            session_id=self.session_id,
            name=self.options.name,
            persistent=self.options.persistent,
            alive=alive,
            busy=self.busy,
            uptime_s=now - self.created_at,
            kernel_uptime_s=(now - kernel.started_at) if kernel is not None and alive else 0.0,
            memory_used_mb=usage["memory_mb"],
            usage=usage,
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
            kernel_generation=self._generation,
            job=running.describe() if (running := self.jobs.running()) is not None else None,
            restored_from=self.restored_from,
            keep_state=self.options.keep_state,
            state_note=self.state_note,
        )


def _python_status(job: Job) -> JobStatus:
    """A cell's outcome as a job status: a cancel or timeout is 'interrupted', a kernel gone is 'lost'."""
    result: ExecutionResult = job.result
    status = result.outcome.status
    if status is RunStatus.OK:
        return JobStatus.DONE
    if status is RunStatus.DIED:
        return JobStatus.LOST
    if status in (RunStatus.INTERRUPTED, RunStatus.UNRESPONSIVE):
        return JobStatus.INTERRUPTED
    error = result.outcome.error
    return JobStatus.INTERRUPTED if error is not None and error.ename == "KeyboardInterrupt" else JobStatus.ERROR
