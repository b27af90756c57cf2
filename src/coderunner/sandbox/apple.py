"""The Apple `container` backend (macOS 26, Apple silicon): each session's kernel in its own VM.

One lightweight Linux VM per kernel, from the same Containerfile image (built by `coderunner
setup`/install.sh with `container build`). The VM gets no network by default; the kernel's ZMQ
ipc sockets are relayed over vsock with `--publish-socket host:guest` (the host side listens and
each connection is dialled into the guest socket), so the host talks to the kernel without any
network at all. The fallback (`kernel_channels = "tcp"`) publishes the five channel ports on the
host's 127.0.0.1, which needs the container network (it allows internet). `--publish` forwards to
the VM's address on that network, so the kernel binds that address (never 0.0.0.0), and its ports
are reachable there from the host and from other containers on the same network.

Read against apple/container's sources, tags 0.5.0 to 1.2.2: the flags of `run` and friends in
Sources/ContainerClient/Flags.swift (to 0.7.1) and Sources/Services/ContainerAPIService/Client/
Flags.swift (from 0.8.0), with Parser.swift and Utility.swift beside them; the `inspect`/`list`
JSON in ContainerList.swift (PrintableContainer, 0.x) and ManagedContainer.swift (1.x);
`--publish` in Sources/Services/RuntimeLinux/Server/RuntimeService.swift. What differs by version
is in `ContainerVersion` below. tests/emulators/container is a stand-in that follows the same
sources, so that this backend runs end to end on Linux.

Every `container` call has a timeout (stop/delete hangs are reported upstream); a server's VMs
are named `coderunner-<server tag>-<session>-<random>`, so leftovers are found by name prefix.

One idea: the Apple `container` backend's sandbox lifecycle (build the argv, run, relay the channels, stop,
delete); its versions, readiness and doctor are beside it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup

from coderunner.hostfs.private_dirs import ensure_private_dir
from coderunner.sandbox.apple_ready import GuestReady
from coderunner.sandbox.apple_version import (
    INIT_VERSION,
    MIN_VERSION,
    PINNED_VERSION,
    SECRET_VERSION,
    UPGRADE_HINT,
    ContainerVersion,
    version_caveat,
    version_problem,
)
from coderunner.sandbox.base import KernelChannels, LimitReport, Limits, SandboxBackend, SandboxProcess, SandboxSpec
from coderunner.sandbox.common import IMAGE_PYTHON, product_python, rlimit_prefix, sandbox_environment, spec_environment
from coderunner.sandbox.container import (
    CREATE_SETTLE_S,
    ContainerProcess,
    ContainerUnavailable,
    channel_ports,
    connection_info,
    name_prefix,
    server_tag,
    session_key,
    with_guest_connection,
)
from coderunner.sandbox.engine import QUERY_TIMEOUT_S, REMOVE_TIMEOUT_S, EngineError, engine_env, run_sync
from coderunner.sandbox.watcher import Watcher, WatchPlan
from coderunner.vocabulary.network import NetworkMode
from coderunner.vocabulary.sandbox_layout import WORKSPACE

if TYPE_CHECKING:
    from coderunner.config import Settings

__all__ = [
    "GUEST_RUNTIME",
    "GUEST_SOCKETS",
    "GUEST_STATE",
    "INIT_VERSION",
    "MIN_VERSION",
    "PINNED_VERSION",
    "SECRET_VERSION",
    "UPGRADE_HINT",
    "AppleBackend",
    "AppleCommand",
    "ContainerVersion",
    "GuestReady",
    "build",
    "container_id",
    "instance_mark",
    "names_with_prefix",
    "parse_records",
    "version_caveat",
    "version_problem",
    "vm_name",
]

log = logging.getLogger(__name__)

#: Inside the VM: where the session's host-only dir (connection files) is mounted read-only.
GUEST_RUNTIME = "/run/coderunner/session"
#: The prefix of the kernel's sockets inside the VM. They must stay on the image's own root
#: filesystem: the relay resolves the guest path under the container's rootfs (apple/container
#: #2101), so a socket on a tmpfs, a virtiofs share or under a future `--read-only` root is
#: invisible to it. /run/coderunner is a directory of the image (Containerfile), hence here.
GUEST_SOCKETS = "/run/coderunner/k"
#: Inside the VM: a writable share where the guest marks its kernel ready (see GuestReady).
GUEST_STATE = "/run/coderunner/state"
STOP_WAIT_S = 2
#: Bound on a VM's boot plus the kernel's start until its sockets are bound.
READY_TIMEOUT_S = 120.0
#: The guest's first process (src/coderunner/guest/vm_init.py).
VM_INIT = "coderunner_guest.vm_init"


@dataclass(frozen=True)
class AppleCommand:
    """Builds `container` argv for one version; pure, so the exact flags are unit-testable."""

    cli: str
    image: str
    version: ContainerVersion = PINNED_VERSION

    def run(
        self,
        spec: SandboxSpec,
        inner: list[str],
        name: str,
        *,
        sockets: list[tuple[str, str]] | None = None,
        tcp_ports: list[int] | None = None,
        state_dir: Path | None = None,
    ) -> list[str]:
        limits = spec.limits
        args = [self.cli, "run", "--rm", *(["--init"] if self.version.has_init else []), "--name", name]
        if limits.cpus is not None:
            args += ["--cpus", str(max(1, math.ceil(limits.cpus)))]
        if limits.memory_mb is not None:
            args += ["--memory", f"{limits.memory_mb}M"]
        # No network unless asked. Without `--network` the VM joins the default network; TCP
        # channels need it (and it allows internet).
        if not tcp_ports and spec.network != NetworkMode.INTERNET:
            args += ["--network", "none"]
        for host, guest in sockets or []:
            args += ["--publish-socket", f"{host}:{guest}"]
        for port in tcp_ports or []:
            args += ["--publish", f"127.0.0.1:{port}:{port}"]  # without the IP it would listen on 0.0.0.0
        args += ["--volume", f"{spec.host_dir}:{GUEST_RUNTIME}:ro", "--volume", f"{spec.workspace}:{WORKSPACE}"]
        if state_dir is not None:
            args += ["--volume", f"{state_dir}:{GUEST_STATE}"]
        for mount in spec.mounts:
            args += ["--volume", f"{mount.host}:{mount.sandbox}" + ("" if mount.writable else ":ro")]
        args += ["--workdir", WORKSPACE]
        for key, value in sandbox_environment({"HOME": "/tmp/home", **spec_environment(spec)}).items():
            args += ["--env", f"{key}={value}"]
        return [*args, self.image, *inner]

    def stop(self, name: str) -> list[str]:
        return [self.cli, "stop", "--time", str(STOP_WAIT_S), name]

    def delete(self, name: str) -> list[str]:
        return [self.cli, "delete", "--force", name]

    def inspect(self, name: str) -> list[str]:
        return [self.cli, "inspect", name]

    def list_all(self) -> list[str]:
        return [self.cli, "list", "--all", "--format", "json"]

    def version_query(self) -> list[str]:
        return [self.cli, "--version"]

    def system_status(self) -> list[str]:
        return [self.cli, "system", "status"]

    def image_inspect(self) -> list[str]:
        return [self.cli, "image", "inspect", self.image]


def container_id(record: dict[str, Any]) -> str | None:
    """The name a record was created with: `configuration.id` in every release (0.x PrintableContainer
    prints only that; 1.x ManagedContainer also a top-level `id`, the same value)."""
    configuration = record.get("configuration")
    if isinstance(configuration, dict) and isinstance(configuration.get("id"), str):
        return configuration["id"]
    value = record.get("id") or record.get("name")
    return value if isinstance(value, str) else None


def parse_records(output: str) -> list[dict[str, Any]]:
    """`inspect` and `list --format json` print a JSON array in every release (0.x compact, 1.x
    pretty in `inspect`); an object alone is taken as a one-record array."""
    data = json.loads(output or "[]")
    if isinstance(data, dict):
        data = [data]
    return [item for item in data if isinstance(item, dict)]


def instance_mark(instance: str) -> str:
    """What only this server process's VM names contain (the watcher's needle)."""
    return f"-{instance}-"


def vm_name(tag: str, session: str, instance: str) -> str:
    """`coderunner-<tag>-<session>-<instance>-<random>`: found by configuration (the prefix, for the
    start's sweep and remove_stale), by session, and by server process (the watcher)."""
    return f"{name_prefix(tag, session)}{instance}-{secrets.token_hex(3)}"


def names_with_prefix(output: str, prefix: str) -> list[str]:
    return [name for record in parse_records(output) if (name := container_id(record)) and name.startswith(prefix)]


def ready_name(container: str) -> str:
    return f"{container}.ready"


def build(settings: Settings) -> AppleBackend:
    """The registry's builder: an Apple `container` backend as the settings say."""
    return AppleBackend(settings.image, settings.runtime_dir, channels=settings.kernel_channels)


class AppleBackend(SandboxBackend):
    """Sandboxes as Apple `container` VMs of the CodeRunner image."""

    name = "apple"
    workspace_path = WORKSPACE
    python = IMAGE_PYTHON
    dir_mode = 0o700
    identity = None
    # 'allowlist' is refused (see refusal).
    network_modes = frozenset({NetworkMode.NONE, NetworkMode.INTERNET})
    # The VM sees the runtime dir at another path, and one-shot runs name files in it.
    pipes_refusal = (
        "one-shot runs (execute_code) are not available on the Apple container backend yet: use run_python in a session"
    )
    start_label = "Apple container"
    unavailable = ContainerUnavailable

    def __init__(self, image: str, runtime_base: Path, cli: str | None = None, channels: str = "auto") -> None:
        found = cli or shutil.which("container")
        if found is None:
            raise ContainerUnavailable(
                "Apple `container` is not installed (macOS 26 on Apple silicon): run ./install.sh, or install "
                f"the signed package {PINNED_VERSION} from https://github.com/apple/container/releases"
            )
        self.channels = KernelChannels.chosen(channels, KernelChannels.IPC)
        self.runtime_base = runtime_base
        self.env = engine_env(dict(os.environ))
        self.version = self._read_version(found)
        self.command = AppleCommand(cli=found, image=image, version=self.version)
        self.tag = server_tag(runtime_base)
        #: This server process's mark in its VMs' names: servers of one configuration (Claude Desktop's
        #: and Cursor's) share the tag, and one's end must never remove the other's live VMs.
        self.instance = secrets.token_hex(4)
        # A `container run` client lives in a session of its own (so a kill reaches all of it), which
        # the end of the server does not reach: if the server dies before removing its VMs (SIGKILL,
        # or a client's kill escalation while a VM stops slowly), the watcher removes this process's
        # VMs (and only those), and each client exits with its VM.
        self.watcher = Watcher(WatchPlan([found], "apple", instance_mark(self.instance)), self.env)
        ensure_private_dir(runtime_base, self.dir_mode)
        self._check_ready()
        self.sweep()

    def _read_version(self, cli: str) -> ContainerVersion:
        """Once, at start: the argv differs by version, and too old a one is refused."""
        output = self._query([cli, "--version"])
        version = ContainerVersion.parse(output or "")
        if (problem := version_problem(version)) is not None:
            raise ContainerUnavailable(f"{problem}: {UPGRADE_HINT}")
        assert version is not None
        return version

    def _query(self, argv: list[str]) -> str | None:
        """stdout of a bounded query, or None when it failed."""
        try:
            done = run_sync(argv, QUERY_TIMEOUT_S, check=False, env=self.env)
        except EngineError as exc:
            log.warning("%s", exc)
            return None
        return done.stdout if done.returncode == 0 else None

    def _check_ready(self) -> None:
        if self._query(self.command.system_status()) is None:
            raise ContainerUnavailable(
                "the container system service is not running: container system start --enable-kernel-install"
            )
        if self._query(self.command.image_inspect()) is None:
            raise ContainerUnavailable(
                f"the sandbox image {self.command.image} is not built: coderunner setup --backend apple"
            )

    def host_dir_inside(self, spec: SandboxSpec) -> str:
        """The host-only dir is bound read-only at GUEST_RUNTIME in the VM."""
        return GUEST_RUNTIME

    def describe_isolation(self) -> str:
        net = (
            "no network (kernel sockets relayed over vsock)"
            if self.channels == "ipc"
            else (
                "the container network (internet allowed); kernel ports published on the host's 127.0.0.1 "
                "and also reachable at the VM's address from the host and other containers"
            )
        )
        return (
            f"Apple container {self.version}: its own lightweight Linux VM (Virtualization.framework) per session, "
            f"VM memory and vCPU limits, {net}, only the session workspace and chosen folders shared"
        )

    def limit_reports(self, limits: Limits) -> dict[str, LimitReport]:
        return {
            "memory_mb": LimitReport(limits.memory_mb, "RLIMIT_AS + VM memory" if limits.memory_mb else None),
            "cpus": LimitReport(limits.cpus, "VM vCPUs (rounded up)" if limits.cpus else None),
            "pids": LimitReport(limits.pids, "RLIMIT_NPROC inside the VM" if limits.pids else None),
            "tmp_mb": LimitReport(limits.tmp_mb, None),
        }

    def refusal(self, mode: NetworkMode) -> str:
        # --publish-socket relays guest -> host listeners only (direction .outOf). The other way
        # exists too: a --volume whose source is a host socket becomes a relay into the guest
        # (apple/container SandboxService: UnixSocketConfiguration, default direction .into), which
        # could carry the proxy socket; it is not wired up or tested here, so refuse, never pretend.
        return (
            "network 'allowlist' is not available with Apple `container` yet (the policy proxy's socket "
            "is not relayed into the VM): use network 'none', or 'internet' (unfiltered), or run the "
            "server on Linux (bwrap or podman)"
        )

    def mode_problem(self, mode: NetworkMode) -> str | None:
        if mode is NetworkMode.NONE and self.channels == "tcp":
            return "kernel_channels 'tcp' needs the container network: use network 'internet' or kernel_channels 'ipc'"
        return None

    def plan(self, spec: SandboxSpec, argv: list[str], name: str, state_dir: Path | None = None) -> list[str]:
        """The `container run` argv for this kernel: channels relayed or published, paths as the VM sees them.

        The kernel runs under the guest's first process (vm_init), which reaps (there is no
        `--init` before 0.10.0) and creates `<name>.ready` in the state share once the kernel's
        sockets are bound.
        """
        info = connection_info(argv)
        # A dedicated VM: RLIMIT_NPROC of its one user is exactly the session's process limit.
        prefix = rlimit_prefix(spec.limits, spec.limits.pids, memory_cgroup=True)
        ports = channel_ports(info)
        guard = product_python(IMAGE_PYTHON, "-m", VM_INIT, "--ready", f"{GUEST_STATE}/{ready_name(name)}")
        if self.channels == "tcp":
            # vm_init puts the VM's own address in place of this one before the kernel starts.
            inner = with_guest_connection(argv, "0.0.0.0", GUEST_RUNTIME)
            guard += ["--tcp-own-address", "--"]
            return self.command.run(spec, [*guard, *prefix, *inner], name, tcp_ports=ports, state_dir=state_dir)
        inner = with_guest_connection(argv, GUEST_SOCKETS, GUEST_RUNTIME)
        sockets = [(f"{info['ip']}-{port}", f"{GUEST_SOCKETS}-{port}") for port in ports]
        for _host, guest in sockets:
            guard += ["--socket", guest]
        guard.append("--")
        return self.command.run(spec, [*guard, *prefix, *inner], name, sockets=sockets, state_dir=state_dir)

    async def start(self, spec: SandboxSpec, argv: list[str], task_group: TaskGroup, *, pipes: bool) -> SandboxProcess:
        name = vm_name(self.tag, session_key(spec), self.instance)
        self.watcher.ensure_running()
        with GuestReady(spec.runtime_dir, ready_name(name), spec.owner) as ready:
            process = await anyio.open_process(
                self.plan(spec, argv, name, ready.path),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env=self.env,
            )
            cleanup = [self.command.stop(name), self.command.delete(name)]
            sandbox = ContainerProcess(process, task_group, cleanup=cleanup, engine_env=self.env)
            try:
                await ready.wait(sandbox, READY_TIMEOUT_S)
            except BaseException as exc:
                with anyio.CancelScope(shield=True):
                    if isinstance(exc, anyio.get_cancelled_exc_class()):
                        # Not while `container run` still makes the VM (a start cancelled part way): a client
                        # killed then may leave it half made, past the delete that follows (ContainerProcess._kill).
                        with contextlib.suppress(ContainerUnavailable):  # not ready within it: killed as it is
                            await ready.wait(sandbox, CREATE_SETTLE_S)
                    await sandbox.kill()
                raise
        return sandbox

    def remove_stale(self, name: str) -> None:
        self._remove_prefixed(name_prefix(self.tag, name))

    def sweep(self) -> None:
        """At start: delete this configuration's VMs whose session dir is gone."""
        output = self._query(self.command.list_all())
        prefix = name_prefix(self.tag)
        for name in names_with_prefix(output or "[]", prefix):
            session = name[len(prefix) :].split("-", 1)[0]  # a key has no '-' (session_dirs.KEY)
            if not (self.runtime_base / session).exists():
                self._delete(name)

    def _remove_prefixed(self, prefix: str) -> None:
        output = self._query(self.command.list_all())
        for name in names_with_prefix(output or "[]", prefix):
            self._delete(name)

    def _delete(self, name: str) -> None:
        for argv in (self.command.stop(name), self.command.delete(name)):
            try:
                run_sync(argv, REMOVE_TIMEOUT_S, check=False, env=self.env)
            except EngineError as exc:
                log.warning("could not remove leftover VM: %s", exc)
