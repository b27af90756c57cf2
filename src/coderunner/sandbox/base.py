"""The backend base class: what every backend (bwrap, podman, Apple `container`, ...) provides.

A backend turns a `SandboxSpec` plus a command into a running, isolated process tree that
the host can wait on and kill. The kernel code never learns which backend it runs on: it asks
only what a backend declares (its channels, its network modes, its checkpointer or None).

One idea: what a backend is to the rest of the server: its declarations, its spawn, and the running sandbox.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import signal
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream, Process, TaskGroup

from coderunner.errors import CodeRunnerError
from coderunner.offload import off_loop
from coderunner.sandbox.cgroups import CgroupsUnavailable, SessionCgroup
from coderunner.sandbox.engine import EngineError
from coderunner.sandbox.identity import sandbox_identity
from coderunner.vocabulary.host_identity import HostIdentity, IdentityError
from coderunner.vocabulary.mounts import Mount
from coderunner.vocabulary.network import MODES as NETWORK_MODES
from coderunner.vocabulary.network import NetworkMode

if TYPE_CHECKING:
    from coderunner.config import Settings

#: How much of a sandbox's own stderr (bwrap errors, kernel crash text) is kept for error messages.
STDERR_TAIL_BYTES = 16 * 1024
#: Bound on waiting for a killed sandbox to be reaped.
KILL_WAIT_S = 5.0


class SandboxUnavailable(CodeRunnerError):
    """The chosen backend cannot work here; the message says how to fix it."""


def backend_identity(settings: Settings) -> HostIdentity | None:
    """The host user sandboxes run as (settings.sandbox_user), for a backend's builder."""
    try:
        return sandbox_identity(settings.sandbox_user)
    except IdentityError as exc:
        raise SandboxUnavailable(str(exc)) from None


@contextlib.contextmanager
def start_failures(backend: str) -> Iterator[None]:
    """The backend seam: what starting a sandbox meets from below (the OS, an engine, the cgroup tree)
    reaches callers as SandboxUnavailable, the one caller-facing error of a backend."""
    try:
        yield
    except (OSError, EngineError, CgroupsUnavailable) as exc:
        detail = str(exc) or type(exc).__name__  # a bare TimeoutError says nothing by itself
        raise SandboxUnavailable(f"could not start the {backend} sandbox: {detail}") from exc


@dataclass(frozen=True)
class Limits:
    """Resource limits asked for one session. `None` means no limit."""

    memory_mb: int | None = None
    cpus: float | None = None
    pids: int | None = None
    disk_mb: int | None = None
    tmp_mb: int | None = None


@dataclass(frozen=True)
class LimitReport:
    """A limit and how (or whether) this backend enforces it, so status tells the truth."""

    value: float | None
    enforced_by: str | None


@dataclass(frozen=True)
class SandboxSpec:
    """Everything one sandbox needs from the host side (see session_dirs.py for the layout).

    `runtime_dir` is the sandbox's own writable dir, bound at the same path inside and outside:
    the kernel binds its ipc:// sockets there. `host_dir` holds what the host wrote for it
    (etc files, connection files, one-shot inputs) and is bound read-only at the same path.
    `user` is the host user it runs as, when that is not the server's own.
    """

    name: str
    workspace: Path
    runtime_dir: Path
    host_dir: Path
    limits: Limits = field(default_factory=Limits)
    network: str = "none"
    mounts: tuple[Mount, ...] = ()
    user: HostIdentity | None = None
    #: Network 'none': why nothing installs there and where it can (the user's ceiling's way out); the
    #: kernel's %pip says it at once rather than letting pip retry (sandbox/common.py spec_environment).
    install_refusal: str | None = None
    #: Files this one sandbox sees, read-only (path inside -> content), where the backend has
    #: `private_files`: a kernel's connection key, which no other sandbox of its session may read.
    private_files: tuple[tuple[str, bytes], ...] = ()

    @property
    def owner(self) -> tuple[int, int] | None:
        return (self.user.uid, self.user.gid) if self.user is not None else None

    @property
    def etc_dir(self) -> Path:
        return self.host_dir / "etc"

    def twin(self) -> SandboxSpec:
        """The same sandbox under its session's other name (see twin_name): a second kernel of one
        session (its standby) must not share the first's cgroup, which a kill removes whole."""
        return replace(self, name=twin_name(self.name))


#: What a session's second sandbox name ends with.
TWIN_SUFFIX = "-b"


