"""The process half of one kernel: an ipykernel in a sandbox, its connection info and the host's files for it.

What jupyter_client's KernelManager is to a local kernel: it makes the connection info (key and
addresses), spawns the sandbox, claims the sockets the kernel bound, saves and restores the whole
sandbox (a memory checkpoint), says whether it still lives, and kills it. Speaking to the kernel
over its channels is the client half's (client.py).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from coderunner.errors import CodeRunnerError
from coderunner.hostfs.session_dirs import SandboxDirs, connection_names, dump_connection
from coderunner.kernel.connection_info import connection_info
from coderunner.kernel.host_channels import Deadline
from coderunner.sandbox import (
    PRIVATE_CONNECTION,
    KernelChannels,
    SandboxBackend,
    SandboxProcess,
    SandboxSpec,
    SandboxUnavailable,
)
from coderunner.sandbox.common import product_python

log = logging.getLogger(__name__)

#: How long a kernel whose channel closed may take to exit by itself before it is killed.
EXIT_WAIT_S = 2.0
#: The module every sandbox's kernel starts with: ipykernel's launcher without the shell channel thread
#: and the IOPub event pipe (guest/kernel_boot.py), two thread hops fewer per call.
KERNEL_LAUNCHER = "coderunner_guest.kernel_boot"
#: KernelProcess.started_how of a kernel forked from the warm template (else "cold start: <why not>").
FROM_TEMPLATE = "template"
#: The kernel's options after its connection file (guest/kernel_template.py's KERNEL_ARGS are the same: a test
#: compares them). No history file (its SQLite would be the sandbox's to write, and must not cross a fork); our
#: extension; and no sleep after each cell: ipykernel sleeps 0.5 ms before every execute_reply so that clients
#: that stop at the reply get the cell's last output first, but KernelClient stops at IOPub's idle status, which
#: the kernel publishes after that output on the same socket.
KERNEL_OPTIONS = (
    "--HistoryManager.hist_file=:memory:",
    "--IPKernelApp.quiet=True",
    "--IPKernelApp.extensions=coderunner_guest",
    "--Kernel._execute_sleep=0",
)
#: The kernel's channels the host connects to (heartbeat and stdin are not used).
HOST_CHANNELS = ("shell_port", "iopub_port", "control_port")

#: Looking for a starting kernel's ipc sockets: every SOCKETS_POLL_S for SOCKETS_POLL_QUICK_S (a start on
#: a quiet machine takes about 0.2 s), then every SOCKETS_POLL_SHARE of the time waited so far, up to
#: SOCKETS_POLL_MAX_S. A start slowed by a busy machine polled 200 times a second while it waited, and
#: so slowed every start further: 40 cluster sessions at once on 2 cores spent 0.27-0.37 CPU-s each
#: opening, 0.11-0.14 with the back-off (bench/actor_cpu.py, since removed).
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
class KernelProcess:
    """One kernel's sandbox: started (or restored) once, killed once."""

    backend: SandboxBackend
    spec: SandboxSpec
    task_group: TaskGroup
    dirs: SandboxDirs
    generation: int = 0
    process: SandboxProcess | None = None
    #: The connection info the kernel was started with (its key included): a checkpoint keeps it.
    info: dict[str, Any] | None = None
    #: How its sandbox's kernel started: FROM_TEMPLATE, or "cold start: <why not from the template>" (None: a
    #: cold start with nothing to say, as when the kernel_template setting is off).
    started_how: str | None = None
    _connection_name: str | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.alive

    @property
    def exit_code(self) -> int | None:
        return self.process.returncode if self.process else None

    def check_alive(self) -> None:
        """Raise SandboxExited once the sandbox is gone."""
        if self.process is None or not self.process.alive:
            raise SandboxExited(self.exit_code)

    @property
    def from_template(self) -> bool:
        return self.started_how == FROM_TEMPLATE

    async def launch(self, cold_because: str | None = None) -> None:
        """Make the connection info (a fresh key) and spawn the sandbox; it binds its sockets meanwhile.
        The backend's kernel_starter (the warm template) is asked first unless `cold_because` says why not."""
        self._connection_name = f"kernel-{self.generation}.json"
        if self.backend.channels == KernelChannels.TCP:
            # The backend publishes these (free) ports on the host's loopback only.
            address = {"transport": "tcp", "ip": "127.0.0.1"}
        else:
            # The kernel binds in its own run/ dir; the host connects only after moving the
            # sockets to its own sock/ dir (see session_dirs.py).
            address = {"transport": "ipc", "ip": str(self.spec.runtime_dir / f"k{self.generation}")}
        info = connection_info(key=secrets.token_hex(32), **address)
        self.info = info
        spec, connection_file = self.spec, PRIVATE_CONNECTION
        if self.backend.private_files:  # its key in its own sandbox only, not in host/ (every sandbox of the session's)
            spec, self._connection_name = replace(spec, private_files=((connection_file, dump_connection(info)),)), None
        else:
            connection_file = str(self.dirs.write_host_file(self._connection_name, dump_connection(info)))
        argv = product_python(self.backend.python, "-m", KERNEL_LAUNCHER, "-f", connection_file, *KERNEL_OPTIONS)
        starter = self.backend.kernel_starter
        why_cold = cold_because or (self.backend.no_kernel_starter if starter is None else None)
        if starter is not None and why_cold is None and not self.backend.private_files:
            why_cold = "this backend cannot give a kernel a connection file of its own"  # a fork reads its key there
        if starter is not None and why_cold is None:
            try:
                self.process = await starter.spawn_kernel(spec, self.task_group)
            except SandboxUnavailable as exc:
                why_cold = str(exc)
                log.info("kernel %s starts cold: %s", self.spec.name, why_cold)
            else:
                self.started_how = FROM_TEMPLATE
                return
        self.started_how = f"cold start: {why_cold}" if why_cold is not None else None
        self.process = await self.backend.spawn(spec, argv, self.task_group)

    def stale_imports(self) -> str | None:
        """Why a kernel from the template exited before it ran anything: the imports it carried in are not what its
        own would find in its sandbox (the starter's word); None for any other kernel or end."""
        starter = self.backend.kernel_starter
        if not self.from_template or starter is None or self.process is None or self.process.alive:
            return None
        return starter.stale_imports(self.process)

    def host_side(self) -> dict[str, Any]:
        """The connection info as the host uses it: ipc sockets in its own sock/ dir."""
        assert self.info is not None
        if self.info["transport"] != "ipc":
            return self.info
        return {**self.info, "ip": str(self.dirs.sock_dir / f"k{self.generation}")}

    async def claim_sockets(self, deadline: Deadline) -> None:
        """Claim the kernel's sockets once it has bound them: no ZMQ reconnect back-off on start,
        and never a connect through a name the sandbox could swap."""
        assert self.info is not None
        if self.info["transport"] != "ipc":
            return  # published ports accept before the kernel listens; ZMQ reconnects until it does
        names = connection_names(self.info, HOST_CHANNELS)
        began = time.monotonic()
        while not self.dirs.claim_sockets(names):
            self.check_alive()
            if deadline.remaining() <= 0:
                raise TimeoutError
            await anyio.sleep(socket_poll_s(time.monotonic() - began))

    async def failure_detail(self, exited: bool) -> str:
        """The end of what the sandbox wrote to stderr (all of it once it `exited`), for a start's failure."""
        if self.process is None:
            return ""
        detail = await self.process.stderr_settled() if exited else self.process.stderr_tail()
        return detail.strip()[-2000:]

    # --- memory checkpoints (backends with a checkpointer: gvisor) ----------------------------

    def saved_connection(self) -> dict[str, Any]:
        """What a restored copy of this kernel is reached with: its key, ports and generation (host-only)."""
        assert self.info is not None
        keep = ("key", "signature_scheme", "transport", *(name for name in self.info if name.endswith("_port")))
        return {**{name: self.info[name] for name in keep}, "generation": self.generation}

    def take_saved(self, saved: dict[str, Any]) -> None:
        """Be a copy of a checkpointed kernel (`saved`: its saved_connection()), about to be restored."""
        kept = {name: value for name, value in saved.items() if name != "generation"}
        self.info = {**kept, "ip": str(self.spec.runtime_dir / f"k{self.generation}")}

    async def save(self, image_dir: Path, timeout_s: float) -> None:
        """Stop the sandbox and save it whole into `image_dir` (raises the checkpointer's CodeRunnerError)."""
        checkpointer = self.backend.checkpointer
        assert checkpointer is not None and self.process is not None
        await checkpointer.checkpoint(self.process, image_dir, timeout_s)

    async def revive(self, image_dir: Path, timeout_s: float) -> None:
        """Restore the sandbox from `image_dir` (raises the checkpointer's CodeRunnerError, with no process then)."""
        checkpointer = self.backend.checkpointer
        assert checkpointer is not None
        # The dead ones the host claimed (the backend clears those left in run/); the relay binds the names again.
        self.forget_sockets()
        try:
            self.process = await checkpointer.restore(self.spec, image_dir, self.task_group, timeout_s)
        except CodeRunnerError:
            self.process = None
            raise

    def forget_sockets(self) -> None:
        """Drop the sockets the host claimed of this kernel (the sandbox binds them again on a restore)."""
        self.dirs.forget_sockets(f"k{self.generation}-")

    # --- the end ------------------------------------------------------------------------------

    async def end_after_broken_channel(self, reason: object) -> None:
        """A kernel that closed or garbled a channel cannot be spoken to again: let it exit, else kill it."""
        if self.process is None:
            return
        with anyio.CancelScope(shield=True):
            # A kernel that died closes its channels too: let it exit on its own first,
            # so that its own exit code is what the caller is told.
            # (Not killed then: the kill would remove the cgroup that says whether it was OOM.)
            with anyio.move_on_after(EXIT_WAIT_S):
                await self.process.wait()
            if self.process.alive:
                log.warning("%s; ending the kernel", reason)
                await self.process.kill()

    async def kill(self) -> None:
        """Kill the sandbox (no polite shutdown: nothing inside needs saving) and remove the host's files of it."""
        if self.process is not None:
            await self.process.kill()
        self.forget_sockets()
        if self._connection_name is not None:
            self.dirs.remove_host_file(self._connection_name)
