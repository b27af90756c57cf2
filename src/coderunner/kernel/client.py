"""The client half of one kernel: the host's ends of shell, control and IOPub, and what is said on them.

What jupyter_client's KernelClient is to a kernel: it connects the channels (the host's own bounded
ZMTP readers, kernel/channels.py, signed and verified with jupyter_client's Session, so a kernel can
make the host hold only so many bytes), waits for the kernel's welcome, runs an execute to its
`RunOutcome` and sends interrupts. It never waits without a bound: every wait races the deadline and
the sandbox's own exit (the process half, process.py), so a kernel killed from inside or by the OOM
killer is noticed through liveness, not by waiting for a reply that will never come.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import anyio
from anyio.abc import TaskGroup

from coderunner.kernel.channels import IOPUB_LIMITS, NO_PARENT, ChannelBroken, Lost, Mailbox, Message
from coderunner.kernel.execution import RunOutcome, RunState, RunStatus
from coderunner.kernel.host_channels import Deadline, open_mailboxes, pump_all
from coderunner.kernel.output_capture import OutputCollector
from coderunner.kernel.process import KernelProcess, SandboxExited
from coderunner.sandbox.cpu_wait import CpuWaitClock

log = logging.getLogger(__name__)

#: How often a silent wait checks that the sandbox is still alive.
LIVENESS_POLL_S = 0.25
#: Quiet IOPub this long after the execute_reply means the idle status was lost. Quiet means no
#: bytes read at all: while the pump still drains a backlog (say messages skipped as over the
#: limit), the run's own output and idle may be behind it.
IDLE_AFTER_REPLY_S = 1.0
#: Largest IOPub message the host accepts from a kernel (a bigger one is skipped, and the
#: run it belongs to says that some output was lost).
MAX_MESSAGE_BYTES = IOPUB_LIMITS.max_message_bytes
#: Most time an interrupt request may take to enter the kernel's control socket.
INTERRUPT_SEND_S = 1.0
#: Most time an interrupt's grace is lengthened by the sandbox's waits for a CPU (a bound on a loaded machine).
STARVED_GRACE_MAX_S = 30.0
#: A lengthened grace shorter than this is not waited for (the kernel had its time).
MIN_GRACE_STEP_S = 0.05


def longest_grace_s(grace_s: float) -> float:
    """The longest an interrupted cell may take to stop before its kernel counts as unresponsive."""
    return grace_s + STARVED_GRACE_MAX_S


ProgressCallback = Callable[[float, OutputCollector], Awaitable[None]]


@dataclass
class KernelClient:
    """The host's channels to one KernelProcess: connected after each start or restore, closed before a
    checkpoint and at the end."""

    sandbox: KernelProcess
    task_group: TaskGroup
    #: Set when a cancelled run ignored its interrupt, or a channel broke: the kernel is busy for good.
    wedged: bool = False
    _shell: Mailbox | None = None
    _control: Mailbox | None = None
    _iopub: Mailbox | None = None
    _pumps: anyio.CancelScope | None = None

    async def connect(self, info: dict[str, Any], deadline: Deadline) -> None:
        """Connect shell, control and IOPub, start draining them at once (host_channels.py), and wait for
        the IOPub handshake (ipykernel's iopub_welcome)."""
        self._shell, self._control, self._iopub = await open_mailboxes(info, deadline, self.sandbox.check_alive)
        self._iopub.expect(NO_PARENT)  # ipykernel's iopub_welcome answers our subscription
        self._pumps = anyio.CancelScope()
        self.task_group.start_soon(pump_all, self._pumps, [self._shell, self._control, self._iopub])
        while True:
            msg = await self._next_iopub(deadline)
            if isinstance(msg, Message) and msg.msg_type == "iopub_welcome":
                self._iopub.forget(NO_PARENT)
                return

    def close(self) -> None:
        """Stop reading and close the host's ends of the channels, without ending the sandbox."""
        if self._pumps is not None:
            self._pumps.cancel()
            self._pumps = None
        for mailbox in (self._shell, self._control, self._iopub):
            if mailbox is not None:
                mailbox.connection.close()
        self._shell = self._control = self._iopub = None

    async def _next_iopub(self, deadline: Deadline | None) -> Message | Lost | None:
        """The next expected IOPub message, or None after a quiet LIVENESS_POLL_S (the sandbox was alive).

        Raises TimeoutError at the deadline and SandboxExited when the sandbox is gone.
        """
        if self._iopub is None:  # shut down under us
            raise SandboxExited(self.sandbox.exit_code)
        wait = LIVENESS_POLL_S
        if deadline is not None:
            remaining = deadline.remaining()
            if remaining <= 0:
                raise TimeoutError
            wait = min(wait, remaining)
        try:
            msg = await self._iopub.get(timeout=wait)
        except ChannelBroken as exc:
            await self._channel_broken(exc)
        if msg is None:
            self.sandbox.check_alive()
        return msg

    async def _channel_broken(self, exc: ChannelBroken) -> NoReturn:
        """A kernel that closed or garbled a channel cannot be spoken to again: end it."""
        self.wedged = True
        await self.sandbox.end_after_broken_channel(exc)
        raise SandboxExited(self.sandbox.exit_code)

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
        """Run `code`; at the deadline interrupt it and give it `interrupt_grace_s` to stop.

        `silent` runs it without history or execution count (guest tool calls). `keep_on_cancel` False: a
        caller that leaves discards this kernel (the server's own warm-up cells), so nothing waits for the
        cell to stop: the kernel is marked wedged at once.
        """
        # Held here: a shutdown from elsewhere (a session close) clears the attributes mid-run.
        shell, iopub = self._shell, self._iopub
        assert shell is not None and iopub is not None
        begun = time.monotonic()
        request = shell.make(
            "execute_request",
            {
                "code": code,
                "silent": silent,
                "store_history": not silent,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": False,
            },
        )
        msg_id = str(request["header"]["msg_id"])
        run = RunState(msg_id=msg_id, output=output)
        # Expected before it is sent: anything else either channel carries is dropped on arrival.
        iopub.expect(msg_id)
        shell.expect(msg_id)
        try:
            try:
                try:
                    await shell.send(request, timeout=max(timeout_s, 0.0))
                except ChannelBroken as exc:
                    await self._channel_broken(exc)
                await self._collect(run, Deadline(begun + timeout_s), progress, progress_interval_s, begun)
            except TimeoutError:
                run.status = await self._interrupt_and_settle(run, interrupt_grace_s, begun)
            except anyio.get_cancelled_exc_class():
                # The caller gave up (MCP notifications/cancelled, client gone): never leave the
                # cell burning a core. If the interrupt is ignored, the owner must restart us.
                if not keep_on_cancel:
                    self.wedged = True
                    raise
                with anyio.CancelScope(shield=True):
                    if await self._interrupt_and_settle(run, interrupt_grace_s, begun) is RunStatus.UNRESPONSIVE:
                        self.wedged = True
                raise
        except SandboxExited as exc:
            run.status = RunStatus.DIED
            run.exit_code = exc.exit_code
        finally:
            # A reply or output that comes later is read and dropped by the pumps: nothing piles up.
            iopub.forget(msg_id)
            shell.forget(msg_id)
        return RunOutcome(
            status=run.status,
            output=output,
            error=run.error,
            execution_count=run.execution_count,
            duration_s=time.monotonic() - begun,
            exit_code=run.exit_code,
            output_lost=run.output_lost,
            guest_payload=run.guest_payload,
        )

    async def _interrupt_and_settle(self, run: RunState, grace_s: float, begun: float) -> RunStatus:
        """Interrupt the cell and give the kernel `grace_s` of time it could run to go idle.

        The grace is counted in wall time less the longest wait for a CPU of the sandbox's threads or of
        this server's event loop thread (sandbox/cpu_wait.py): sessions get only idle CPU, so on a loaded
        machine an interrupt that takes 50 ms may take seconds to run, and a restart would then lose state
        that was never at risk. STARVED_GRACE_MAX_S bounds how much longer than `grace_s` that makes it.
        What arrived by the end is read before the verdict.
        """
        process = self.sandbox.process
        loop_thread = threading.get_native_id()
        clock = await anyio.to_thread.run_sync(CpuWaitClock.started, process, [loop_thread])
        await self._interrupt()
        interrupted = time.monotonic()
        latest = interrupted + longest_grace_s(grace_s)
        deadline = interrupted + grace_s
        last_look = False
        while True:
            try:
                await self._collect(run, Deadline(deadline), None, 0, begun)
                return RunStatus.INTERRUPTED
            except TimeoutError:
                if last_look:
                    return RunStatus.UNRESPONSIVE
                waited = await anyio.to_thread.run_sync(clock.waited_s)
                deadline = min(interrupted + grace_s + waited, latest)
                if deadline - time.monotonic() < MIN_GRACE_STEP_S:
                    last_look, deadline = True, time.monotonic() + MIN_GRACE_STEP_S

    async def _collect(
        self,
        run: RunState,
        deadline: Deadline,
        progress: ProgressCallback | None,
        progress_interval_s: float,
        begun: float,
    ) -> None:
        last_progress = time.monotonic()
        while not run.idle:
            msg = await self._next_iopub(deadline)
            if isinstance(msg, Message) and msg.parent_id == run.msg_id:
                run.handle(msg)
                if run.output.pending:  # spill and image files: written in a worker thread
                    await run.output.drain()
            elif isinstance(msg, Lost) and msg.parent_id in (run.msg_id, None):
                log.info("output of a run was lost: %s", msg.reason)
                run.output_lost = True
            elif msg is None and await self._reply_without_idle(run):
                # The cell finished (its execute_reply came on the shell channel) but its idle
                # status never came: it was lost, or the kernel never sent it.
                run.output_lost = True
                return
            if progress is not None and time.monotonic() - last_progress >= progress_interval_s:
                last_progress = time.monotonic()
                await progress(last_progress - begun, run.output)

    async def _reply_without_idle(self, run: RunState) -> bool:
        """Look (without waiting) for our execute_reply; True once it came and IOPub stayed quiet."""
        if self._shell is None:  # shut down under us
            raise SandboxExited(self.sandbox.exit_code)
        while run.reply_at is None:
            try:
                reply = await self._shell.get(timeout=0)
            except ChannelBroken as exc:
                await self._channel_broken(exc)
            if reply is None:
                return False
            if reply.parent_id == run.msg_id:
                run.take_reply(reply.content if isinstance(reply, Message) else {})
        last_read_at = self._iopub.connection.last_read_at if self._iopub is not None else 0.0
        return time.monotonic() - max(run.reply_at, last_read_at) >= IDLE_AFTER_REPLY_S

    def interrupt(self) -> None:
        """Ask the kernel to interrupt its cell, from code that cannot wait (the send runs soon)."""
        if self._control is not None:
            self.task_group.start_soon(self._interrupt)

    async def _interrupt(self) -> None:
        """interrupt_mode=message: a SIGINT to bwrap would kill the sandbox, not interrupt the cell.

        Its reply is not awaited: the control pump reads and drops it.
        """
        if self._control is None:
            return
        with contextlib.suppress(ChannelBroken):
            await self._control.send(self._control.make("interrupt_request", {}), timeout=INTERRUPT_SEND_S)