def twin_name(name: str) -> str:
    """A session's other sandbox name: `name` + TWIN_SUFFIX, and back. Two kernels of a session may run
    at once (the live one and its standby), each under one of the two."""
    return name.removesuffix(TWIN_SUFFIX) if name.endswith(TWIN_SUFFIX) else name + TWIN_SUFFIX


class KernelChannels(StrEnum):
    """How the host reaches a kernel: ipc sockets in the runtime dir (seen at the same path inside, or
    relayed into a VM), or tcp ports the backend publishes on 127.0.0.1. A StrEnum: equal to its name,
    so the settings' strings ("ipc", "tcp") stay what they were."""

    IPC = "ipc"
    TCP = "tcp"

    @classmethod
    def chosen(cls, setting: str, auto: KernelChannels) -> KernelChannels:
        """The `kernel_channels` setting, with "auto" meaning the backend's own choice `auto`."""
        return auto if setting == "auto" else cls(setting)


class Checkpointer(ABC):
    """Saves a live sandbox whole (memory, threads, open files) and starts a copy of it: what a backend
    that can (gvisor) offers as `SandboxBackend.checkpointer`; the rest offer None."""

    @abstractmethod
    def key(self) -> str:
        """What a checkpoint depends on (a restore needs the same): recorded with every memory snapshot."""

    @abstractmethod
    def image_owner(self, image_dir: Path) -> tuple[int, int] | None:
        """The host (uid, gid) a checkpoint's processes keep: its restored copy must run as them."""

    @abstractmethod
    async def checkpoint(self, process: SandboxProcess, image_dir: Path, timeout_s: float) -> None:
        """Save `process`'s sandbox into `image_dir` (an empty host-only dir); it has ended afterwards.
        Raises SandboxUnavailable (a subclass) saying what went wrong."""

    @abstractmethod
    async def restore(
        self, spec: SandboxSpec, image_dir: Path, task_group: TaskGroup, timeout_s: float
    ) -> SandboxProcess:
        """A new sandbox from `spec` running the checkpoint in `image_dir`; nothing runs on failure."""


