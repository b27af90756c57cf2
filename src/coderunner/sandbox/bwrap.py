"""The bubblewrap backend: the Linux default, no daemon.

Each sandbox gets new user, pid, network, ipc, uts and cgroup namespaces, a seccomp filter, a
read-only root made of /usr and the sandbox Python environment, size-capped /tmp and /dev/shm,
and exactly two host folders: its own workspace (writable) and its own runtime dir (kernel
sockets, same path inside). Where the server may create cgroups, the whole sandbox runs in
per-session memory, pids and cpu cgroups. Network mode `internet` attaches a user-mode network
stack (slirp4netns) that cannot reach the host's loopback.

One idea: a sandbox built by bubblewrap, from its spec to a held, running process (its argv is bwrap_argv.py's).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup

from coderunner.hostfs.private_dirs import ensure_private_dir
from coderunner.offload import off_loop
from coderunner.sandbox import init_binary
from coderunner.sandbox.base import (
    KernelChannels,
    LimitReport,
    Limits,
    SandboxBackend,
    SandboxProcess,
    SandboxSpec,
    SandboxUnavailable,
    backend_identity,
    twin_name,
)
from coderunner.sandbox.build_slots import BUILT_WAIT_S, build_slots, wait_built
from coderunner.sandbox.bwrap_argv import GUEST_SOURCE, BwrapCommand, root_files
from coderunner.sandbox.bwrap_fds import StartFds, read_json_document
from coderunner.sandbox.bwrap_watch import process_watch
from coderunner.sandbox.cgroups import CgroupManager, CgroupsUnavailable, SessionCgroup
from coderunner.sandbox.common import ENV_MOUNT
from coderunner.sandbox.identity import shared_dir_mode
from coderunner.sandbox.live_limits import cgroup_limits, lower_limits
from coderunner.sandbox.pid1 import NotOurChild, SandboxHold, gated_command, open_child
from coderunner.sandbox.seccomp import SeccompUnavailable, compiled_filter
from coderunner.sandbox.start_namespace import Staged, StartNamespace, StartNamespaceUnavailable
from coderunner.vocabulary.host_identity import HostIdentity, IdentityError
from coderunner.vocabulary.network import NetworkMode
from coderunner.vocabulary.sandbox_layout import WORKSPACE

if TYPE_CHECKING:
    from coderunner.config import Settings

__all__ = ["BwrapBackend", "BwrapCommand", "BwrapUnavailable", "build", "install_guest"]

log = logging.getLogger(__name__)

#: Bound on bwrap reporting its child (its pid 1) once let go.
HOLD_TIMEOUT_S = 30.0
#: Bound on slirp4netns reporting the network is up.
NETWORK_SETUP_TIMEOUT_S = 10.0
#: Bound on waiting for bwrap's child to set up its loopback before slirp4netns starts.
LOOPBACK_WAIT_S = 3.0
#: Bound on compiling the guest package once at start.
GUEST_COMPILE_TIMEOUT_S = 60


#: What installs bubblewrap (its refusal, doctor, the registry entry).
INSTALL_HINT = "sudo apt-get install bubblewrap"


class BwrapUnavailable(SandboxUnavailable):
    """bubblewrap is missing or cannot create namespaces here."""


def build(settings: Settings) -> BwrapBackend:
    """The registry's builder: a bwrap backend as the settings say."""
    backend = BwrapBackend(
        settings.sandbox_env,
        runtime_base=settings.runtime_dir,
        identity=backend_identity(settings),
        use_cgroups=settings.cgroups,
        workspaces_dir=settings.workspaces_dir,
        use_start_namespace=settings.start_namespace,
        use_compiled_init=settings.compiled_init,
    )
    if backend.cgroups is not None:
        backend.cgroups.cpu_weight = settings.session_cpu_weight
    return backend


def install_guest(runtime_base: Path, python: Path | None = None) -> Path:
    """Copy the guest package under the runtime dir, named by its content hash.

    A copy, not the package dir itself: the sandbox user must be able to reach it (the package
    may sit under /root), and a server of another version may share the runtime dir. `python`
    (the sandbox's) compiles it there once: the sandbox cannot write bytecode, so without this
    every sandbox would compile what it imports (a one-shot's launcher, a kernel's extension).
    """
    files = sorted(path for pattern in ("*.py", "*.cjs") for path in GUEST_SOURCE.glob(pattern))
    digest = hashlib.sha256(b"".join(path.name.encode() + path.read_bytes() for path in files)).hexdigest()[:12]
    target = runtime_base / f"guest-{digest}"
    with _installing:
        if not target.is_dir():
            _install_guest(files, target, python)
    return target


