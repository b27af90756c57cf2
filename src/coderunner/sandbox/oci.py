"""The OCI backend: one podman or docker container per kernel, from the CodeRunner image.

Security parity with bwrap where the engine allows: no network, no capabilities, no new
privileges, a read-only root with a size-capped /tmp, memory/cpu/pids limits from the session,
an explicit environment (nothing of the host's), and no host paths but the session's workspace,
its runtime dir and the configured mounts. A root server runs the container as its unprivileged
sandbox user (--user); a rootless podman maps the server's own user (--userns=keep-id).

Kernel channels: where the engine shares the host kernel (Linux) the runtime dir is bound at the
same path and the ipc:// sockets just work, with no network. Where it does not (Docker Desktop's
VM), they are TCP ports published on 127.0.0.1 only, which needs the engine's network.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import resource
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup

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
from coderunner.sandbox.common import IMAGE_PYTHON, rlimit_prefix
from coderunner.sandbox.container import (
    LABEL_INSTANCE,
    ContainerProcess,
    ContainerUnavailable,
    channel_ports,
    connection_info,
    container_name,
    server_tag,
    session_key,
    with_guest_connection,
)
from coderunner.sandbox.engine import QUERY_TIMEOUT_S, REMOVE_TIMEOUT_S, EngineError, engine_env, run_sync
from coderunner.sandbox.identity import shared_dir_mode
from coderunner.sandbox.image_build import sources_digest
from coderunner.sandbox.oci_argv import NOFILE, OciCommand, parse_server_containers
from coderunner.sandbox.seccomp import tightened_profile
from coderunner.sandbox.watcher import Watcher, WatchPlan
from coderunner.vocabulary.backends import install_hint
from coderunner.vocabulary.host_identity import HostIdentity
from coderunner.vocabulary.network import NetworkMode
from coderunner.vocabulary.sandbox_layout import WORKSPACE

if TYPE_CHECKING:
    from coderunner.config import Settings

__all__ = ["OciBackend", "OciCommand", "build", "parse_server_containers", "write_seccomp_profile"]

log = logging.getLogger(__name__)

ENGINES = ("podman", "docker")
#: Where podman's default seccomp profile lives (containers-common), most specific first.
ENGINE_SECCOMP_PROFILES = (Path("/etc/containers/seccomp.json"), Path("/usr/share/containers/seccomp.json"))
#: Exit codes of an engine client that could not create or start the container (125: engine
#: error, 126: the runtime could not start the command, 127: command not found).
ENGINE_FAILURE_CODES = (125, 126, 127)
START_ATTEMPTS = 2
#: Processes per host uid (RLIMIT_NPROC) inside; runc here refuses values near the host's own limit.
NPROC = 4096


def write_seccomp_profile(runtime_base: Path) -> Path | None:
    """podman's default profile (containers-common) tightened to refuse what bwrap refuses.

    None where the default profile is not on disk (the engine's built-in one applies then).
    """
    for source in ENGINE_SECCOMP_PROFILES:
        if source.is_file():
            try:
                profile = tightened_profile(json.loads(source.read_text()))
            except (OSError, ValueError) as exc:
                log.warning("cannot use the seccomp profile %s: %s", source, exc)
                return None
            text = json.dumps(profile, indent=1, sort_keys=True)
            target = runtime_base / f"seccomp-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
            if not target.exists():
                staging = target.with_suffix(f".{os.getpid()}.tmp")
                staging.write_text(text)
                os.chmod(staging, 0o644)
                os.replace(staging, target)
            return target
    return None


def _hard_limit(kind: int, cap: int) -> int:
    """A ulimit the engine may set: no higher than the server's own hard limit."""
    hard = resource.getrlimit(kind)[1]
    return cap if hard == resource.RLIM_INFINITY else min(hard, cap)


def build(settings: Settings) -> OciBackend:
    """The registry's builder (podman and docker): a container backend as the settings say."""
    return OciBackend(
        settings.backend,
        settings.image,
        settings.runtime_dir,
        identity=backend_identity(settings),
        runtime=settings.oci_runtime,
        channels=settings.kernel_channels,
    )


class OciBackend(SandboxBackend):
    """Sandboxes as podman or docker containers of the CodeRunner image."""

    workspace_path = WORKSPACE
    python = IMAGE_PYTHON
    unavailable = ContainerUnavailable

    def __init__(
        self,
        kind: str,
        image: str,
        runtime_base: Path,
        identity: HostIdentity | None = None,
        engine: str | None = None,
        runtime: str | None = None,
        channels: str = "auto",
        runtime_flags: tuple[str, ...] = (),
    ) -> None:
        if kind not in ENGINES:
            raise ContainerUnavailable(f"unknown engine {kind!r}: use podman or docker")
        found = engine or shutil.which(kind)
        if found is None:
            raise ContainerUnavailable(f"{kind} is not installed: {install_hint(kind)}")
        self.name = kind
        self.identity = identity
        self.dir_mode = shared_dir_mode(identity)
        #: Where the kernel's channels go: ipc sockets in the bound runtime dir, or loopback TCP.
        self.channels = KernelChannels.chosen(
            channels, KernelChannels.IPC if sys.platform.startswith("linux") else KernelChannels.TCP
        )
        ensure_private_dir(runtime_base, self.dir_mode)
        self.runtime_base = runtime_base
        rootless = os.getuid() != 0
        if identity is not None:
            user: str | None = f"{identity.uid}:{identity.gid}"
        elif rootless and sys.platform.startswith("linux"):
            user = f"{os.getuid()}:{os.getgid()}"
        else:
            user = None
        instance = secrets.token_hex(8)
        self.command = OciCommand(
            engine=found,
            kind=kind,
            image=image,
            server=server_tag(runtime_base),
            runtime=runtime,
            user=user,
            keep_id=kind == "podman" and rootless,
            nofile=_hard_limit(resource.RLIMIT_NOFILE, NOFILE),
            nproc=_hard_limit(resource.RLIMIT_NPROC, NPROC) if kind == "podman" else None,
            seccomp_profile=write_seccomp_profile(runtime_base) if kind == "podman" else None,
            instance=instance,
            runtime_flags=runtime_flags,
        )
        self.env = engine_env(dict(os.environ))
        plan = WatchPlan(self.command.base(), kind, f"{LABEL_INSTANCE}={instance}")
        #: Removes this process's containers when it dies (started with the first container).
        self.watcher = Watcher(plan, self.env)
        self._check_image()
        self.sweep()

    def _check_image(self) -> None:
        try:
            done = run_sync(self.command.image_exists(), QUERY_TIMEOUT_S, check=False, env=self.env)
        except EngineError as exc:
            raise ContainerUnavailable(f"{self.name} does not answer: {exc}") from None
        if done.returncode != 0:
            raise ContainerUnavailable(
                f"the sandbox image {self.command.image} is not built for {self.name}: run "
                f"`coderunner setup --backend {self.name}` ({done.stderr.strip()[-300:]})"
            )
        with contextlib.suppress(OSError):
            if (built := done.stdout.strip()) and built != sources_digest():
                log.warning(
                    "the sandbox image %s was built from older sources (guest tools may not match this server): "
                    "run `coderunner setup --backend %s`",
                    self.command.image,
                    self.name,
                )

    def host_dir_inside(self, spec: SandboxSpec) -> str:
        """The host-only dir is bound read-only at its own path."""
        return str(spec.host_dir)

    def describe_isolation(self) -> str:
        net = "no network" if self.channels == "ipc" else "loopback-published kernel ports"
        user = f"; host user {self.identity.name}" if self.identity else ""
        seccomp = "seccomp (engine profile + the bwrap denials)" if self.command.seccomp_profile else "engine seccomp"
        return (
            f"{self.name} container ({self.command.runtime or 'default runtime'}): own namespaces, {seccomp}, "
            f"no capabilities, no-new-privileges, read-only root, size-capped /tmp, {net} by "
            f"default, only the session workspace writable; container memory/cpu/pids limits{user}"
        )

    def limit_reports(self, limits: Limits) -> dict[str, LimitReport]:
        return {
            "memory_mb": LimitReport(
                limits.memory_mb, "RLIMIT_AS + container memory limit" if limits.memory_mb else None
            ),
            "cpus": LimitReport(limits.cpus, "container cpu quota" if limits.cpus else None),
            "pids": LimitReport(limits.pids, "container pids limit" if limits.pids else None),
            "tmp_mb": LimitReport(limits.tmp_mb, "tmpfs size" if limits.tmp_mb else None),
        }

    def mode_problem(self, mode: NetworkMode) -> str | None:
        if mode in (NetworkMode.NONE, NetworkMode.ALLOWLIST) and self.channels == "tcp":
            return (
                f"{self.name} here reaches the kernel over published TCP ports, which needs the engine's "
                f"network, so network {mode.value!r} cannot be had: use network 'internet', or a Linux host "
                "(ipc sockets, no network)"
            )
        return None

    async def start(self, spec: SandboxSpec, argv: list[str], task_group: TaskGroup, *, pipes: bool) -> SandboxProcess:
        ports = None
        if self.channels == "tcp" and not pipes:  # a one-shot run has no kernel channels
            ports = channel_ports(connection_info(argv))
            argv = with_guest_connection(argv, "0.0.0.0")
        # RLIMIT_AS as a soft limit gives user code a clean MemoryError; the container's memory
        # limit is the hard bound (Chromium lifts the soft one for itself, as under bwrap).
        inner = [*rlimit_prefix(spec.limits, None, memory_cgroup=True), *argv]
        # Without a network the engine would still copy the host's /etc/hosts and resolv.conf in.
        etc_dir = spec.etc_dir if spec.network != NetworkMode.INTERNET else None
        for attempt in range(1, START_ATTEMPTS + 1):
            name = container_name(self.command.server, session_key(spec))
            sandbox = await self._start(spec, inner, name, task_group, ports, etc_dir, pipes)
            if not sys.platform.startswith("linux"):
                return sandbox
            # Wait until it runs (its host pid is also what memory use is measured on). An engine
            # that failed to create it (seen rarely: runc/netavark races) gets one more try.
            try:
                running = await sandbox.watch_pid(self.command.inspect_pid(name))
            except BaseException:  # cancelled (a server stopping mid-start): no container, nor its pipes, left
                with anyio.CancelScope(shield=True):
                    await sandbox.kill()
                raise
            if running or attempt == START_ATTEMPTS or sandbox.returncode not in ENGINE_FAILURE_CODES:
                return sandbox
            await anyio.sleep(0.05)  # let the engine's last words reach the stderr tail
            log.warning("%s could not create a container, trying again: %s", self.name, sandbox.stderr_tail()[-500:])
            await sandbox.kill()
        raise AssertionError("unreachable")

    async def _start(
        self,
        spec: SandboxSpec,
        inner: list[str],
        name: str,
        task_group: TaskGroup,
        ports: list[int] | None,
        etc_dir: Path | None,
        pipes: bool = False,
    ) -> ContainerProcess:
        # Before the container exists, so that no container of ours is ever unwatched.
        self.watcher.ensure_running()
        full = self.command.run(spec, inner, name, tcp_ports=ports, etc_dir=etc_dir, interactive=pipes)
        process = await anyio.open_process(
            full,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=self.env,
            # conmon writes files (an "oom" marker) into its working dir: a host-only one.
            cwd=self.runtime_base,
        )
        return ContainerProcess(
            process,
            task_group,
            cleanup=[self.command.remove(name)],
            engine_env=self.env,
            pipes=pipes,
            inspect_pid=self.command.inspect_pid(name) if sys.platform.startswith("linux") else None,
        )

    def remove_stale(self, name: str) -> None:
        """Remove containers a dead server left for session `name` (found by label)."""
        for container, session in self._server_containers():
            if session == name:
                self._remove(container)

    def sweep(self) -> None:
        """At start: remove this configuration's containers whose session dir is gone."""
        for container, session in self._server_containers():
            if not (self.runtime_base / session).exists():
                self._remove(container)

    def _server_containers(self) -> list[tuple[str, str]]:
        try:
            done = run_sync(self.command.list_server(), QUERY_TIMEOUT_S, check=False, env=self.env)
        except EngineError as exc:
            log.warning("could not list leftover containers: %s", exc)
            return []
        return parse_server_containers(done.stdout)

    def _remove(self, container: str) -> None:
        try:
            run_sync(self.command.remove(container), REMOVE_TIMEOUT_S, check=False, env=self.env)
            log.info("removed container %s left by a server that is gone", container)
        except EngineError as exc:
            log.warning("could not remove leftover container: %s", exc)
