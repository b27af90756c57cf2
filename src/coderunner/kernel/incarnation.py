"""One kernel incarnation: an ipykernel in a sandbox, spoken to over ipc:// (or loopback TCP).

The channels are the host's own bounded ZMTP readers (kernel_channels), signed and verified
with jupyter_client's Session: a kernel can make the host hold only so many bytes.

A `Kernel` is started once and dies once; restarts are the session's business. It answers an
execute with a `RunOutcome` and never waits without a bound: every wait races the deadline
and the sandbox process's own exit, so a kernel killed from inside or by the OOM killer is
noticed through liveness, not by waiting for a reply that will never come.

One idea: one kernel's life from start to death (start and its socket poll, ready, execute, interrupt,
checkpoint, kill).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import anyio
from anyio.abc import TaskGroup

from coderunner.errors import CodeRunnerError
from coderunner.hostfs.dirfd import HostFsError
from coderunner.hostfs.session_dirs import SandboxDirs, connection_names, dump_connection
from coderunner.kernel.channels import IOPUB_LIMITS, NO_PARENT, ChannelBroken, Lost, Mailbox, Message
from coderunner.kernel.connection_info import connection_info
from coderunner.kernel.execution import CellError, RunOutcome, RunState, RunStatus
from coderunner.kernel.host_channels import Deadline, open_mailboxes, pump_all
from coderunner.kernel.output_capture import OutputCollector
from coderunner.sandbox import PRIVATE_CONNECTION, KernelChannels, SandboxBackend, SandboxProcess, SandboxSpec
from coderunner.sandbox.common import product_python

log = logging.getLogger(__name__)

__all__ = [
    "CellError",
    "CheckpointFailed",
    "Kernel",
    "KernelStartError",
    "ProgressCallback",
    "RunOutcome",
    "RunStatus",
]

#: How often a silent wait checks that the sandbox is still alive.
LIVENESS_POLL_S = 0.25
#: Quiet IOPub this long after the execute_reply means the idle status was lost.
IDLE_AFTER_REPLY_S = 1.0
#: Largest IOPub message the host accepts from a kernel (a bigger one is skipped, and the
#: run it belongs to says that some output was lost).
MAX_MESSAGE_BYTES = IOPUB_LIMITS.max_message_bytes
#: Most time an interrupt request may take to enter the kernel's control socket.
INTERRUPT_SEND_S = 1.0
#: How long a kernel whose channel closed may take to exit by itself before it is killed.
EXIT_WAIT_S = 2.0
#: The kernel's channels the host connects to (heartbeat and stdin are not used).
HOST_CHANNELS = ("shell_port", "iopub_port", "control_port")

ProgressCallback = Callable[[float, OutputCollector], Awaitable[None]]


#: Looking for a starting kernel's ipc sockets: every SOCKETS_POLL_S for SOCKETS_POLL_QUICK_S (a start on
#: a quiet machine takes about 0.2 s), then every SOCKETS_POLL_SHARE of the time waited so far, up to
#: SOCKETS_POLL_MAX_S. A start slowed by a busy machine polled 200 times a second while it waited, and
#: so slowed every start further: 40 cluster sessions at once on 2 cores spent 0.27-0.37 CPU-s each
#: opening, 0.11-0.14 with the back-off (bench/actor_cpu.py).
SOCKETS_POLL_S = 0.005
SOCKETS_POLL_QUICK_S = 0.25
SOCKETS_POLL_SHARE = 0.05
SOCKETS_POLL_MAX_S = 0.05


def socket_poll_s(waited_s: float) -> float:
    """How long to wait before looking for a starting kernel's sockets again, `waited_s` into its start."""
    if waited_s < SOCKETS_POLL_QUICK_S:
        return SOCKETS_POLL_S
    return min(max(SOCKETS_POLL_S, waited_s * SOCKETS_POLL_SHARE), SOCKETS_POLL_MAX_S)


class KernelStartError(CodeRunnerError):
    """The kernel did not come up; the message carries what the sandbox said."""


class CheckpointFailed(CodeRunnerError):
    """A memory checkpoint or restore did not work; the message says what the sandbox said."""


class SandboxExited(Exception):
    def __init__(self, exit_code: int | None) -> None:
        super().__init__(f"sandbox exited with code {exit_code}")
        self.exit_code = exit_code