#: One install at a time in a process: two sandbox starts may both find the copy gone (_keep_guest).
_installing = threading.Lock()


def _install_guest(files: list[Path], target: Path, python: Path | None) -> None:
    """Copy `files` to a fresh staging dir beside `target`, compile them, and rename it into place."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        os.chmod(staging, 0o755)  # whatever the umask: every sandbox user reads it
        for path in files:
            shutil.copyfile(path, staging / path.name)
            os.chmod(staging / path.name, 0o644)
        if python is not None:
            _compile_guest(python, staging)
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another server got there first, or the copy failed
        if not target.is_dir():
            raise


def _compile_guest(python: Path, folder: Path) -> None:
    """Bytecode for the guest's modules, made by the sandbox's interpreter (its version's tag)."""
    try:
        subprocess.run([str(python), "-m", "compileall", "-q", str(folder)], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=GUEST_COMPILE_TIMEOUT_S, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not precompile the guest package (sandboxes will compile it): %s", exc)
        return
    for path in folder.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def _memfd(name: str, data: bytes) -> int:
    """An fd a child inherits to read `data` from its start (a seccomp filter, a private file)."""
    fd = os.memfd_create(name, 0)
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _count_tasks(uid: int) -> int:
    """Tasks (threads count) of `uid`: RLIMIT_NPROC counts them all, not just the sandbox's."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
    return count


class BwrapBackend(SandboxBackend):
    """Sandboxes made with bubblewrap (Debian/Ubuntu package `bubblewrap`)."""

    name = "bwrap"
    private_files = True
    workspace_path = WORKSPACE
    python = f"{ENV_MOUNT}/bin/python"
    channels = KernelChannels.IPC
    unavailable = BwrapUnavailable

    def __init__(
        self,
        env_dir: Path,
        runtime_base: Path,
        identity: HostIdentity | None = None,
        bwrap: str | None = None,
        use_cgroups: bool = True,
        workspaces_dir: Path | None = None,
        use_start_namespace: bool = True,
        use_compiled_init: bool = True,
    ) -> None:
        found = bwrap or shutil.which("bwrap")
        if found is None:
            raise BwrapUnavailable(f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}")
        if not (env_dir / "bin" / "python").exists():
            raise BwrapUnavailable(
                f"the sandbox Python environment {env_dir} is missing: run `coderunner setup` (or ./install.sh)"
            )
        try:
            self.seccomp_filter = compiled_filter()
        except SeccompUnavailable as exc:
            raise BwrapUnavailable(str(exc)) from None
        self.identity = identity
        self.dir_mode = shared_dir_mode(identity)
        ensure_private_dir(runtime_base, self.dir_mode)
        guest_dir = install_guest(runtime_base, env_dir / "bin" / "python")
        if identity is not None:
            try:
                identity.check_reachable(env_dir / "bin" / "python")
                identity.check_reachable(guest_dir)
            except IdentityError as exc:
                raise BwrapUnavailable(str(exc)) from None
        #: The compiled pid 1 where `coderunner setup` built this guest's (init_binary.py); else the Python one.
        init = init_binary.installed(env_dir) if use_compiled_init else None
        self.command = BwrapCommand(bwrap=found, env_dir=env_dir, guest_dir=guest_dir, init_binary=init)
        self._guest_source = (runtime_base, env_dir / "bin" / "python")
        self.cgroups: CgroupManager | None = None
        self.cgroup_problem: str | None = "disabled in the configuration"
        if use_cgroups:
            try:
                self.cgroups = CgroupManager.detect()
                self.cgroup_problem = None
            except (CgroupsUnavailable, OSError) as exc:
                self.cgroup_problem = str(exc)
        self.slirp4netns = shutil.which("slirp4netns")
        self._runtime_base = runtime_base
        self._workspaces_dir = workspaces_dir
        #: Where a root server's bwrap starts (start_namespace.py): made at the first start; False once it
        #: could not be (then the host's, as without root).
        self._start_namespace: StartNamespace | bool | None = None
        #: Off: every start in the host's namespace (the setting; a bench's comparison lane).
        self.use_start_namespace = use_start_namespace
        self._start_namespace_lock = threading.Lock()

    def host_dir_inside(self, spec: SandboxSpec) -> str:
        """The host-only dir is bound read-only at its own path."""
        return str(spec.host_dir)

    def describe_isolation(self) -> str:
        cgroups = f"cgroup v{self.cgroups.version} limits" if self.cgroups else "rlimits only (no cgroups)"
        user = f"; runs as {self.identity.name} on the host" if self.identity else ""
        return (
            "bubblewrap: own user/pid/net/ipc/uts/cgroup namespaces, seccomp filter, no capabilities, "
            f"read-only root (/usr + sandbox env), size-capped /tmp, only the session workspace writable; "
            f"{cgroups}{user}"
        )

    def limit_reports(self, limits: Limits) -> dict[str, LimitReport]:
        cg = f"cgroup v{self.cgroups.version}" if self.cgroups else None
        memory = "RLIMIT_AS" + (f" + {cg} memory" if cg else "")
        pids = f"{cg} pids.max" if cg else "RLIMIT_NPROC"
        return {
            "memory_mb": LimitReport(limits.memory_mb, memory if limits.memory_mb else None),
            "cpus": LimitReport(limits.cpus, f"{cg} cpu quota" if cg and limits.cpus else None),
            "pids": LimitReport(limits.pids, pids if limits.pids else None),
            "tmp_mb": LimitReport(limits.tmp_mb, "tmpfs size" if limits.tmp_mb else None),
        }

    def mode_problem(self, mode: NetworkMode) -> str | None:
        if mode is NetworkMode.INTERNET and self.slirp4netns is None:
            return "network mode 'internet' needs slirp4netns: sudo apt-get install slirp4netns"
        return None

    def remove_stale(self, name: str) -> None:
        if self.cgroups is not None:
            for each in (name, twin_name(name)):  # the session's standby kernel ran under the other
                self.cgroups.remove_named(each)

    async def start(self, spec: SandboxSpec, argv: list[str], task_group: TaskGroup, *, pipes: bool) -> SandboxProcess:
        # mkdirs and writes in cgroupfs (and, on a failure, a removal that may wait): off the loop.
        cgroup = await off_loop(self._cgroup_for, spec)
        await off_loop(self._keep_guest)
        nproc = self.nproc_limit(spec) if cgroup is None else None
        namespace: StartNamespace | None = None
        staged: Staged | None = None
        slots, acquired = build_slots(), False
        seccomp_fd = _memfd("coderunner-seccomp", self.seccomp_filter)
        root_fds: list[tuple[int, str]] = []
        fds = StartFds.open(network=spec.network == NetworkMode.INTERNET)
        try:
            await slots.acquire()  # before the clones: a start waiting for its turn holds none (build_slots.py)
            acquired = True
            # Shielded: a start cancelled meanwhile still gets its clones back, to release them.
            with anyio.CancelScope(shield=True):
                namespace, staged = await off_loop(self._stage, spec)
            for path, data in root_files(spec):
                root_fds.append((_memfd("coderunner-root-file", data), path))
            full = self.command.argv(
                staged.spec(spec) if staged is not None else spec,
                argv,
                gate_fd=fds.gate.read,
                seccomp_fd=seccomp_fd,
                info_fd=fds.info_write,
                block_fd=fds.block_read,
                nproc=nproc,
                memory_cgroup=cgroup is not None and "memory" in cgroup.dirs and spec.limits.memory_mb is not None,
                root_fds=tuple(root_fds),
            )
            if namespace is not None:
                full = [*namespace.prelude(spec.user), *full]  # while the start has root: nsenter drops it
            elif spec.user is not None:
                full = [*spec.user.setpriv_prefix(), *full]
            full = gated_command(fds.gate.read, full, cgroup)
            process = await anyio.open_process(
                full,
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                pass_fds=(seccomp_fd, *(fd for fd, _ in root_fds), *fds.child_fds()),
            )
        except BaseException:
            fds.close(gate_too=True)
            if acquired:
                slots.release()
            with anyio.CancelScope(shield=True):
                if staged is not None and namespace is not None:
                    await off_loop(namespace.release, staged)
                if cgroup is not None:
                    await off_loop(cgroup.remove)
            raise
        finally:
            for fd in (seccomp_fd, *(fd for fd, _ in root_fds)):
                os.close(fd)
            fds.close_child_ends()
        sandbox = SandboxProcess(process, task_group, cgroup=cgroup, pipes=pipes)
        child: int | None = None
        try:
            child = await self._hold(sandbox, fds)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await sandbox.kill()
            raise
        finally:
            fds.close()
            try:
                task_group.start_soon(_after_build, slots, namespace, staged, child)
            except RuntimeError:  # its task group is over already: wait here instead
                await _after_build(slots, namespace, staged, child)
        return sandbox

    def close_starts(self) -> None:
        """Detach the start namespace's clones dir and let go of it, unless a start is under way (a backend
        several managers share): then this process's end leaves it to the next server's sweep."""
        with self._start_namespace_lock:
            namespace = self._start_namespace
            if isinstance(namespace, StartNamespace) and namespace.close():
                self._start_namespace = None

    def _stage(self, spec: SandboxSpec) -> tuple[StartNamespace | None, Staged | None]:
        """The start namespace and this start's clones in it of `spec`'s workspace and mounts; (None, None) where
        this start runs in the host's namespace (no start namespace, or its clones could not be made: then said
        in the log, and this start is as it was without one). Blocking."""
        namespace = self.start_namespace()
        if namespace is None:
            return None, None
        sources = [spec.workspace, *(mount.host for mount in spec.mounts)]
        try:
            return namespace, namespace.stage(spec.host_dir.parent.name, sources)
        except OSError as exc:
            log.warning("sandbox %s starts in the host's mount namespace: %s", spec.name, exc)
            return None, None

    def start_namespace(self) -> StartNamespace | None:
        """This backend's start namespace (start_namespace.py), made at the first start; None where there is
        none (not root, no nsenter, or it could not be made: said once in the log). Blocking."""
        if not self.use_start_namespace:
            return None
        with self._start_namespace_lock:
            if self._start_namespace is None:
                try:
                    roots = [self._workspaces_dir] if self._workspaces_dir is not None else []
                    self._start_namespace = StartNamespace.open(self._runtime_base, roots)
                except StartNamespaceUnavailable as exc:
                    if os.getuid() == 0:
                        log.warning("sandboxes start in the host's mount namespace: %s", exc)
                    self._start_namespace = False
            return self._start_namespace if isinstance(self._start_namespace, StartNamespace) else None

    def _keep_guest(self) -> None:
        """Put the guest copy back if something removed it since the server started (a /tmp cleaner, a
        user's `rm`): every later sandbox would otherwise fail to start with bwrap's "Can't find source path"."""
        if not self.command.guest_dir.is_dir():
            log.warning("the guest copy %s was removed: installing it again", self.command.guest_dir)
            install_guest(*self._guest_source)

    def nproc_limit(self, spec: SandboxSpec) -> int | None:
        """RLIMIT_NPROC for a sandbox without cgroups (None with them, or with no pids limit): RLIMIT_NPROC
        counts every task of the sandbox's host user, so its tasks now plus the pids limit."""
        if self.cgroups is not None or not spec.limits.pids:
            return None
        if spec.user is not None:
            return _count_tasks(spec.user.uid) + spec.limits.pids
        if os.getuid() != 0:
            return _count_tasks(os.getuid()) + spec.limits.pids
        return None

    async def _hold(self, sandbox: SandboxProcess, fds: StartFds) -> int | None:
        """Hand the sandbox to this process's watcher, then let it start: first bwrap (the prelude's gate),
        then, once the watcher holds a pidfd of the sandbox's pid 1 too (and its network is up), the init.
        A sandbox that fails meanwhile is left to exit: its exit and stderr say why (the kernel's start).
        Its pid 1's host pid (None: bwrap made none)."""
        watch = process_watch()
        assert fds.info_read is not None
        outer = open_child(os.getpid(), sandbox.pid)  # still ours: it waits at the gate for this process
        cgroups = list(sandbox.cgroup.dirs.values()) if sandbox.cgroup is not None else []
        try:
            entry = watch.watcher.add(outer, [fds.info_read], cgroups)
        except BaseException:
            os.close(outer)
            fds.gate.close()
            raise
        hold = SandboxHold(watch.watcher, entry, outer, fds.gate)
        sandbox.hold = hold
        with contextlib.suppress(BrokenPipeError):
            fds.gate.open_prelude()
        with anyio.fail_after(HOLD_TIMEOUT_S):
            info = await read_json_document(fds.info_read)
        if info is None:
            return None  # bwrap failed before it made its child
        child = int(info["child-pid"])
        try:
            hold.init = open_child(sandbox.pid, child)
        except (ProcessLookupError, NotOurChild):
            return None  # its pid 1 is gone already, and its namespace with it
        watch.watcher.add_init(entry, hold.init)
        if fds.network:
            with anyio.fail_after(NETWORK_SETUP_TIMEOUT_S):
                await self._attach_network(fds, sandbox, int(info["child-pid"]), watch.lifeline)
        with contextlib.suppress(BrokenPipeError):
            fds.gate.open_init()
        return child

    def _cgroup_for(self, spec: SandboxSpec) -> SessionCgroup | None:
        if self.cgroups is None:
            return None
        return self.cgroups.create(spec.name, cgroup_limits(spec.limits))

    def live_limits_problem(self) -> str | None:
        if self.cgroups is None:
            return f"no cgroups here ({self.cgroup_problem}): a sandbox's limits are set only when it starts"
        return None

    def lower_limits(self, process: SandboxProcess, built: Limits, asked: Limits) -> None:
        """The sandbox's cgroup and its processes' address-space limit, lowered (sandbox/live_limits.py)."""
        if process.cgroup is None:
            raise self.unavailable("this sandbox runs in no cgroup: its limits are set only when it starts")
        try:
            lower_limits(process.cgroup, built, asked)
        except (OSError, ValueError) as exc:
            raise self.unavailable(f"could not lower the sandbox's limits: {exc}") from exc

    async def _attach_network(self, fds: StartFds, sandbox: SandboxProcess, child: int, lifeline: int) -> None:
        """Start slirp4netns on the network namespace of the sandbox's pid 1 (`child`), then let bwrap go on.
        slirp4netns ends with this process (`lifeline`: a pipe's read end whose only writer is this process)."""
        assert self.slirp4netns is not None and fds.block_write is not None
        # bwrap reports its child before the child has set up its loopback, and slirp4netns
        # brings `lo` up too: the kernel then adds 127.0.0.1 itself and bwrap's own RTM_NEWADDR
        # fails ("loopback: Failed RTM_NEWADDR", seen in about 1 start in 8). Let bwrap go first.
        await _loopback_ready(child, LOOPBACK_WAIT_S)
        ready_read, ready_write = os.pipe()
        try:
            # Unprivileged, the sandbox's netns belongs to its user namespace, which slirp4netns must
            # join first; as root it must not (it would drop the rights it needs to enter the netns).
            join_userns = [f"--userns-path=/proc/{child}/ns/user"] if os.getuid() != 0 else []
            slirp = await anyio.open_process(
                [
                    self.slirp4netns, "--configure", "--mtu=65520", "--disable-host-loopback",
                    "--enable-sandbox", "--enable-seccomp", f"--ready-fd={ready_write}", f"--exit-fd={lifeline}",
                    *join_userns, "--netns-type=path", f"/proc/{child}/ns/net", "tap0",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=(ready_write, lifeline),
            )  # fmt: skip
            sandbox.helpers.append(slirp)
            os.close(ready_write)
            ready_write = -1
            await anyio.wait_readable(ready_read)
            if not os.read(ready_read, 1):
                raise BwrapUnavailable("slirp4netns could not set up the sandbox's network")
        finally:
            os.close(ready_read)
            if ready_write >= 0:
                os.close(ready_write)
        os.write(fds.block_write, b"1")


async def _after_build(
    slots: anyio.Semaphore, namespace: StartNamespace | None, staged: Staged | None, child: int | None
) -> None:
    """Once bwrap's `child` has built the sandbox (build_slots.py), give back the build's slot and detach its
    clones in the start namespace (the sandbox keeps its own copies). Shielded: a session closed meanwhile still
    frees both."""
    with anyio.CancelScope(shield=True):
        try:
            if not await wait_built(child):
                log.warning("a sandbox's pid 1 was still in bwrap after %.0fs: its build slot given back", BUILT_WAIT_S)
        finally:
            slots.release()
            if staged is not None and namespace is not None:
                await off_loop(namespace.release, staged)


async def _loopback_ready(pid: int, timeout_s: float) -> bool:
    """Wait (bounded) until the network namespace of `pid` has 127.0.0.1; False if it never did."""
    with anyio.move_on_after(timeout_s):
        while True:
            try:
                with open(f"/proc/{pid}/net/fib_trie") as handle:
                    if "127.0.0.1" in handle.read():
                        return True
            except OSError:
                return False  # the child is gone: bwrap's own error will say why
            await anyio.sleep(0.002)
    log.warning("the sandbox's loopback was not up after %.1fs; starting its network anyway", timeout_s)
    return False
