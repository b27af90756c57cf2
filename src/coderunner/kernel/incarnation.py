"""One kernel incarnation: a sandboxed kernel process (process.py) and the client connected to it (client.py).

A `Kernel` is started once and dies once; restarts are the session's business. It is what a session
holds: the two halves together, and the steps that need both. A start (or restore) spawns the sandbox,
claims its sockets and connects the client, and ends the sandbox if any of that fails; a checkpoint
closes the client, saves the sandbox and connects again to the restored one.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from coderunner.errors import CodeRunnerError
from coderunner.hostfs.dirfd import HostFsError
from coderunner.hostfs.session_dirs import SandboxDirs
from coderunner.kernel.client import KernelClient, ProgressCallback
from coderunner.kernel.execution import CellError, RunOutcome, RunStatus
from coderunner.kernel.host_channels import Deadline
from coderunner.kernel.output_capture import OutputCollector
from coderunner.kernel.process import CheckpointFailed, KernelProcess, KernelStartError, SandboxExited
from coderunner.sandbox import SandboxBackend, SandboxProcess, SandboxSpec

__all__ = [
    "CellError",
    "CheckpointFailed",
    "Kernel",
    "KernelStartError",
    "ProgressCallback",
    "RunOutcome",
    "RunStatus",
]


@dataclass
class Kernel:
    backend: SandboxBackend
    spec: SandboxSpec
    task_group: TaskGroup
    dirs: SandboxDirs
    generation: int = 0
    #: When it started (or was restored, or swapped in as its session's kernel): its uptime.
    started_at: float = field(default_factory=time.monotonic)
    #: The process half: the sandbox, its connection info and the host's files for it.
    sandbox: KernelProcess = field(init=False)
    #: The client half: the host's channels to it, execute and interrupt.
    client: KernelClient = field(init=False)

    def __post_init__(self) -> None:
        self.sandbox = KernelProcess(self.backend, self.spec, self.task_group, self.dirs, self.generation)
        self.client = KernelClient(self.sandbox, self.task_group)

    @property
    def process(self) -> SandboxProcess | None:
        return self.sandbox.process

    @property
    def alive(self) -> bool:
        return self.sandbox.alive

    @property
    def wedged(self) -> bool:
        """A cancelled run ignored its interrupt, or a channel broke: the kernel is busy for good."""
        return self.client.wedged

    @property
    def started_how(self) -> str | None:
        """FROM_TEMPLATE, or "cold start: <why not from the template>" (kernel/process.py)."""
        return self.sandbox.started_how

    async def start(self, timeout_s: float) -> None:
        """Start the sandbox and wait for the IOPub handshake (ipykernel's iopub_welcome). A fork of the warm
        template checks itself, before it starts, that what it imported ahead is what the user's import would
        find (guest/kernel_template.py stale_imports); where not, the kernel starts cold, saying why."""
        self.started_at = time.monotonic()
        await self.sandbox.launch()
        try:
            await self._attach(timeout_s, "start")
        except KernelStartError:
            if (stale := self.sandbox.stale_imports()) is None:
                raise
            self.started_at = time.monotonic()
            await self.sandbox.launch(cold_because=f"the template's imports are not current here: {stale}")
            await self._attach(timeout_s, "start")
        try:
            await self._teach_starter(timeout_s)
        except BaseException:
            # Cancelled (a session closed while its kernel started) or failed during the lesson: the sandbox is
            # this start's, and nobody else's yet.
            with anyio.CancelScope(shield=True):
                await self.shutdown()
            raise

    async def _teach_starter(self, timeout_s: float) -> None:
        """A kernel from the template that its template learns from (the first of the template's life, before
        anyone's code ran in it): one silent no-op, the pages a first execute copies, then the lesson (which of
        the template's pages a kernel's start copies: sandbox/template_pages.py). Every later fork copies them
        while its sandbox is built. The first start pays this once, a few milliseconds."""
        starter, process = self.backend.kernel_starter, self.sandbox.process
        if starter is None or process is None or not self.sandbox.from_template:
            return
        if not starter.wants_pages_from(process):
            return
        output = OutputCollector(limit_chars=1000, spill_limit_bytes=0, image_limit_bytes=0)
        try:
            outcome = await self.execute(
                "pass", output, timeout_s=timeout_s, interrupt_grace_s=1.0, silent=True, keep_on_cancel=False
            )
        finally:
            output.close()
        if outcome.status is RunStatus.OK:
            await starter.learn_pages(process)

    async def _attach(self, timeout_s: float, what: str) -> None:
        """Claim the sandbox's sockets, connect and wait for the IOPub handshake; on failure end the
        sandbox and raise KernelStartError saying what the sandbox said."""
        deadline = Deadline(time.monotonic() + timeout_s)
        try:
            await self.sandbox.claim_sockets(deadline)
            await self.client.connect(self.sandbox.host_side(), deadline)
        except (SandboxExited, TimeoutError, HostFsError) as exc:
            detail = await self.sandbox.failure_detail(exited=isinstance(exc, SandboxExited))
            await self.shutdown()
            reasons: dict[type[Exception], str] = {
                TimeoutError: "did not answer in time",
                HostFsError: f"refused its sockets: {exc}",
            }
            reason = reasons.get(type(exc), str(exc))
            raise KernelStartError(
                f"the sandboxed kernel failed to {what} ({reason})" + (f":\n{detail}" if detail else "")
            ) from None
        except BaseException:
            # Cancelled (or worse) half-way: never leave a sandbox nobody owns.
            with anyio.CancelScope(shield=True):
                await self.shutdown()
            raise

    # --- memory checkpoints (backends with a checkpointer: gvisor) ----------------------------

    def saved_connection(self) -> dict[str, Any]:
        """What a restored copy of this kernel is reached with: its key, ports and generation (host-only)."""
        return self.sandbox.saved_connection()

    async def checkpoint(
        self, image_dir: Path, timeout_s: float, while_stopped: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Save this kernel's whole sandbox (memory, threads, open files) into `image_dir` and carry on
        from that image: the sandbox is stopped, saved, `while_stopped` runs (a consistent copy of the
        workspace), and the sandbox is restored in place. Between cells only (the caller holds the lock).

        Raises CheckpointFailed; `alive` then says whether the kernel survived (a failed save or
        restore ends it, and the session's next call starts a fresh one)."""
        assert self.sandbox.info is not None
        self.client.close()
        try:
            await self.sandbox.save(image_dir, timeout_s)
        except CodeRunnerError as exc:
            if self.sandbox.alive:  # quiescing failed and the relay was told to bind again
                self.sandbox.forget_sockets()
                await self._attach(timeout_s, "reconnect after a refused checkpoint")
            raise CheckpointFailed(str(exc)) from None
        failed: BaseException | None = None
        try:
            if while_stopped is not None:
                await while_stopped()
        except BaseException as exc:  # the kernel is restored whatever happened meanwhile (even a cancel)
            failed = exc
        with anyio.CancelScope(shield=True):
            await self._adopt(image_dir, timeout_s, "carry on after its checkpoint")
        if failed is not None:
            raise failed

    async def restore(self, image_dir: Path, saved: dict[str, Any], timeout_s: float) -> None:
        """Start this kernel as a copy of a checkpointed one (`saved`: its saved_connection())."""
        self.sandbox.take_saved(saved)
        self.started_at = time.monotonic()
        await self._adopt(image_dir, timeout_s, "restore")

    async def _adopt(self, image_dir: Path, timeout_s: float, what: str) -> None:
        try:
            await self.sandbox.revive(image_dir, timeout_s)
        except CodeRunnerError as exc:
            raise CheckpointFailed(f"the kernel could not {what}: {exc}") from None
        try:
            await self._attach(timeout_s, what)
        except KernelStartError as exc:
            raise CheckpointFailed(str(exc)) from None

    # --- the client's calls -------------------------------------------------------------------

    async def execute(
        self,
        code: str,
        output: OutputCollector,
        timeout_s: float,
        interrupt_grace_s: float,
        progress: ProgressCallback | None = None,
        progress_interval_s: float = 1.0,
        silent: bool = False,
        keep_on_cancel: bool = True,
    ) -> RunOutcome:
        """Run `code` (KernelClient.execute): at the deadline it is interrupted, given `interrupt_grace_s`."""
        return await self.client.execute(
            code, output, timeout_s, interrupt_grace_s, progress, progress_interval_s, silent=silent,
            keep_on_cancel=keep_on_cancel,
        )  # fmt: skip

    def interrupt(self) -> None:
        """Ask the kernel to interrupt its cell, from code that cannot wait (the send runs soon)."""
        self.client.interrupt()

    async def shutdown(self) -> None:
        """Close the channels and kill the sandbox (no polite shutdown: nothing inside needs saving)."""
        self.client.close()
        await self.sandbox.kill()
