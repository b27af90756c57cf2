"""The host's half of the kernel template (issue 41, route A): start the template, ask it for a kernel in a sandbox.

The template (guest/kernel_template.py) is the sandbox's Python, warmed once, run by bwrap as the host's
root in a mount namespace of its own that shows exactly the read-only part every sandbox sees (/usr, the
/etc files passed through, the environment at /opt/coderunner/env, the guest), so that the paths of its
modules are the sandbox's and it reads nothing a sandbox could not. It keeps its capabilities (--cap-add
ALL): its forks need them to join a sandbox; each drops them all before anything of the sandbox runs.

A kernel from it: the sandbox is built by the bwrap backend as today, with no program (its init holds it: HOLD);
`begin_fork` hands the template a pidfd of that sandbox's pid 1 (and its cgroups, its environment and limits) as
soon as bwrap made it, and the template answers with the fork at once; the fork joins the cgroups and waits. Once
the init says the sandbox is finished, `finish_fork` says "go": the fork enters the sandbox and is confined
as bwrap confines its own child (guest/sandbox_enter.py), then reports. So the fork and bwrap's mounts and init
overlap, and the template is busy for a fork only, not for a sandbox's whole start (a burst's starts queue on it).

Used by KernelProcess where the `kernel_template` setting is on (sandbox/template_kernels.py owns the
template of a server process and says why a kernel starts cold instead).
The wire format is the template's (REQUEST, REPLY, REPORT): tests/unit/test_kernel_template.py checks both agree.

One idea: the host's end of one wire protocol, the template's, from its start to a kernel entered into a sandbox
(its exchanges, the two phases of a fork, its end); the template's own end is guest/kernel_template.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import signal
import socket
import struct
import subprocess
from dataclasses import dataclass

import anyio
import anyio.lowlevel
from anyio.abc import Process, TaskGroup

from coderunner.sandbox.base import SandboxProcess, SandboxSpec
from coderunner.sandbox.bwrap import BwrapBackend, BwrapUnavailable
from coderunner.sandbox.bwrap_argv import HOLD, BwrapCommand
from coderunner.sandbox.common import ENV_MOUNT, GUEST_LIB, sandbox_environment, spec_environment
from coderunner.sandbox.pid1 import SandboxHold as BwrapHold
from coderunner.vocabulary.network import NetworkMode
from coderunner.vocabulary.sandbox_layout import HOME, SANDBOX_GID, SANDBOX_UID

#: The template's wire format (guest/kernel_template.py has the same; a unit test compares them).
#: Bytes of the environment field (NUL-separated KEY=VALUE).
ENVIRONMENT_BYTES = 2048
REQUEST = struct.Struct(f"<4sIIIIQQ{ENVIRONMENT_BYTES}s")
REPLY = struct.Struct("<4siiQQI")
MAGIC = b"KTR2"
KIND_FORK = 1
KIND_COUNTERS = 2
KIND_PLAN = 3
FLAG_MEMORY_SOFT_ONLY = 1
FLAG_STATUS_FD = 2
#: What a fork reports once it entered and confined itself: 0, or a negative errno (it exits: nothing ran).
REPORT = struct.Struct("<q")
#: A kernel's exit code when the template's imports were not what its own would find in its sandbox; it wrote
#: STALE_PREFIX and why on its stderr first (at most STALE_REASON_BYTES), and a cold kernel starts instead.
STALE = 123
STALE_PREFIX = "kernel template: imports not current: "
STALE_REASON_BYTES = 1024
#: The program of a sandbox a template's fork enters in network 'allowlist': it says the sandbox is finished once
#: the forwarder that starts it runs, then waits, as what the sandbox's init waits for, until the sandbox is killed.
#: In the other modes there is none (HOLD): the init says so itself, three execs fewer a start.
PLACEHOLDER = ["/bin/sh", "-c", "echo ready && exec /usr/bin/sleep infinity"]
#: Bound on the template's warm-up (imports, font cache) on a loaded machine.
START_TIMEOUT_S = 180.0
#: Bound on one fork and entry.
FORK_TIMEOUT_S = 30.0


class TemplateUnavailable(BwrapUnavailable):
    """No kernel from the template: it cannot run here, or a fork could not enter its sandbox."""


@dataclass(frozen=True)
class TemplateReply:
    """What the template answers: an errno (0: done), the kernel's host pid, and its own counters; a fork's
    answer holds a pidfd of the kernel (the caller's to close): the handle that says it exited, which no
    process in its sandbox can change and no reuse of its pid can confuse."""

    error: int
    pid: int
    cpu_us: int
    children_cpu_us: int
    threads: int
    pidfd: int | None = None


@dataclass
class PendingFork:
    """A fork made into a sandbox still being built: it waits for "go" on `go` (the write end: closing it ends the
    fork), then reports on `report` (the read end). The reply's pidfd is the caller's, as in TemplateReply."""

    reply: TemplateReply
    go: int
    report: int

    def abandon(self) -> None:
        """The start goes no further: the fork reads the end of "go" and exits; every fd here is closed."""
        for fd in (self.go, self.report, self.reply.pidfd):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.go = self.report = -1
        self.reply = dataclasses.replace(self.reply, pidfd=None)


def encode_request(
    kind: int,
    *,
    uid: int = 0,
    gid: int = 0,
    memory_bytes: int | None = None,
    memory_soft_only: bool = False,
    status_fd: bool = False,
    nproc: int | None = None,
    environment: dict[str, str] | None = None,
) -> bytes:
    """One fixed-size request; refuses an environment too large for its field."""
    blob = b"\0".join(f"{key}={value}".encode() for key, value in (environment or {}).items())
    if len(blob) > ENVIRONMENT_BYTES:
        raise ValueError(f"the kernel's environment ({len(blob)} bytes) does not fit a template request")
    flags = (FLAG_MEMORY_SOFT_ONLY if memory_soft_only else 0) | (FLAG_STATUS_FD if status_fd else 0)
    return REQUEST.pack(MAGIC, kind, uid, gid, flags, memory_bytes or 0, nproc or 0, blob)


def decode_reply(data: bytes, fds: list[int] | None = None) -> TemplateReply:
    """The reply in `data`; `fds` (passed beside it) are closed if it is not one, else its pidfd is the first."""
    fds = fds or []
    if len(data) != REPLY.size or data[:4] != MAGIC or len(fds) > 1:
        for fd in fds:
            os.close(fd)
        raise TemplateUnavailable(f"the kernel template answered {len(data)} bytes that are not a reply")
    _, error, pid, cpu_us, children_cpu_us, threads = REPLY.unpack(data)
    return TemplateReply(error, pid, cpu_us, children_cpu_us, threads, fds[0] if fds else None)


def template_argv(command: BwrapCommand, socket_fd: int, seccomp_fd: int, *extra: str) -> list[str]:
    """bwrap as the host's root, no user namespace, every capability kept; the sandbox's read-only view."""
    args = [
        command.bwrap, "--cap-add", "ALL", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--die-with-parent", "--ro-bind", "/usr", "/usr",
    ]  # fmt: skip
    args += command.system_binds
    args += [
        "--ro-bind", str(command.env_dir), ENV_MOUNT,
        "--ro-bind", str(command.guest_dir), f"{GUEST_LIB}/coderunner_guest",
        "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", HOME, "--chdir", "/", "--clearenv",
    ]  # fmt: skip
    for key, value in sandbox_environment().items():
        args += ["--setenv", key, value]
    python = [f"{ENV_MOUNT}/bin/python", "-P", "-m", "coderunner_guest.kernel_template"]
    return [*args, "--", *python, str(socket_fd), str(seccomp_fd), *extra]


def template_unavailable() -> str | None:
    """Why this process cannot run a template (None: it can). Its forks join each sandbox's user namespace
    from outside it, which takes the capabilities of the host's root (route A, above)."""
    if os.getuid() != 0:
        return "the kernel template needs a server running as root (it joins user namespaces)"
    return None


class KernelTemplate:
    """A running template: one request at a time over its socketpair."""

    def __init__(self, process: Process, sock: socket.socket, ready: TemplateReply) -> None:
        self.process = process
        self.sock = sock
        self.ready = ready
        self._lock = anyio.Lock()

    @property
    def pid(self) -> int:
        """The template's pid on the host (its ready reply's)."""
        return self.ready.pid

    @classmethod
    async def start(
        cls, command: BwrapCommand, seccomp: bytes, *, freeze: bool = True, child_code: str | None = None,
        preload_imports: bool = True,
    ) -> KernelTemplate:  # fmt: skip
        why_not = template_unavailable()
        if why_not is not None:
            raise TemplateUnavailable(why_not)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        program = os.memfd_create("coderunner-template-seccomp", 0)
        try:
            os.write(program, seccomp)
            os.lseek(program, 0, os.SEEK_SET)
            extra = [
                *([] if freeze else ["--no-freeze"]), *([] if preload_imports else ["--no-preload"]),
                *(["--child-code", child_code] if child_code else []),
            ]  # fmt: skip
            argv = template_argv(command, theirs.fileno(), program, *extra)
            # Shielded: cancelled inside, asyncio kills the outer bwrap alone, which leaves bwrap's child blocked
            # for ever (see close); once we hold the process, a cancel below ends its whole group.
            with anyio.CancelScope(shield=True):
                process = await anyio.open_process(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None,
                    pass_fds=(theirs.fileno(), program), start_new_session=True, env={"PATH": "/usr/bin:/bin"},
                )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(program)
        template = cls(process, ours, TemplateReply(0, 0, 0, 0, 0))
        try:
            with anyio.fail_after(START_TIMEOUT_S):
                template.ready = await template._answer()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await template.close()
            raise
        return template

    async def _answer(self) -> TemplateReply:
        await anyio.wait_readable(self.sock)
        data, fds, _, _ = socket.recv_fds(self.sock, REPLY.size + 1, 1)
        if not data:
            raise TemplateUnavailable("the kernel template exited")
        return decode_reply(data, fds)

    async def _ask(self, request: bytes, fds: list[int]) -> TemplateReply:
        """One request and its reply, never parted. A cancel between them (a start whose session closed, whose
        client left) would leave the reply on the socket for the next request to read as its own: a fork handed
        another fork's pid and pidfd. So the exchange is shielded, bounded by FORK_TIMEOUT_S; a template that
        does not answer within it is ended (where the exchange stands is lost), and a caller cancelled meanwhile
        gets its cancel once the reply is in, the fd it carried closed."""
        async with self._lock:
            with anyio.CancelScope(shield=True):
                answer = await self._exchange(request, fds)
            try:
                await anyio.lowlevel.checkpoint_if_cancelled()
            except BaseException:
                if answer.pidfd is not None:
                    os.close(answer.pidfd)
                raise
            return answer

    async def _exchange(self, request: bytes, fds: list[int]) -> TemplateReply:
        with anyio.move_on_after(FORK_TIMEOUT_S):
            try:
                socket.send_fds(self.sock, [request], fds)
                return await self._answer()
            except (OSError, anyio.ClosedResourceError):  # closed meanwhile (close, _end_now)
                raise TemplateUnavailable("the kernel template is closed") from None
        self._end_now()
        raise TemplateUnavailable(f"the kernel template did not answer within {FORK_TIMEOUT_S:g}s; it was ended")

    def _end_now(self) -> None:
        """Stop asking it and kill it at once; its owner sees it exit (process.wait) and starts another."""
        self._close_socket()
        self._kill_group()

    def _close_socket(self) -> None:
        """Close its socket, an exchange waiting on it woken first (it says the template is closed)."""
        if self.sock.fileno() >= 0:
            anyio.notify_closing(self.sock)
            self.sock.close()

    def _kill_group(self) -> None:
        """Kill its whole process group (start_new_session: bwrap, bwrap's child, the template; a fork leaves it as
        it enters a sandbox). The outer bwrap alone is not enough: killed within its first milliseconds, it left
        its child blocked for ever on the eventfd it waits on before it runs anything (no die-with-parent yet).
        Its pid names the group for sure while it is not reaped."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)

    async def counters(self) -> TemplateReply:
        return await self._ask(encode_request(KIND_COUNTERS), [])

    async def give_plan(self, addresses: list[int]) -> int:
        """Hand the template the pages its forks copy ahead (guest/page_plan.py), as a sealed memfd of
        little-endian u64 addresses; how many it kept (it keeps only its own, at most page_plan.MAX_PAGES)."""
        plan = os.memfd_create("coderunner-template-plan", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.write(plan, b"".join(address.to_bytes(8, "little") for address in addresses))
            fcntl.fcntl(
                plan,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE,
            )
            answer = await self._ask(encode_request(KIND_PLAN), [plan])
        finally:
            os.close(plan)
        if answer.error:
            raise TemplateUnavailable(f"the kernel template refused a page plan: {os.strerror(answer.error)}")
        return answer.pid

    async def begin_fork(
        self,
        sandbox: SandboxProcess,
        spec: SandboxSpec,
        output_fd: int,
        *,
        nproc: int | None = None,
        status_fd: int | None = None,
    ) -> PendingFork:
        """A fork made into `sandbox`'s pid namespace and cgroups (built from `spec`, with no program of its own;
        bwrap may still build it) that waits for finish_fork; raises TemplateUnavailable if the template could not
        make it. Its limits and environment are the ones bwrap_argv gives; `status_fd` (a pipe's write end) gets its
        wait status once the template reaped it."""
        hold = sandbox.hold
        if not isinstance(hold, BwrapHold) or hold.init is None:
            raise TemplateUnavailable("this sandbox has no pid 1 handle to enter by")
        memory = spec.limits.memory_mb * 2**20 if spec.limits.memory_mb is not None else None
        soft = sandbox.cgroup is not None and "memory" in sandbox.cgroup.dirs and memory is not None
        try:
            request = encode_request(
                KIND_FORK, uid=SANDBOX_UID, gid=SANDBOX_GID, memory_bytes=memory, memory_soft_only=soft, nproc=nproc,
                environment=sandbox_environment(spec_environment(spec)), status_fd=status_fd is not None,
            )  # fmt: skip
        except ValueError as exc:
            raise TemplateUnavailable(str(exc)) from None
        cgroup_fds: list[int] = []
        go_read, go_write = os.pipe2(os.O_CLOEXEC)
        report_read, report_write = os.pipe2(os.O_CLOEXEC)
        try:
            if sandbox.cgroup is not None:
                cgroup_fds = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in sandbox.cgroup.join_files()]
            status = [status_fd] if status_fd is not None else []
            answer = await self._ask(request, [hold.init, output_fd, go_read, report_write, *status, *cgroup_fds])
        except BaseException:
            for fd in (go_write, report_read):
                os.close(fd)
            raise
        finally:
            for fd in (go_read, report_write, *cgroup_fds):  # the fork holds its own
                os.close(fd)
        pending = PendingFork(answer, go_write, report_read)
        if answer.error:
            pending.abandon()
            raise TemplateUnavailable(
                f"the kernel template could not fork into its sandbox: {os.strerror(answer.error)}"
            )
        return pending

    async def finish_fork(self, pending: PendingFork) -> TemplateReply:
        """Say "go" to a fork from begin_fork (its sandbox is finished now) and wait, bounded by FORK_TIMEOUT_S, for
        it to say it entered and confined itself; its reply (the caller closes the pidfd). On any failure, or a
        cancel, the fork is ended (the end of "go", or a SIGKILL by its pidfd) and TemplateUnavailable says why."""
        try:
            with contextlib.suppress(BrokenPipeError):  # it exited already: its report's end says so
                os.write(pending.go, b"1")
            with anyio.move_on_after(FORK_TIMEOUT_S) as waiting:
                await anyio.wait_readable(pending.report)
            said = None if waiting.cancelled_caught else os.read(pending.report, REPORT.size)
            error = REPORT.unpack(said)[0] if said is not None and len(said) == REPORT.size else None
            if error != 0:
                if said is None:
                    why = f"it did not say it was confined within {FORK_TIMEOUT_S:g}s"
                elif error is None:
                    why = "it exited before it said it was confined (its output says why)"
                else:
                    why = os.strerror(-error)
                if pending.reply.pidfd is not None:
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(pending.reply.pidfd, signal.SIGKILL)
                raise TemplateUnavailable(f"a fork of the kernel template could not enter its sandbox: {why}")
        except BaseException:
            pending.abandon()
            raise
        answer = pending.reply
        pending.reply = dataclasses.replace(answer, pidfd=None)  # the caller's now
        pending.abandon()
        return answer

    async def spawn_entered(
        self,
        backend: BwrapBackend,
        spec: SandboxSpec,
        task_group: TaskGroup,
        output_fd: int,
        *,
        status_fd: int | None = None,
    ) -> tuple[SandboxProcess, TemplateReply]:
        """A sandbox built by `backend` as today around no program (HOLD; PLACEHOLDER behind an allowlist's forwarder),
        entered by a fork of this template (its stdout
        and stderr `output_fd`; `status_fd`: see begin_fork) made while bwrap builds it and let in once it is
        finished, with the RLIMIT_NPROC the backend gives a cold kernel where there are no cgroups; the sandbox is
        killed if the fork could not enter."""
        nproc = backend.nproc_limit(spec)  # counted before the sandbox starts, as a cold start counts it
        program = PLACEHOLDER if spec.network == NetworkMode.ALLOWLIST else HOLD
        sandbox = await backend.spawn(spec, program, task_group, pipes=True)
        pending: PendingFork | None = None
        try:
            hold = sandbox.hold
            if isinstance(hold, BwrapHold) and hold.init is not None:  # else bwrap failed: its stdout says why
                pending = await self.begin_fork(sandbox, spec, output_fd, nproc=nproc, status_fd=status_fd)
            with anyio.fail_after(FORK_TIMEOUT_S):
                said = await sandbox.streams[1].receive()
            if not said.startswith(b"ready"):
                raise TemplateUnavailable(f"the sandbox said {said[:100]!r}, not that it is ready")
            if pending is None:
                pending = await self.begin_fork(sandbox, spec, output_fd, nproc=nproc, status_fd=status_fd)
            return sandbox, await self.finish_fork(pending)
        except BaseException:
            if pending is not None:
                pending.abandon()
            with anyio.CancelScope(shield=True):
                await sandbox.kill()
            raise

    async def close(self) -> None:
        """End the template (its kernels live on in their sandboxes; their sandboxes end them). Shielded and
        bounded: a close cancelled half-way would leave the template running."""
        self._close_socket()
        with anyio.CancelScope(shield=True):
            if self.ready.pid:  # a ready template ends on its own once it reads its socket's end; one warming up
                with anyio.move_on_after(5):  # is busy importing for seconds more: it is killed at once
                    await self.process.wait()
            if self.process.returncode is None:
                self._kill_group()
                await self.process.wait()