@dataclass
class Kernel:
    backend: SandboxBackend
    spec: SandboxSpec
    task_group: TaskGroup
    dirs: SandboxDirs
    generation: int = 0
    process: SandboxProcess | None = None
    started_at: float = field(default_factory=time.monotonic)
    #: Set when a cancelled run ignored its interrupt: the kernel is busy for good.
    wedged: bool = False
    _connection_name: str | None = None
    #: The connection info the kernel was started with (its key included): a checkpoint keeps it.
    _info: dict[str, Any] | None = None
    _shell: Mailbox | None = None
    _control: Mailbox | None = None
    _iopub: Mailbox | None = None
    _pumps: anyio.CancelScope | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.alive

    async def start(self, timeout_s: float) -> None:
        """Start the sandbox and wait for the IOPub handshake (ipykernel's iopub_welcome)."""
        self._connection_name = f"kernel-{self.generation}.json"
        if self.backend.channels == KernelChannels.TCP:
            # The backend publishes these (free) ports on the host's loopback only.
            address = {"transport": "tcp", "ip": "127.0.0.1"}
        else:
            # The kernel binds in its own run/ dir; the host connects only after moving the
            # sockets to its own sock/ dir (see session_dirs.py).
            address = {"transport": "ipc", "ip": str(self.spec.runtime_dir / f"k{self.generation}")}
        info = connection_info(key=secrets.token_hex(32), **address)
        self._info = info
        spec, connection_file = self.spec, PRIVATE_CONNECTION
        if self.backend.private_files:  # its key in its own sandbox only, not in host/ (every sandbox of the session's)
            spec, self._connection_name = replace(spec, private_files=((connection_file, dump_connection(info)),)), None
        else:
            connection_file = str(self.dirs.write_host_file(self._connection_name, dump_connection(info)))
        argv = product_python(
            self.backend.python, "-m", "ipykernel_launcher",
            "-f", connection_file,
            "--HistoryManager.hist_file=:memory:",
            "--IPKernelApp.quiet=True",
            "--IPKernelApp.extensions=coderunner_guest",
        )  # fmt: skip
        self.started_at = time.monotonic()
        self.process = await self.backend.spawn(spec, argv, self.task_group)
        await self._attach(info, timeout_s, "start")

    async def _attach(self, info: dict[str, Any], timeout_s: float, what: str) -> None:
        """Claim the sandbox's sockets, connect and wait for the IOPub handshake; on failure end the
        sandbox and raise KernelStartError saying what the sandbox said."""
        deadline = Deadline(time.monotonic() + timeout_s)
        try:
            await self._await_sockets(info, deadline)
            await self._open_channels(self._host_side(info), deadline)
            await self._await_welcome(deadline)
        except (SandboxExited, TimeoutError, HostFsError) as exc:
            detail = ""
            if self.process is not None:
                exited = isinstance(exc, SandboxExited)
                detail = await self.process.stderr_settled() if exited else self.process.stderr_tail()
                detail = detail.strip()[-2000:]
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
        assert self._info is not None
        keep = ("key", "signature_scheme", "transport", *(name for name in self._info if name.endswith("_port")))
        return {**{name: self._info[name] for name in keep}, "generation": self.generation}

    async def checkpoint(
        self, image_dir: Path, timeout_s: float, while_stopped: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Save this kernel's whole sandbox (memory, threads, open files) into `image_dir` and carry on
        from that image: the sandbox is stopped, saved, `while_stopped` runs (a consistent copy of the
        workspace), and the sandbox is restored in place. Between cells only (the caller holds the lock).

        Raises CheckpointFailed; `alive` then says whether the kernel survived (a failed save or
        restore ends it, and the session's next call starts a fresh one)."""
        checkpointer = self.backend.checkpointer
        assert checkpointer is not None and self.process is not None and self._info is not None
        self._detach()
        try:
            await checkpointer.checkpoint(self.process, image_dir, timeout_s)
        except CodeRunnerError as exc:
            if self.process.alive:  # quiescing failed and the relay was told to bind again
                self.dirs.forget_sockets(f"k{self.generation}-")
                await self._attach(self._info, timeout_s, "reconnect after a refused checkpoint")
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
        kept = {name: value for name, value in saved.items() if name != "generation"}
        self._info = {**kept, "ip": str(self.spec.runtime_dir / f"k{self.generation}")}
        self.started_at = time.monotonic()
        await self._adopt(image_dir, timeout_s, "restore")

    async def _adopt(self, image_dir: Path, timeout_s: float, what: str) -> None:
        checkpointer = self.backend.checkpointer
        assert checkpointer is not None and self._info is not None
        # The dead ones the host claimed (the backend clears those left in run/); the relay binds the names again.
        self.dirs.forget_sockets(f"k{self.generation}-")
        try:
            self.process = await checkpointer.restore(self.spec, image_dir, self.task_group, timeout_s)
        except CodeRunnerError as exc:
            self.process = None
            raise CheckpointFailed(f"the kernel could not {what}: {exc}") from None
        try:
            await self._attach(self._info, timeout_s, what)
        except KernelStartError as exc:
            raise CheckpointFailed(str(exc)) from None

    def _detach(self) -> None:
        """Stop reading and close the host's ends of the channels, without ending the sandbox."""
        if self._pumps is not None:
            self._pumps.cancel()
            self._pumps = None
        for mailbox in (self._shell, self._control, self._iopub):
            if mailbox is not None:
                mailbox.connection.close()
        self._shell = self._control = self._iopub = None

    def _host_side(self, info: dict[str, Any]) -> dict[str, Any]:
        """The connection info as the host uses it: ipc sockets in its own sock/ dir."""
        if info["transport"] != "ipc":
            return info
        return {**info, "ip": str(self.dirs.sock_dir / f"k{self.generation}")}

    async def _await_sockets(self, info: dict[str, Any], deadline: Deadline) -> None:
        """Claim the kernel's sockets once it has bound them: no ZMQ reconnect back-off on start,
        and never a connect through a name the sandbox could swap."""
        if info["transport"] != "ipc":
            return  # published ports accept before the kernel listens; ZMQ reconnects until it does
        names = connection_names(info, HOST_CHANNELS)
        began = time.monotonic()
        while not self.dirs.claim_sockets(names):
            self._check_alive()
            if deadline.remaining() <= 0:
                raise TimeoutError
            await anyio.sleep(socket_poll_s(time.monotonic() - began))

    async def _open_channels(self, info: dict[str, Any], deadline: Deadline) -> None:
        """Connect shell, control and IOPub and start draining them at once (host_channels.py)."""
        self._shell, self._control, self._iopub = await open_mailboxes(info, deadline, self._check_alive)
        self._iopub.expect(NO_PARENT)  # ipykernel's iopub_welcome answers our subscription
        self._pumps = anyio.CancelScope()
        self.task_group.start_soon(pump_all, self._pumps, [self._shell, self._control, self._iopub])

    async def _await_welcome(self, deadline: Deadline) -> None:
        assert self._iopub is not None
        while True:
            msg = await self._next_iopub(deadline)
            if isinstance(msg, Message) and msg.msg_type == "iopub_welcome":
                self._iopub.forget(NO_PARENT)
                return

    def _check_alive(self) -> None:
        if self.process is None or not self.process.alive:
            raise SandboxExited(self.process.returncode if self.process else None)

    async def _next_iopub(self, deadline: Deadline | None) -> Message | Lost | None:
        """The next expected IOPub message, or None after a quiet LIVENESS_POLL_S (the sandbox was alive).

        Raises TimeoutError at the deadline and SandboxExited when the sandbox is gone.
        """
        if self._iopub is None:  # shut down under us
            raise SandboxExited(self.process.returncode if self.process else None)
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
            self._check_alive()
        return msg

    async def _channel_broken(self, exc: ChannelBroken) -> NoReturn:
        """A kernel that closed or garbled a channel cannot be spoken to again: end it."""
        self.wedged = True
        if self.process is not None:
            with anyio.CancelScope(shield=True):
                # A kernel that died closes its channels too: let it exit on its own first,
                # so that its own exit code is what the caller is told.
                # (Not killed then: the kill would remove the cgroup that says whether it was OOM.)
                with anyio.move_on_after(EXIT_WAIT_S):
                    await self.process.wait()
                if self.process.alive:
                    log.warning("%s; ending the kernel", exc)
                    await self.process.kill()
        raise SandboxExited(self.process.returncode if self.process else None)

    async def execute(
        self,
        code: str,
        output: OutputCollector,
        timeout_s: float,
        interrupt_grace_s: float,
        progress: ProgressCallback | None = None,
        progress_interval_s: float = 1.0,
        silent: bool = False,
    ) -> RunOutcome:
        """Run `code`; at the deadline interrupt it and give it `interrupt_grace_s` to stop.

        `silent` runs it without history or execution count (guest tool calls).
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
        """Interrupt the cell and wait up to `grace_s` for the kernel to go idle."""
        await self._interrupt()
        try:
            await self._collect(run, Deadline(time.monotonic() + grace_s), None, 0, begun)
        except TimeoutError:
            return RunStatus.UNRESPONSIVE
        return RunStatus.INTERRUPTED

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
            raise SandboxExited(self.process.returncode if self.process else None)
        while run.reply_at is None:
            try:
                reply = await self._shell.get(timeout=0)
            except ChannelBroken as exc:
                await self._channel_broken(exc)
            if reply is None:
                return False
            if reply.parent_id == run.msg_id:
                run.take_reply(reply.content if isinstance(reply, Message) else {})
        return time.monotonic() - run.reply_at >= IDLE_AFTER_REPLY_S

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

    async def shutdown(self) -> None:
        """Kill the sandbox (no polite shutdown: nothing inside needs saving) and close channels."""
        self._detach()
        if self.process is not None:
            await self.process.kill()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """The host's own files of this kernel: claimed sockets and the connection file."""
        self.dirs.forget_sockets(f"k{self.generation}-")
        if self._connection_name is not None:
            self.dirs.remove_host_file(self._connection_name)
