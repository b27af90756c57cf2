"""The gVisor backend: each sandbox is a container run by runsc directly (no podman in between), so
each kernel runs on a kernel of its own (gVisor's Sentry) and a live one can be checkpointed.

Why runsc directly: podman 4.3 refuses `container checkpoint` with runsc and cannot adopt a restored
sandbox (bench/gvisor_checkpoint.py). Podman only builds the image and mounts it (`podman image
mount`, once per backend, read-only use).

What a sandbox gets (what podman's flags gave before, now in the OCI config, runsc.py): no
capabilities, noNewPrivileges, a read-only root, a size-capped /tmp, /dev/shm, an empty read-only
/sys, no network stack (network=none), rlimits (nofile, nproc; RLIMIT_AS soft and the session's pids
as RLIMIT_NPROC via prlimit), memory/cpu/pids on host cgroups (v1 or v2: runsc sets the spec's
linux.resources under a cgroupsPath named after the container), the per-sandbox host uid, and an
environment of its own (nothing of the host's).

Its root: runsc's gofer cannot create a bind's mount point in a read-only rootfs, so each sandbox
has its own host overlayfs (lower: the mounted image; upper/work: a host-only dir of this sandbox)
whose upper dir gets every mount point before `runsc run`; root is read-only all the same.

Fixed inside paths: the run dir at RUN_INSIDE, the host-only dir at HOST_INSIDE, the workspace at
WORKSPACE, so that a checkpoint taken in one session restores into another's dirs. Host paths in
the argv are rewritten to those.

A kernel runs behind the channel relay (guest/channel_relay.py, the container's init), which lets
the backend's checkpointer (gvisor_checkpoint.py) save a live sandbox and restore it elsewhere.

Not used: oci-seccomp (the spec's seccomp profile inside the Sentry): ZMQ's I/O thread then fails
to start (EPERM). The syscall boundary is the Sentry itself, which runsc confines with its own
host seccomp filter.

Its files on the host (RUNTIME/.runsc, host-only, gvisor_instances.py): one instance dir per
server process, holding its runsc --root and one bundle per container (config.json, upper/, work/,
rootfs/: the overlay mount). A server that dies by SIGKILL leaves them; its watcher (watcher.py, kind
"runsc") deletes its containers, unmounts their roots and removes its dir; the next server's sweep
whatever is left.

One idea: the gVisor backend's sandbox lifecycle over runsc (create, start, adopt a restore, kill, delete);
its argv, instance dirs and checkpoint store live beside it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup

from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs.private_dirs import ensure_private_dir
from coderunner.sandbox.base import (
    KernelChannels,
    LimitReport,
    Limits,
    SandboxBackend,
    SandboxProcess,
    SandboxSpec,
    backend_identity,
)
from coderunner.sandbox.common import HOST_INSIDE, IMAGE_PYTHON
from coderunner.sandbox.container import NAME_PREFIX, ContainerUnavailable, container_name, server_tag, session_key
from coderunner.sandbox.engine import QUERY_TIMEOUT_S, REMOVE_TIMEOUT_S, EngineError, engine_env, run_async, run_sync
from coderunner.sandbox.gvisor_checkpoint import CheckpointError, GvisorCheckpointer, checkpoint_owner, read_relay_state
from coderunner.sandbox.gvisor_instances import (
    ABANDONED_AFTER_S,
    LOCK_NAME,
    NEW_INSTANCE,
    ROOT_NAME,
    Instance,
    container_cgroup,
    new_instance,
    other_instances,
    remove_cgroup_soon,
    session_of,
    stale_cgroups,
)
from coderunner.sandbox.gvisor_process import GvisorProcess
from coderunner.sandbox.identity import shared_dir_mode
from coderunner.sandbox.runsc import (
    DEV_GUEST_LIB_ENV,
    RUNTIME_FLAGS,
    ConfigInputs,
    Runsc,
    host_pids,
    inner_argv,
    mount_points,
    oci_config,
)
from coderunner.sandbox.watcher import Watcher, WatchPlan
from coderunner.vocabulary.backends import install_hint
from coderunner.vocabulary.host_identity import HostIdentity
from coderunner.vocabulary.network import NetworkMode
from coderunner.vocabulary.sandbox_layout import SANDBOX_GID, SANDBOX_UID, WORKSPACE

if TYPE_CHECKING:
    from coderunner.config import Settings

log = logging.getLogger(__name__)

__all__ = [
    "ABANDONED_AFTER_S",
    "LOCK_NAME",
    "NEW_INSTANCE",
    "RUNTIME_FLAGS",
    "CheckpointError",
    "GvisorBackend",
    "GvisorProcess",
    "build",
    "checkpoint_owner",
    "container_cgroup",
    "host_pids",
    "read_relay_state",
    "session_of",
]

#: The backend's own dir under the runtime base (not a session key: remove_stale_dirs skips it).
BACKEND_DIR = ".runsc"
#: Open files and processes per sandbox uid inside (as the podman backend's ulimits).
NOFILE = 4096
NPROC = 4096
#: Bound on the image mount and on overlay mounts and unmounts.
MOUNT_TIMEOUT_S = 60.0
#: A dead sandbox's cgroup: removals tried (each kills what is left, then waits up to 3 s).
STALE_CGROUP_TRIES = 4


def find_runsc(runsc: str | None = None) -> str:
    found = runsc or shutil.which("runsc")
    if found is None:
        raise ContainerUnavailable(f"runsc (gVisor) is not installed: {install_hint('gvisor')}")
    return found


def build(settings: Settings) -> GvisorBackend:
    """The registry's builder: a gvisor backend as the settings say."""
    return GvisorBackend(settings.image, settings.runtime_dir, identity=backend_identity(settings))