class SandboxBackend(ABC):
    """One way of isolating a process tree: what a backend declares, and a spawn written once.

    A backend says which network modes it can give at all (`network_modes`; `refusal` words the
    rest), what this machine lacks for the ones it can (`mode_problem`), how the host reaches its
    kernels (`channels`) and whether it checkpoints (`checkpointer`). `spawn` checks the network and
    translates start failures the same way for every backend; `start` is each backend's own part.
    """

    name: str
    #: Where the session workspace appears inside the sandbox.
    workspace_path: str
    #: The Python interpreter of the sandbox environment, as seen inside.
    python: str
    #: Mode for parents of session dirs (passable by the sandbox's host user).
    dir_mode: int
    #: A host user of the kind sandboxes run as when it is not the server's own (for reachability
    #: checks of what gets bound in), else None. Each sandbox's own is in its SandboxSpec.
    identity: HostIdentity | None
    #: How the host reaches this backend's kernels.
    channels: KernelChannels = KernelChannels.IPC
    #: The network modes this backend can give at all; `refusal` says why not for the others.
    network_modes: ClassVar[frozenset[NetworkMode]] = frozenset(NetworkMode)
    #: Why this backend cannot run one-shot programs (spawn with pipes), or None when it can.
    pipes_refusal: ClassVar[str | None] = None
    #: How start failures name the backend ("could not start the ... sandbox"); None: its name.
    start_label: ClassVar[str | None] = None
    #: The error this backend's refusals raise (a SandboxUnavailable).
    unavailable: ClassVar[type[SandboxUnavailable]] = SandboxUnavailable
    #: Saves and restores a live sandbox whole, or None where this backend cannot.
    checkpointer: Checkpointer | None = None
    #: Whether spawn honours SandboxSpec.private_files (a file no other sandbox sees). A session keeps a
    #: standby kernel only where it does: the live kernel must not read the standby's key.
    private_files: ClassVar[bool] = False
    #: Starts kernels from a warm template instead of from nothing (bwrap with the `kernel_template` setting:
    #: sandbox/template_kernels.py), or None; `no_kernel_starter` says why not, for a session's status (None:
    #: nothing is said, as when the setting is off).
    kernel_starter: KernelStarter | None = None
    no_kernel_starter: str | None = None

    @abstractmethod
    def describe_isolation(self) -> str:
        """One line for status and capabilities: what separates the sandbox from the host."""

    @abstractmethod
    def host_dir_inside(self, spec: SandboxSpec) -> str:
        """Where the sandbox sees `spec.host_dir` (read-only): files the host staged for it."""

    @abstractmethod
    def limit_reports(self, limits: Limits) -> dict[str, LimitReport]:
        """How each limit in `limits` is enforced by this backend on this machine."""

    def live_limits_problem(self) -> str | None:
        """Why this backend cannot lower a running sandbox's limits (None: `lower_limits` can); a warm pool's
        sandbox is then taken only by a create asking for the limits it was started with."""
        return f"the {self.name} backend sets a sandbox's limits only when it starts"

    def lower_limits(self, process: SandboxProcess, built: Limits, asked: Limits) -> None:
        """Lower the running `process`'s limits from `built` to `asked` (blocking: async code calls it through
        off_loop). Raises this backend's SandboxUnavailable where it cannot: by default, always."""
        raise self.unavailable(self.live_limits_problem() or "this sandbox's limits cannot be changed")

    def close_starts(self) -> None:  # noqa: B027  (most backends hold nothing for their starts)
        """Let go of what the host holds for this backend's starts (bwrap's start namespace); blocking. A later
        start makes it again. A server's manager calls it as it ends, after its sessions are closed."""

    @abstractmethod
    def remove_stale(self, name: str) -> None:
        """Remove what a dead server left for the sandbox `name` outside its dirs (e.g. cgroups)."""

    def network_problem(self, network: str) -> str | None:
        """Why network mode `network` cannot be had with this backend here, or None."""
        if network not in NETWORK_MODES:
            return f"unknown network mode {network!r}: use 'none', 'allowlist' or 'internet'"
        mode = NetworkMode(network)
        if mode not in self.network_modes:
            return self.refusal(mode)
        return self.mode_problem(mode)

    def refusal(self, mode: NetworkMode) -> str:
        """Why this backend never gives `mode` (one not in network_modes), and what to use instead."""
        return f"network {mode.value!r} is not available with the {self.name} backend"

    def mode_problem(self, mode: NetworkMode) -> str | None:
        """What this machine or configuration lacks for `mode` (one of network_modes), or None."""
        return None

    async def spawn(
        self, spec: SandboxSpec, argv: list[str], task_group: TaskGroup, *, pipes: bool = False
    ) -> SandboxProcess:
        """Start `argv` (paths as seen inside) in a fresh sandbox built from `spec`.

        With `pipes`, the program's stdin, stdout and stderr are pipes the caller reads and
        writes (one-shot runs); otherwise stdin and stdout are /dev/null and stderr is kept as
        a bounded tail for error messages (kernels, whose channels are ZMQ sockets).
        Raises SandboxUnavailable only: what starting meets from below is translated here.
        """
        with start_failures(self.start_label or self.name):
            if pipes and self.pipes_refusal is not None:
                raise self.unavailable(self.pipes_refusal)
            if (problem := self.network_problem(spec.network)) is not None:
                raise self.unavailable(problem)
            if spec.private_files and not self.private_files:
                raise self.unavailable("this backend cannot give a sandbox files of its own")
            return await self.start(spec, argv, task_group, pipes=pipes)

    @abstractmethod
    async def start(self, spec: SandboxSpec, argv: list[str], task_group: TaskGroup, *, pipes: bool) -> SandboxProcess:
        """The backend's own part of spawn, once the network mode is known to be possible here."""


class KernelStarter(Protocol):
    """Starts a kernel in a sandbox built from a spec some other way than running its argv (a fork of a warm
    template): opened by a SessionManager (it becomes its backend's `kernel_starter`), closed with it."""

    def open(self, task_group: TaskGroup) -> None:
        """Start what it needs in the background of `task_group`, and be the backend's kernel_starter."""

    async def close(self) -> None:
        """End it; kernels start cold from then on."""

    async def settled(self) -> None:
        """Return once a start of what it needs is no longer under way (ready, or failed: kernels then start
        cold): a start nobody waits for (the warm pool's) waits for it rather than start cold beside it."""

    async def spawn_kernel(self, spec: SandboxSpec, task_group: TaskGroup) -> SandboxProcess:
        """A kernel in a sandbox built from `spec`; raises SandboxUnavailable saying why not (it then starts cold)."""

    def stale_imports(self, sandbox: SandboxProcess) -> str | None:
        """Why a kernel it started, now exited, ended before it ran anything: what it carried in (the template's
        imports) was not what its own imports would find in its sandbox, so a cold kernel starts instead; None
        when it ended for any other reason."""

    def wants_pages_from(self, sandbox: SandboxProcess) -> bool:
        """Whether a kernel it started is one to learn from (learn_pages): a cheap test, asked before the server
        runs the cell the lesson needs."""

    async def learn_pages(self, sandbox: SandboxProcess) -> None:
        """Learn what its later starts can do ahead from a kernel it started that has run only the server's own
        cells (the template: which of its pages a kernel's start copies); best effort, never raises."""


