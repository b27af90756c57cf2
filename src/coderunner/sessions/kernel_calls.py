"""What a call does once it holds a session's kernel: run a cell as a job, or call a guest helper.

Session (session.py) owns the kernel's lifecycle: one kernel at a time, one call at a time, replaced
on death, timeout or reset, stopped once at close. KernelCalls is a collaborator each session holds:
it takes the session's lifecycle steps through the small `KernelKeeper` interface below, and owns
the cell and guest-call protocol, and what an outcome means.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

import anyio

from coderunner.config import Settings
from coderunner.errors import GuestCallError, SessionError
from coderunner.hostfs.sandbox_files import SandboxFiles
from coderunner.kernel.client import ProgressCallback, longest_grace_s
from coderunner.kernel.execution import RunOutcome, RunStatus
from coderunner.kernel.incarnation import Kernel
from coderunner.kernel.output_capture import OutputCollector, WorkspaceWriter
from coderunner.kernel.run_result import ExecutionResult
from coderunner.offload import off_loop
from coderunner.sandbox import SESSION_PACKAGES
from coderunner.sessions.job_runner import Job, JobOutput, JobStatus, JobTable, attend, label_of
from coderunner.sessions.sandbox_options import SandboxOptions
from coderunner.vocabulary.network import NetworkMode, offline_install

#: Bound on a quick guest call (setting variables), and the margin added to a slow one's own bound.
GUEST_MARGIN_S = 15.0


class KernelKeeper(Protocol):
    """What KernelCalls needs of the session that keeps the kernel (Session is one): who it is, its one
    kernel, and the steps that hold, start and replace that kernel."""

    #: When a call last used it (a job counts from when it is started): idle sessions are closed.
    last_used: float

    @property
    def session_id(self) -> str: ...

    @property
    def owner(self) -> str: ...

    @property
    def options(self) -> SandboxOptions: ...

    @property
    def closed(self) -> bool: ...

    @property
    def resetting(self) -> bool:
        """A kernel reset waits for the running call to end (and starts the fresh kernel itself)."""

    @property
    def generation(self) -> int: ...

    @property
    def kernel(self) -> Kernel | None: ...

    @property
    def files(self) -> SandboxFiles: ...

    def reply_writer(self) -> WorkspaceWriter: ...

    def exclusive(self, wait_s: float) -> contextlib.AbstractAsyncContextManager[None]:
        """The kernel to oneself (one call at a time), or SessionBusy after `wait_s`."""

    async def job_turn(self, wait_s: float) -> None:
        """Return once no cell runs (SessionBusy at once while one runs detached)."""

    async def ensure_kernel(self) -> Kernel:
        """The live kernel, started afresh if there is none or it died (the caller holds it)."""

    def held_kernel(self) -> Kernel:
        """The kernel a holder got from ensure_kernel, or its replacement."""

    async def replace_kernel(self) -> None:
        """A fresh kernel in the place of the current one (workspace files kept)."""

    async def recover_from_cancel(self) -> None:
        """Replace a kernel a cancelled call left wedged or dead."""


class KernelCalls:
    """Cells and guest calls on a session's kernel, through the session's `KernelKeeper` steps."""

    def __init__(self, keeper: KernelKeeper, settings: Settings, jobs: JobTable, workspace_path: str) -> None:
        self.keeper = keeper
        self.settings = settings
        self.jobs = jobs
        #: Where the workspace is inside the sandbox (the backend's), for pip's target.
        self.workspace_path = workspace_path

    async def start_run(
        self, code: str, timeout_s: float | None, variables: dict[str, Any] | None = None, owner: str = ""
    ) -> Job:
        """Start `code` as this session's job (after setting `variables` as globals); the caller attends it."""
        timeout = min(timeout_s or self.keeper.options.timeout_s, self.settings.max_timeout_s)
        await self.keeper.job_turn(timeout)
        if self.keeper.closed:
            raise SessionError(f"session {self.keeper.session_id} was closed")
        self.keeper.last_used = time.monotonic()  # not idle while its job waits to be scheduled
        output = JobOutput(
            limit_chars=self.settings.output_limit_chars,
            spill_limit_bytes=self.settings.spill_limit_bytes,
            image_limit_bytes=self.settings.image_limit_bytes,
            writer=self.keeper.reply_writer(),
            defer_files=True,  # kernel.execute drains its file writes off the event loop
        )
        job = Job(
            job_id=self.jobs.new_id(), kind="python", label=label_of(code), owner=owner or self.keeper.owner,
            session_id=self.keeper.session_id, output=output,
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
            await attend(job, None, tick, self.settings.progress_interval_s, self.cancel_wait_s)
        finally:
            self.jobs.forget(job)
        return self.job_result(job)

    @property
    def cancel_wait_s(self) -> float:
        """Bound on a cancelled cell's end: its interrupt grace, then perhaps a fresh kernel's start."""
        return longest_grace_s(self.settings.interrupt_grace_s) + self.settings.startup_timeout_s + 5.0

    def job_result(self, job: Job) -> ExecutionResult:
        return python_job_result(job)

    async def _run_job(
        self, job: Job, code: str, timeout: float, variables: dict[str, Any] | None, output: OutputCollector
    ) -> ExecutionResult:
        async with self.keeper.exclusive(wait_s=timeout):
            kernel = await self.keeper.ensure_kernel()
            job.generation = self.keeper.generation
            if variables:
                await self._guest_call_held("variables", {"values": variables}, GUEST_MARGIN_S)
                kernel = self.keeper.held_kernel()  # the same one, or its replacement if that call ended it
            job.executing_since = time.monotonic()
            if job.output is not None:
                job.output.note_change()  # a reader's progress starts from here
            try:
                outcome = await kernel.execute(
                    code,
                    output,
                    timeout_s=timeout,
                    interrupt_grace_s=self.settings.interrupt_grace_s,
                )
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):
                    await self.keeper.recover_from_cancel()
                job.state_lost = self.keeper.generation != job.generation
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
            await self.keeper.replace_kernel()
            return ExecutionResult(
                outcome,
                notice=(
                    f"timed out after {timeout:g}s and ignored the interrupt for "
                    f"{self.settings.interrupt_grace_s:g}s: kernel restarted; state lost "
                    "(variables and imports), workspace files kept"
                ),
                state_lost=True,
            )
        if self.keeper.closed:
            return ExecutionResult(outcome, notice="the session was closed during this call", state_lost=True)
        if self.keeper.resetting:
            # a kernel reset is waiting for this call to end; it starts the fresh kernel itself.
            return ExecutionResult(outcome, notice="stopped by a kernel reset: state lost", state_lost=True)
        if outcome.status is RunStatus.DIED:
            assert self.keeper.kernel is not None
            process = self.keeper.kernel.process
            if process is not None and process.oom_killed():
                cause = f"killed for exceeding its memory limit of {self.keeper.options.limits.memory_mb} MiB"
            else:
                cause = f"exit code {outcome.exit_code}; killed, crashed or out of memory"
            await self.keeper.replace_kernel()
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
        await self.keeper.job_turn(timeout_s)
        async with self.keeper.exclusive(wait_s=timeout_s):
            await self.keeper.ensure_kernel()
            return await self._guest_call_held(tool, arguments, timeout_s)

    @contextlib.asynccontextmanager
    async def held(self, wait_s: float) -> AsyncIterator[None]:
        """The live kernel to oneself with no cell running (a snapshot): waits like a guest call, and
        refuses at once while a job runs detached."""
        await self.keeper.job_turn(wait_s)
        async with self.keeper.exclusive(wait_s=wait_s):
            await self.keeper.ensure_kernel()
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
        files = self.keeper.files
        args = await off_loop(files.confine, args, paths)  # walks the workspace: stats, readlinks
        if input_path is not None:
            payload["input_path"] = (await off_loop(files.resolve, input_path)).sandbox_path
        payload["args"] = args
        return await self.call_guest(tool, payload, timeout_s)

    async def _guest_call_held(self, tool: str, arguments: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """call_guest for a caller that already holds the kernel."""
        kernel = self.keeper.held_kernel()
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
            await self.keeper.recover_from_cancel()
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
        if self.keeper.options.network == NetworkMode.NONE:
            raise SessionError(offline_install(self.settings.network_ceiling, f"session {self.keeper.session_id}"))
        target = f"{self.workspace_path}/{SESSION_PACKAGES}"
        arguments = {"packages": packages, "target": target, "timeout_s": timeout_s}
        return await self.call_guest("packages", arguments, timeout_s + GUEST_MARGIN_S)


def python_job_result(job: Job) -> ExecutionResult:
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