class GvisorBackend(SandboxBackend):
    """Sandboxes as containers run by runsc (gVisor) directly, checkpointable between cells."""

    name = "gvisor"
    workspace_path = WORKSPACE
    python = IMAGE_PYTHON
    channels = KernelChannels.IPC
    network_modes = frozenset({NetworkMode.NONE})
    unavailable = ContainerUnavailable

    def __init__(
        self,
        image: str,
        runtime_base: Path,
        identity: HostIdentity | None = None,
        runsc: str | None = None,
        engine: str | None = None,
    ) -> None:
        if os.getuid() != 0:
            raise ContainerUnavailable(
                "the gvisor backend runs runsc directly (for memory checkpoints) and needs a root server: "
                "run `coderunner serve` as root, or use the bwrap or podman backend"
            )
        binary = find_runsc(runsc)
        podman = engine or shutil.which("podman")
        if podman is None:
            raise ContainerUnavailable(
                f"podman is not installed (it builds and mounts the gvisor image): {install_hint('gvisor')}"
            )
        self.identity = identity
        self.dir_mode = shared_dir_mode(identity)
        self.image = image
        self.podman = podman
        self.runtime_base = runtime_base
        self.tag = server_tag(runtime_base)
        self.env = engine_env(dict(os.environ))
        ensure_private_dir(runtime_base, self.dir_mode)
        self.backend_dir = runtime_base / BACKEND_DIR
        ensure_private_dir(self.backend_dir, 0o700)
        self.image_id = self._check_image()
        self.runsc_version = self._runsc_version(binary)
        self.rootfs = self._mount_image()
        self.instance = self._new_instance()
        ensure_private_dir(self.instance.root, 0o700)
        self.runsc = Runsc(binary, self.instance.root)
        dev = os.environ.get(DEV_GUEST_LIB_ENV)
        self.dev_guest_lib = Path(dev).resolve() if dev else None
        if self.dev_guest_lib is not None:
            log.warning("%s is set: sandboxes run the guest package from %s, not the image's", DEV_GUEST_LIB_ENV, dev)
        self.nofile = _hard_limit(resource.RLIMIT_NOFILE, NOFILE)
        self.nproc = _hard_limit(resource.RLIMIT_NPROC, NPROC)
        plan = WatchPlan(self.runsc.base(), "runsc", str(self.instance.root), clear_dir=str(self.instance.top))
        #: Deletes this process's containers when it dies (started with the first container).
        self.watcher = Watcher(plan, self.env)
        self.checkpointer: GvisorCheckpointer | None = GvisorCheckpointer(self)
        self.sweep()

    # --- setup -----------------------------------------------------------------------------------

    def _check_image(self) -> str:
        argv = [self.podman, "image", "inspect", "--format", "{{.Id}}", self.image]
        try:
            done = run_sync(argv, QUERY_TIMEOUT_S, check=False, env=self.env)
        except EngineError as exc:
            raise ContainerUnavailable(f"podman does not answer: {exc}") from None
        if done.returncode != 0:
            raise ContainerUnavailable(
                f"the sandbox image {self.image} is not built for gvisor: run `coderunner setup --backend gvisor` "
                f"({done.stderr.strip()[-300:]})"
            )
        return done.stdout.strip()

    def _runsc_version(self, binary: str) -> str:
        try:
            done = run_sync([binary, "--version"], QUERY_TIMEOUT_S, env=self.env)
        except EngineError as exc:
            raise ContainerUnavailable(f"runsc does not run: {exc}") from None
        return (done.stdout.strip().splitlines() or ["unknown"])[0]

    def _mount_image(self) -> Path:
        try:
            done = run_sync([self.podman, "image", "mount", self.image], MOUNT_TIMEOUT_S, env=self.env)
        except EngineError as exc:
            raise ContainerUnavailable(f"could not mount the sandbox image: {exc}") from None
        path = Path(done.stdout.strip())
        if not path.is_absolute() or not path.is_dir() or any(c in str(path) for c in ",:"):
            raise ContainerUnavailable(f"podman image mount gave an unusable path: {done.stdout.strip()[:200]!r}")
        return path

    def _image_root(self) -> Path:
        """The image's root, the lower layer of each sandbox's overlay. Mounted once at the start; should
        anything have unmounted it since (another podman command on this machine), it is mounted again:
        an empty lower layer gives a sandbox no python, and a restore \"no such file or directory\" for
        the files its checkpointed processes held (seen as a flaky restore, issue 38 point 7)."""
        if not os.path.ismount(self.rootfs):
            log.warning("the sandbox image's mount %s is gone (unmounted by something else); mounting it again",
                        self.rootfs)  # fmt: skip
            self.rootfs = self._mount_image()
        return self.rootfs

    def _new_instance(self) -> Instance:
        return new_instance(self.backend_dir)

    # --- the protocol ---------------------------------------------------------------------------

    def host_dir_inside(self, spec: SandboxSpec) -> str:
        return HOST_INSIDE

    def describe_isolation(self) -> str:
        user = f"; its files are host user {self.identity.name}'s" if self.identity else ""
        return (
            "gVisor (runsc, ptrace platform, run directly): the code talks to gVisor's own kernel, not the "
            "host's, itself confined by runsc's seccomp filter; no capabilities, no-new-privileges, read-only root, "
            f"size-capped /tmp, no network stack, only the session workspace writable; memory/cpu/pids "
            f"limits on host cgroups{user}"
        )

    def limit_reports(self, limits: Limits) -> dict[str, LimitReport]:
        return {
            "memory_mb": LimitReport(limits.memory_mb, "RLIMIT_AS + cgroup memory limit" if limits.memory_mb else None),
            "cpus": LimitReport(limits.cpus, "cgroup cpu quota" if limits.cpus else None),
            "pids": LimitReport(
                limits.pids, "RLIMIT_NPROC in gVisor's kernel + cgroup pids limit" if limits.pids else None
            ),
            "tmp_mb": LimitReport(limits.tmp_mb, "tmpfs size" if limits.tmp_mb else None),
        }

    def refusal(self, mode: NetworkMode) -> str:
        # 'allowlist' too: its proxy is a host socket the sandbox dials, and host-uds=create
        # lets the sandbox bind its own sockets but never dial one of the host's.
        return (
            "the gvisor backend runs sandboxes without any network stack and cannot dial the host's "
            "egress proxy: use network 'none', or the bwrap or podman backend for 'allowlist' or 'internet'"
        )

    async def start(self, spec: SandboxSpec, argv: list[str], task_group: TaskGroup, *, pipes: bool) -> SandboxProcess:
        inner = inner_argv(spec, argv, pipes=pipes)
        return await self.launch(spec, inner, task_group, pipes=pipes, image_dir=None)

    # --- containers -------------------------------------------------------------------------------

    def call_sync(self, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str] | None:
        try:
            done = run_sync(argv, timeout_s, check=False, env=self.env)
        except EngineError as exc:
            log.warning("%s", exc)
            return None
        return subprocess.CompletedProcess(argv, done.returncode, done.stdout, done.stderr)

    async def call(self, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str] | None:
        """A bounded runsc call; None if it could not run or outlived its bound (then it is killed)."""
        try:
            done = await run_async(argv, timeout_s, check=False, env=self.env)
        except EngineError as exc:
            log.warning("%s", exc)
            return None
        return subprocess.CompletedProcess(argv, done.returncode, done.stdout, done.stderr)

    def ids(self, spec: SandboxSpec | None) -> tuple[int, int]:
        """The host uid and gid a sandbox of `spec` runs as."""
        if spec is not None and spec.user is not None:
            return spec.user.uid, spec.user.gid
        return (self.identity.uid, self.identity.gid) if self.identity else (SANDBOX_UID, SANDBOX_GID)

    def _bundle(self, container: str) -> Path:
        return self.instance.top / container

    def _prepare(self, spec: SandboxSpec, inner: list[str], container: str, *, pipes: bool) -> Path:
        """The bundle: a host-only dir with the overlay rootfs (mount points made) and config.json."""
        bundle = self._bundle(container)
        bundle.mkdir(mode=0o700)
        upper, work, rootfs = bundle / "upper", bundle / "work", bundle / "rootfs"
        for each in (upper, work, rootfs):
            each.mkdir(mode=0o755)
            os.chmod(each, 0o755)  # whatever the umask: upper/ is the sandbox's / (host-only bundle)
        for point in mount_points(spec, self.dev_guest_lib):
            relative = Path(point.lstrip("/"))
            (upper / relative).mkdir(mode=0o755, parents=True, exist_ok=True)
            for folder in (relative, *relative.parents):
                os.chmod(upper / folder, 0o755)
        lower = self._image_root()
        for path in (upper, work, lower):
            if any(c in str(path) for c in ",:"):
                raise ContainerUnavailable(f"the gvisor backend cannot use a path with ',' or ':': {path}")
        options = f"lowerdir={lower},upperdir={upper},workdir={work}"
        done = self.call_sync(["mount", "-t", "overlay", "-o", options, "overlay", str(rootfs)], MOUNT_TIMEOUT_S)
        if done is None or done.returncode != 0:
            said = done.stderr.strip()[-300:] if done else "timed out"
            raise ContainerUnavailable(f"could not mount the sandbox's root file system: {said}")
        uid, gid = self.ids(None)
        inputs = ConfigInputs(rootfs, uid, gid, container, self.nofile, self.nproc, self.dev_guest_lib)
        config = oci_config(spec, inner, inputs, pipes=pipes)
        (bundle / "config.json").write_text(json.dumps(config, indent=1))
        return bundle

    async def launch(
        self, spec: SandboxSpec, inner: list[str], task_group: TaskGroup, *, pipes: bool, image_dir: Path | None
    ) -> GvisorProcess:
        container = container_name(self.tag, session_key(spec))
        try:
            bundle = await anyio.to_thread.run_sync(lambda: self._prepare(spec, inner, container, pipes=pipes))
        except BaseException:
            await anyio.to_thread.run_sync(self.release, container)
            raise
        # Before the container exists, so that no container of ours is ever unwatched.
        self.watcher.ensure_running()
        argv = (
            self.runsc.run(bundle, container) if image_dir is None else self.runsc.restore(image_dir, bundle, container)
        )
        try:
            process = await anyio.open_process(
                argv,
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env=self.env,
                cwd=self.instance.top,
            )
        except BaseException:
            await anyio.to_thread.run_sync(self.release, container)
            raise
        return GvisorProcess(process, task_group, self, container, spec, pipes=pipes)

    def release(self, container: str, top: Path | None = None) -> None:
        """Unmount and remove a container's bundle, and its cgroup if runsc left it (blocking: a thread)."""
        bundle = (top or self.instance.top) / container
        rootfs = bundle / "rootfs"
        if os.path.ismount(rootfs):
            done = self.call_sync(["umount", str(rootfs)], MOUNT_TIMEOUT_S)
            if done is None or done.returncode != 0:
                self.call_sync(["umount", "--lazy", str(rootfs)], MOUNT_TIMEOUT_S)
        if os.path.ismount(rootfs):
            log.warning("could not unmount %s; leaving its bundle", rootfs)
        elif bundle.is_dir():
            with hostfs.dir_fd(bundle.parent) as parent:
                left = hostfs.remove_tree(parent, bundle.name)
            if left:
                log.warning("could not remove all of %s: %s", bundle, "; ".join(left[:3]))
        remove_cgroup_soon(container_cgroup(container))

    # --- checkpoints ---------------------------------------------------------------------------------

    # --- leftovers of dead servers ---------------------------------------------------------------

    def _instances(self) -> list[tuple[Path, bool]]:
        """Other server processes' instance dirs, and whether that server still lives (holds the lock)."""
        return other_instances(self.backend_dir, self.instance.name)

    def _containers(self, top: Path) -> list[str]:
        runsc = Runsc(self.runsc.binary, top / ROOT_NAME, self.runsc.flags)
        done = self.call_sync(runsc.list(), QUERY_TIMEOUT_S) if (top / ROOT_NAME).is_dir() else None
        return [
            line.strip() for line in (done.stdout if done and done.returncode == 0 else "").splitlines() if line.strip()
        ]

    def _remove(self, top: Path, containers: list[str]) -> None:
        if containers:
            runsc = Runsc(self.runsc.binary, top / ROOT_NAME, self.runsc.flags)
            self.call_sync(runsc.delete(*containers), REMOVE_TIMEOUT_S + 2 * len(containers))
            log.info("removed %d gvisor sandbox(es) left by a server that is gone", len(containers))

    def _clear_dead(self, top: Path, session: str | None = None) -> None:
        """A dead server's containers (of `session`, or all), their bundles and cgroups; then its dir."""
        containers = self._containers(top)
        self._remove(top, [c for c in containers if session is None or session_of(c, self.tag) == session])
        with contextlib.suppress(OSError):
            for entry in os.scandir(top):
                if entry.name.startswith(f"{NAME_PREFIX}-") and (
                    session is None or session_of(entry.name, self.tag) == session
                ):
                    self.release(entry.name, top)
        if session is None:
            with contextlib.suppress(OSError), hostfs.dir_fd(self.backend_dir) as parent:
                hostfs.remove_tree(parent, top.name)

    def sweep(self) -> None:
        """At start: clear dead servers' instances, and any container whose session dir is gone."""
        for top, alive in self._instances():
            if not alive:
                self._clear_dead(top)
                continue
            gone = [
                c for c in self._containers(top) if not (self.runtime_base / (session_of(c, self.tag) or "-")).exists()
            ]
            self._remove(top, gone)

    def close(self) -> None:
        """Delete this server process's own sandboxes and dirs (blocking; tests, and a server's exit)."""
        self._clear_dead(self.instance.top)
        with contextlib.suppress(OSError):
            os.close(self.instance.lock_fd)

    def remove_stale(self, name: str) -> None:
        """Remove what dead servers left for the sandbox `name`, and wait (bounded) until its sandbox
        processes are gone: the caller then unmounts its workspace, which their gofer holds open."""
        for top, alive in self._instances():
            if not alive:
                self._clear_dead(top, name)
        for cgroup in stale_cgroups(f"{NAME_PREFIX}-{self.tag}-{name}-"):
            for _ in range(STALE_CGROUP_TRIES):  # each kills what is left and waits up to REMOVE_WAIT_S
                cgroup.remove()
                if not any(path.exists() for path in cgroup.dirs.values()):
                    break


def _hard_limit(kind: int, cap: int) -> int:
    hard = resource.getrlimit(kind)[1]
    return cap if hard == resource.RLIM_INFINITY else min(hard, cap)