class SandboxHold(Protocol):
    """A backend's handles on a sandbox that nothing inside it can change (bwrap: pidfds of its pid 1 and
    of its outer process): `kill` ends the sandbox whole, `release` lets go once it is reaped."""

    def kill(self) -> None: ...

    def release(self) -> None: ...


#: The exit code of a sandbox that is not this process's child (PidfdProcess): never known here.
UNKNOWN_EXIT = -1


class PidfdProcess:
    """A sandbox's outer process that another (dead) process spawned, known by a pidfd alone (sandbox/handover.py):
    what SandboxProcess reads of a process (its pid, whether and when it ended). Never signalled by pid: the
    sandbox's hold ends it by its pidfds."""

    #: No pipes: its stdin, stdout and stderr were the dead process's.
    stdin = stdout = stderr = None

    def __init__(self, pidfd: int, pid: int) -> None:
        self._pidfd = os.dup(pidfd)
        self._ended = False
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        """None while it runs; UNKNOWN_EXIT once it ended (its parent reaped it, not this process)."""
        if not self._ended and self._pidfd >= 0:
            poller = select.poll()  # not select(): an agent holding hundreds of sandboxes has fds past 1024
            poller.register(self._pidfd, select.POLLIN)
            self._ended = bool(poller.poll(0))  # a pidfd reads ready once its process exited
        return UNKNOWN_EXIT if self._ended or self._pidfd < 0 else None

    async def wait(self) -> int:
        if self.returncode is None:
            await anyio.wait_readable(self._pidfd)
            self._ended = True
        return UNKNOWN_EXIT

    async def aclose(self) -> None:
        """Let go of its pidfd once it ended (until then, what says whether it did)."""
        if self.returncode is not None and self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


