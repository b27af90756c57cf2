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

A kernel runs behind the channel relay (guest/channel_relay.py, the container's init): it binds the
kernel's channels as host sockets in the run dir, drops them on SIGUSR1 and binds them again on
SIGUSR2, reporting in RELAY_STATE. A sandbox holding no host socket can be checkpointed (this runsc
panics saving a bound host socket: "Cannot save endpoint with bound host socket").

Not used: oci-seccomp (the spec's seccomp profile inside the Sentry): ZMQ's I/O thread then fails
to start (EPERM). The syscall boundary is the Sentry itself, which runsc confines with its own
host seccomp filter.

Its files on the host (RUNTIME/.runsc, host-only):
    <instance>/lock         flock held for the life of the server process that owns the instance
    <instance>/root/        runsc --root of that server process
    <instance>/<container>/ the bundle: config.json, upper/, work/, rootfs/ (the overlay mount)
A server that dies by SIGKILL leaves them; its watcher (watcher.py, kind "runsc") deletes its
containers, unmounts their roots and removes its dir; the next server's sweep whatever is left.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import resource
import secrets
import shutil
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import Process, TaskGroup

from coderunner.hostfs import dirfd as hostfs
from coderunner.sandbox.base import (
    KILL_WAIT_S,
    LimitReport,
    Limits,
    SandboxProcess,
    SandboxSpec,
    SandboxUnavailable,
    start_failures,
)
from coderunner.sandbox.cgroups import SessionCgroup
from coderunner.sandbox.common import (
    HOST_INSIDE,
    IMAGE_PYTHON,
    NETWORK_MODES,
    RELAY_STATE,
    RELAY_STATE_MAX_BYTES,
    SANDBOX_GID,
    SANDBOX_UID,
    WORKSPACE,
)
from coderunner.sandbox.container import NAME_PREFIX, ContainerUnavailable, container_name, server_tag, session_key
from coderunner.sandbox.engine import QUERY_TIMEOUT_S, REMOVE_TIMEOUT_S, EngineError, engine_env, run_async, run_sync
from coderunner.sandbox.identity import HostIdentity, ensure_private_dir, shared_dir_mode
from coderunner.sandbox.runsc import (
    DEV_GUEST_LIB_ENV,
    RUNTIME_FLAGS,
    ConfigInputs,
    Runsc,
    host_pids,
    inner_argv,
    mount_points,
    oci_config,
    parse_relay_state,
    short_reason,
)
from coderunner.sandbox.watcher import Watcher, WatchPlan

log = logging.getLogger(__name__)

__all__ = ["RUNTIME_FLAGS", "CheckpointError", "GvisorBackend", "GvisorProcess", "host_pids"]

INSTALL_HINT = "sudo apt-get install runsc podman"
#: The backend's own dir under the runtime base (not a session key: remove_stale_dirs skips it).
BACKEND_DIR = ".runsc"
LOCK_NAME = hostfs.LOCK_NAME
#: A server process's dir while it is made: it gets its name only once its lock is held.
NEW_INSTANCE = hostfs.NEW_PREFIX
#: A dir being made with no lock yet is taken for dead only after this long.
ABANDONED_AFTER_S = hostfs.ABANDONED_AFTER_S
ROOT_NAME = "root"
#: Open files and processes per sandbox uid inside (as the podman backend's ulimits).
NOFILE = 4096
NPROC = 4096
#: Bounds: image mount, overlay mount/unmount, runsc kill/state, the relay's answer to USR1/USR2.
MOUNT_TIMEOUT_S = 60.0
RUNSC_CALL_S = 20.0
RELAY_WAIT_S = 30.0
RELAY_POLL_S = 0.01
STATE_POLL_S = 0.05
CGROUP_CONTROLLERS_V1 = ("memory", "pids", "cpu", "cpuacct", "cpuset", "blkio", "devices", "freezer", "systemd")
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: A dead sandbox's cgroup: removals tried (each kills what is left, then waits up to 3 s).
STALE_CGROUP_TRIES = 4
#: Beside runsc's image in a checkpoint's dir: the host uid/gid its processes keep (checkpoint_owner).
OWNER_FILE = "coderunner-owner.json"
#: The relay's host-visible sockets in the run dir: jupyter's ipc naming, <ip basename>-<port>.
RELAY_SOCKET = re.compile(r"k[0-9]{1,9}-[0-9]{1,5}")


class CheckpointError(SandboxUnavailable):
    """A checkpoint or restore did not work; the message says what runsc or the relay said."""


def write_owner(image_dir: Path, ids: tuple[int, int]) -> None:
    """Beside runsc's image: the host uid and gid its processes run as (they keep them when restored)."""
    with hostfs.dir_fd(image_dir) as folder:
        hostfs.write_new_file(folder, OWNER_FILE, json.dumps({"uid": ids[0], "gid": ids[1]}).encode(), mode=0o600)


def checkpoint_owner(image_dir: Path) -> tuple[int, int] | None:
    """The host uid and gid a checkpoint's processes run as (and keep when restored): a restore must
    give the new sandbox the same (SandboxSpec.user). None for an image without the note."""
    try:
        with hostfs.dir_fd(image_dir) as folder:
            fd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
            with open(fd, "rb") as handle:
                data = json.loads(handle.read(4096))
        return int(data["uid"]), int(data["gid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_runsc(runsc: str | None = None) -> str:
    found = runsc or shutil.which("runsc")
    if found is None:
        raise ContainerUnavailable(f"runsc (gVisor) is not installed: {INSTALL_HINT}")
    return found


def container_cgroup(container: str) -> SessionCgroup:
    """The host cgroup runsc makes for a container (cgroupsPath /<container>)."""
    unified = CGROUP_ROOT / "cgroup.controllers"
    if unified.exists():
        return SessionCgroup(2, {"unified": CGROUP_ROOT / container, "memory": CGROUP_ROOT / container})
    dirs = {name: CGROUP_ROOT / name / container for name in CGROUP_CONTROLLERS_V1}
    return SessionCgroup(1, {name: path for name, path in dirs.items() if path.parent.is_dir()})


def remove_cgroup_soon(cgroup: SessionCgroup) -> None:
    """Remove a deleted container's cgroup (runsc usually has): at once if it is empty, else from a
    background thread once its last tasks (ptrace stubs die slowly) are gone, so that no caller, a
    server's shutdown least of all, waits for them."""
    left = False
    for path in cgroup.dirs.values():
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            left = True
    if left:
        threading.Thread(target=cgroup.remove, name="gvisor-cgroup", daemon=True).start()


def stale_cgroups(prefix: str) -> list[SessionCgroup]:
    """The host cgroups of containers whose names start with `prefix` (one sandbox's, of any server)."""
    unified = CGROUP_ROOT / "cgroup.controllers"
    where = CGROUP_ROOT if unified.exists() else CGROUP_ROOT / "pids"
    try:
        names = [entry.name for entry in os.scandir(where) if entry.name.startswith(prefix) and entry.is_dir()]
    except OSError:
        return []
    return [container_cgroup(name) for name in names]


def session_of(container: str, tag: str) -> str | None:
    """The session key in a container id made by container_name(tag, session)."""
    prefix = f"{NAME_PREFIX}-{tag}-"
    if not container.startswith(prefix):
        return None
    session, _, _ = container[len(prefix) :].rpartition("-")
    return session or None


def read_relay_state(run_dir: Path) -> tuple[str, int] | None:
    """What the relay says in the (sandbox-writable) run dir: read by the dir's fd, never a link, a
    FIFO or a big file; None when there is nothing (yet) or nothing valid."""
    try:
        with hostfs.dir_fd(run_dir) as folder:
            fd = os.open(RELAY_STATE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, RELAY_STATE_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse_relay_state(data) if len(data) <= RELAY_STATE_MAX_BYTES else None


def clear_relay_sockets(run_dir: Path) -> int:
    """Unlink the relay's closed sockets (k<gen>-<port>) still in the run dir, by its fd, before it is
    told to bind again: gVisor refuses the relay an unlink of a host socket (EPERM), and a bind fails
    while the path is there. The host claims only some channels (kernel.HOST_CHANNELS); the rest stay.
    Only sockets go (a name the sandbox swapped for something else is left alone)."""
    removed = 0
    with contextlib.suppress(OSError), hostfs.dir_fd(run_dir) as folder:
        for name in hostfs.entries(folder):
            if not RELAY_SOCKET.fullmatch(name):
                continue
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=folder)
                    removed += 1
    return removed


async def wait_relay(run_dir: Path, word: str, after: int, timeout_s: float, process: SandboxProcess) -> int:
    """Wait for the relay to say "<word> n" with n > after; the n. Raises CheckpointError."""
    with anyio.move_on_after(timeout_s):
        while process.alive:
            found = read_relay_state(run_dir)
            if found is not None and found[1] > after:
                if found[0] == word:
                    return found[1]
                if found[0] == "failed":
                    raise CheckpointError(
                        f"the sandbox's channel relay failed to {'bind' if word == 'open' else 'close'} its sockets"
                    )
            await anyio.sleep(RELAY_POLL_S)
        raise CheckpointError(f"the sandbox ended before its channel relay reported {word!r}")
    raise CheckpointError(f"the sandbox's channel relay did not report {word!r} within {timeout_s:g} s")


class GvisorProcess(SandboxProcess):
    """`runsc run` (or `runsc restore`) of one container; kill() deletes the container and its rootfs."""

    def __init__(
        self, process: Process, task_group: TaskGroup, backend: GvisorBackend, container: str, spec: SandboxSpec,
        *, pipes: bool,
    ) -> None:  # fmt: skip
        super().__init__(process, task_group, cgroup=container_cgroup(container), pipes=pipes)
        self.backend = backend
        self.container = container
        self.spec = spec
        #: The relay's generation last seen (RELAY_STATE's n).
        self.relay_generation = 0
        self._released = False

    async def kill(self) -> None:
        """Kill and delete the container (bounded, shielded), reap runsc, release the rootfs and cgroup."""
        with anyio.CancelScope(shield=True):
            runsc = self.backend.runsc
            if self.alive:  # first: `runsc run` then returns (a delete alone leaves it waiting)
                await self.backend.call(runsc.kill(self.container, "KILL"), RUNSC_CALL_S)
            # The Sentry, its gofer and ptrace stubs, at once: runsc's own teardown of a ptrace sandbox can
            # take seconds (a server's shutdown has about two), and its delete waits for it.
            if self.cgroup is not None:
                self.cgroup.kill_all()
            deleted = await self.backend.call(runsc.delete(self.container), REMOVE_TIMEOUT_S)
            # SIGKILL runsc's process group and reap it. The cgroup goes in release(), in a thread: its
            # removal waits for the last tasks to leave, which must not block the event loop.
            cgroup, self.cgroup = self.cgroup, None
            try:
                await super().kill()
            finally:
                self.cgroup = cgroup
            if not self._released:
                self._released = True
                if deleted is None or deleted.returncode != 0:
                    # A runsc killed half-way through creating may have made it only now.
                    await self.backend.call(runsc.delete(self.container), REMOVE_TIMEOUT_S)
                await anyio.to_thread.run_sync(self.backend.release, self.container)


@dataclass
class _Instance:
    """This server process's own dirs under the backend dir, locked for its life."""

    name: str
    top: Path
    lock_fd: int

    @property
    def root(self) -> Path:
        return self.top / ROOT_NAME


class GvisorBackend:
    """Sandboxes as containers run by runsc (gVisor) directly, checkpointable between cells."""

    name = "gvisor"
    workspace_path = WORKSPACE
    python = IMAGE_PYTHON
    channels = "ipc"

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
                f"podman is not installed (it builds and mounts the gvisor image): {INSTALL_HINT}"
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

    def _new_instance(self) -> _Instance:
        """This process's dir, which appears under its name already locked (hostfs.make_locked_dir):
        another server's sweep never sees it unlocked."""
        name = secrets.token_hex(6)
        with hostfs.dir_fd(self.backend_dir) as parent:
            top_fd, fd = hostfs.make_locked_dir(parent, name, 0o700)
            os.close(top_fd)
            hostfs.publish_dir(parent, name)
        return _Instance(name, self.backend_dir / name, fd)

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

    def network_problem(self, network: str) -> str | None:
        if network not in NETWORK_MODES:
            return f"unknown network mode {network!r}: use 'none', 'allowlist' or 'internet'"
        if network != "none":
            # 'allowlist' too: its proxy is a host socket the sandbox dials, and host-uds=create
            # lets the sandbox bind its own sockets but never dial one of the host's.
            return (
                "the gvisor backend runs sandboxes without any network stack and cannot dial the host's "
                "egress proxy: use network 'none', or the bwrap or podman backend for 'allowlist' or 'internet'"
            )
        return None

    def checkpoint_key(self) -> str:
        """What a checkpoint depends on: image id, runsc version, runsc flags (a restore needs the same)."""
        return f"runsc {self.runsc_version} [{' '.join(self.runsc.flags)}] image {self.image_id[:19]}"

    def checkpoint_owner(self, image_dir: Path) -> tuple[int, int] | None:
        """The host (uid, gid) a checkpoint's processes keep: its restored copy must run as them."""
        return checkpoint_owner(image_dir)

    async def spawn(
        self, spec: SandboxSpec, argv: list[str], task_group: TaskGroup, *, pipes: bool = False
    ) -> SandboxProcess:
        with start_failures(self.name):
            problem = self.network_problem(spec.network)
            if problem:
                raise ContainerUnavailable(problem)
            inner = inner_argv(spec, argv, pipes=pipes)
            return await self._launch(spec, inner, task_group, pipes=pipes, image_dir=None)

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

    def _ids(self, spec: SandboxSpec | None) -> tuple[int, int]:
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
        for point in mount_points(spec, self.dev_guest_lib):
            (upper / point.lstrip("/")).mkdir(mode=0o755, parents=True, exist_ok=True)
        for path in (upper, work, self.rootfs):
            if any(c in str(path) for c in ",:"):
                raise ContainerUnavailable(f"the gvisor backend cannot use a path with ',' or ':': {path}")
        options = f"lowerdir={self.rootfs},upperdir={upper},workdir={work}"
        done = self.call_sync(["mount", "-t", "overlay", "-o", options, "overlay", str(rootfs)], MOUNT_TIMEOUT_S)
        if done is None or done.returncode != 0:
            said = done.stderr.strip()[-300:] if done else "timed out"
            raise ContainerUnavailable(f"could not mount the sandbox's root file system: {said}")
        uid, gid = self._ids(None)
        inputs = ConfigInputs(rootfs, uid, gid, container, self.nofile, self.nproc, self.dev_guest_lib)
        config = oci_config(spec, inner, inputs, pipes=pipes)
        (bundle / "config.json").write_text(json.dumps(config, indent=1))
        return bundle

    async def _launch(
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

    async def checkpoint(self, process: SandboxProcess, image_dir: Path, timeout_s: float) -> None:
        """Quiesce the relay (USR1, 'closed n'), `runsc checkpoint` into image_dir (an empty host-only
        dir), then delete the container and release its rootfs: `process` has ended afterwards.

        Quiescing failed: the relay is told to bind again and the sandbox runs on (CheckpointError).
        runsc failed: the sandbox is gone (killed fully; CheckpointError with runsc's reason)."""
        assert isinstance(process, GvisorProcess), "not a gvisor sandbox"
        run_dir = process.spec.runtime_dir
        found = read_relay_state(run_dir)
        before = found[1] if found else process.relay_generation
        try:
            said = await self.call(self.runsc.kill(process.container, "USR1"), RUNSC_CALL_S)
            if said is None or said.returncode != 0:
                raise CheckpointError(f"could not signal the sandbox: {short_reason(said.stderr if said else '')}")
            wait_s = min(timeout_s, RELAY_WAIT_S)
            process.relay_generation = await wait_relay(run_dir, "closed", before, wait_s, process)
        except BaseException:  # refused, or cancelled while quiescing: the relay binds again
            with anyio.CancelScope(shield=True):
                if process.alive:
                    await anyio.to_thread.run_sync(clear_relay_sockets, run_dir)
                    await self.call(self.runsc.kill(process.container, "USR2"), RUNSC_CALL_S)
            raise
        # From here every step is bounded and runs to its end: a half-done checkpoint owns a stopped sandbox.
        with anyio.CancelScope(shield=True):
            done = await self.call(self.runsc.checkpoint(image_dir, process.container), timeout_s)
            if done is None or done.returncode != 0:
                await process.kill()
                reason = short_reason(done.stderr) if done else f"it did not finish within {timeout_s:g} s"
                raise CheckpointError(f"runsc could not checkpoint the sandbox: {reason}")
            with anyio.move_on_after(KILL_WAIT_S):
                await process.wait()  # runsc run returns once its container has stopped
            await process.kill()
            await anyio.to_thread.run_sync(write_owner, image_dir, self._ids(process.spec))

    async def restore(
        self, spec: SandboxSpec, image_dir: Path, task_group: TaskGroup, timeout_s: float
    ) -> SandboxProcess:
        """A new container from `spec` started by `runsc restore --image-path image_dir`; then USR2 and
        wait for 'open n': the relay has bound the kernel's sockets again in spec.runtime_dir.
        Raises CheckpointError (with runsc's reason) and leaves nothing running on failure."""
        problem = self.network_problem(spec.network)
        if problem:
            raise CheckpointError(problem)
        owner = await anyio.to_thread.run_sync(checkpoint_owner, image_dir)
        if owner is not None and owner != self._ids(spec):
            # The restored processes keep the uid they had (it is in the image): in dirs owned by another
            # uid they could not write their run dir nor their workspace.
            raise CheckpointError(
                f"this checkpoint's sandbox ran as host uid {owner[0]}, the new one would run as uid "
                f"{self._ids(spec)[0]}: restore it into a sandbox of the same uid"
            )
        # The argv is in the image; the config needs one (runsc takes the restored process's).
        inner = inner_argv(spec, ["/bin/true"], pipes=False)
        try:
            with start_failures(self.name):
                process = await self._launch(spec, inner, task_group, pipes=False, image_dir=image_dir)
        except SandboxUnavailable as exc:
            raise CheckpointError(str(exc)) from None
        try:
            with anyio.fail_after(timeout_s):
                await self._await_running(process)
                found = read_relay_state(spec.runtime_dir)
                before = found[1] if found else 0
                await anyio.to_thread.run_sync(clear_relay_sockets, spec.runtime_dir)
                said = await self.call(self.runsc.kill(process.container, "USR2"), RUNSC_CALL_S)
                if said is None or said.returncode != 0:
                    raise CheckpointError(
                        f"could not signal the restored sandbox: {short_reason(said.stderr if said else '')}"
                    )
                process.relay_generation = await wait_relay(spec.runtime_dir, "open", before, timeout_s, process)
        except (CheckpointError, TimeoutError) as exc:
            with anyio.CancelScope(shield=True):
                tail = await process.stderr_settled() if not process.alive else process.stderr_tail()
                await process.kill()
            reason = short_reason(tail) if tail.strip() else str(exc) or f"not running within {timeout_s:g} s"
            raise CheckpointError(f"runsc could not restore the sandbox: {reason}") from None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await process.kill()
            raise
        return process

    async def _await_running(self, process: GvisorProcess) -> None:
        while True:
            if not process.alive:
                raise CheckpointError("runsc restore ended")
            done = await self.call(self.runsc.state(process.container), RUNSC_CALL_S)
            if done is not None and done.returncode == 0:
                with contextlib.suppress(ValueError):
                    if json.loads(done.stdout).get("status") == "running":
                        return
            await anyio.sleep(STATE_POLL_S)

    # --- leftovers of dead servers ---------------------------------------------------------------

    def _instances(self) -> list[tuple[Path, bool]]:
        """Other server processes' instance dirs, and whether that server still lives (holds the lock)."""
        found = []
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.backend_dir):
                if entry.name == self.instance.name or not entry.is_dir(follow_symlinks=False):
                    continue
                lock = Path(entry.path) / LOCK_NAME
                if entry.name.startswith(NEW_INSTANCE) and not lock.exists():
                    # Being made, before its lock: alive unless its maker died long ago.
                    age = time.time() - entry.stat(follow_symlinks=False).st_mtime
                    found.append((Path(entry.path), age < ABANDONED_AFTER_S))
                    continue
                found.append((Path(entry.path), _held(lock)))
        return found

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


def _held(lock: Path) -> bool:
    """Is the flock on `lock` held by a live process? (A missing lock: a half-made dir, not held.)"""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _hard_limit(kind: int, cap: int) -> int:
    hard = resource.getrlimit(kind)[1]
    return cap if hard == resource.RLIM_INFINITY else min(hard, cap)