class SandboxProcess:
    """A running sandbox as a host process: wait for it, kill it, read what it said on stderr."""

    def __init__(
        self,
        process: Process | PidfdProcess,
        task_group: TaskGroup,
        cgroup: SessionCgroup | None = None,
        helpers: list[Process] | None = None,
        pipes: bool = False,
    ) -> None:
        self._process = process
        self._stderr_tail: collections.deque[bytes] = collections.deque()
        self._stderr_size = 0
        self._stderr_done = anyio.Event()
        self.cgroup = cgroup
        #: Processes serving this sandbox from outside (e.g. its user-mode network stack).
        self.helpers = helpers or []
        self._oom_kills_at_start = cgroup.oom_kills() if cgroup else 0
        #: Set by a backend that ends its sandboxes by handles of its own (bwrap: the pid 1's pidfd).
        self.hold: SandboxHold | None = None
        #: The exit code of a program that is not the sandbox's own child (a kernel forked into it from a
        #: template), once it exited: what returncode says from then on (the sandbox is ended after it).
        self._program_exit: int | None = None
        #: That program's host pid (its process tree is not the sandbox's process's: memory counts both).
        self.program_pid: int | None = None
        #: That program's pidfd and its output pipe's read end, while it is followed: what a successor is handed
        #: to follow it (sandbox/handover.py).
        self.program_fds: tuple[int, int] | None = None
        #: Set once kill() began.
        self.ending = False
        #: Set once the first kill() ended: any later one waits for it (see kill).
        self._killed: anyio.Event | None = None
        self._task_group = task_group
        if process.stderr is not None and not pipes:
            task_group.start_soon(self._drain_stderr, process.stderr)
        else:
            self._stderr_done.set()

    @property
    def streams(self) -> tuple[ByteSendStream, ByteReceiveStream, ByteReceiveStream]:
        """stdin, stdout and stderr of a sandbox spawned with pipes."""
        process = self._process
        assert process.stdin and process.stdout and process.stderr, "spawned without pipes"
        return process.stdin, process.stdout, process.stderr

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._program_exit if self._program_exit is not None else self._process.returncode

    def program_exited(self, code: int) -> None:
        """The sandbox's program, which is not its own child (a forked kernel), exited with `code`."""
        self._program_exit = code

    def keep_stderr_of(self, stream: ByteReceiveStream) -> None:
        """Keep the tail of `stream` as this sandbox's stderr (a forked kernel's output pipe)."""
        self._stderr_done = anyio.Event()
        self._task_group.start_soon(self._drain_stderr, stream)

    @property
    def alive(self) -> bool:
        return self._process.returncode is None

    def oom_killed(self) -> bool:
        """Did the kernel's OOM killer strike inside this sandbox's memory cgroup?"""
        return self.cgroup is not None and self.cgroup.oom_kills() > self._oom_kills_at_start

    def memory_used_mb(self) -> float | None:
        if self.cgroup is not None and (used := self.cgroup.memory_bytes()) is not None:
            return round(used / 2**20, 1)
        return None

    def stderr_tail(self) -> str:
        return b"".join(self._stderr_tail).decode("utf-8", "replace")

    async def stderr_settled(self, timeout_s: float = 1.0) -> str:
        """The stderr tail once the pipe has reached its end (bounded): an exit is often seen
        before the last words written just before it have been read."""
        with anyio.move_on_after(timeout_s):
            await self._stderr_done.wait()
        return self.stderr_tail()

    async def _drain_stderr(self, stream: ByteReceiveStream) -> None:
        """Keep only the last STDERR_TAIL_BYTES: a sandbox may write without end."""
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            async for chunk in stream:
                self._stderr_tail.append(chunk)
                self._stderr_size += len(chunk)
                while self._stderr_size > STDERR_TAIL_BYTES and len(self._stderr_tail) > 1:
                    self._stderr_size -= len(self._stderr_tail.popleft())
        self._stderr_done.set()

    async def wait(self) -> int:
        code = await self._process.wait()
        return self._program_exit if self._program_exit is not None else code

    def take_cgroup(self) -> SessionCgroup | None:
        """Its cgroup, which the caller now removes (kill() leaves it): a one-shot run replies first.
        Its limits hold until then over whatever of the sandbox has not exited yet."""
        cgroup, self.cgroup = self.cgroup, None
        return cgroup

    async def kill(self) -> None:
        """Kill the whole sandbox and reap it, within KILL_WAIT_S.

        Done once: a second call (a kernel's restart after the relay of its exit began the kill) waits for
        the first to end. Otherwise it could return while the first still removed the session's cgroup by
        its name, which the next sandbox then makes again and the first's removal kills. Shielded (each
        step is bounded), so a cancelled first call does not leave later ones nothing to wait for but
        half a teardown."""
        if self._killed is not None:
            await self._killed.wait()
            return
        self._killed = anyio.Event()
        try:
            with anyio.CancelScope(shield=True):
                await self._kill()
        finally:
            self._killed.set()

    async def _kill(self) -> None:
        self.ending = True
        if self.hold is not None:
            self.hold.kill()  # first: whatever runs inside, its pid namespace ends with its pid 1
        if self._process.returncode is None and not isinstance(self._process, PidfdProcess):
            with contextlib.suppress(ProcessLookupError):
                # The process the host started, in its own process group (start_new_session): an
                # engine client or the outer bwrap. What runs inside ends by the backend's own
                # handle (the hold, above) or with that process (engines end their containers).
                # Not Process.kill() besides: it polls (waitpid WNOHANG) on the event loop's thread, which reaped
                # a process that had just exited before asyncio's watcher could, so its exit code read 255
                # ("Unknown child process pid N" in the log; traced with wait4 events under load).
                os.killpg(self._process.pid, signal.SIGKILL)
        with anyio.move_on_after(KILL_WAIT_S):  # kill() shields the whole: each step has its own bound
            await self._process.wait()
        with contextlib.suppress(Exception):
            await self._process.aclose()
        for helper in self.helpers:
            with contextlib.suppress(ProcessLookupError):
                helper.kill()
            with anyio.move_on_after(KILL_WAIT_S), contextlib.suppress(Exception):
                await helper.aclose()  # reaped and its transport closed, as the sandbox's own process above
        if self.cgroup is not None:
            # In a worker thread: the removal waits (up to cgroups.REMOVE_WAIT_S) for the last tasks
            # to exit, which must not block the event loop. Awaited, not left to a thread of its own:
            # the session's next kernel makes a cgroup of the same name, which this must not meet.
            await off_loop(self.cgroup.remove)
        if self.hold is not None:
            self.hold.release()
