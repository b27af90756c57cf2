"""The Apple `container` backend (macOS 26, Apple silicon): each session's kernel in its own VM.

One lightweight Linux VM per kernel, from the same Containerfile image (built by `coderunner
setup`/install.sh with `container build`). The VM gets no network by default; the kernel's ZMQ
ipc sockets are relayed over vsock with `--publish-socket host:guest`, so the host talks to the
kernel without any network at all. The documented fallback (`kernel_channels = "tcp"`) publishes
the five channel ports on 127.0.0.1 only, which needs the container network (it allows internet).

Every `container` call has a timeout (stop/delete hangs are reported upstream); a server's VMs
are named `coderunner-<server tag>-<session>-<random>`, so leftovers are found by name prefix.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from .base import LimitReport, Limits, SandboxProcess, SandboxSpec, start_failures
from .common import IMAGE_PYTHON, NETWORK_MODES, WORKSPACE, rlimit_prefix, sandbox_environment
from .container import (
    ContainerProcess,
    ContainerUnavailable,
    channel_ports,
    connection_info,
    container_name,
    name_prefix,
    server_tag,
    session_key,
    with_guest_connection,
)
from .engine import QUERY_TIMEOUT_S, REMOVE_TIMEOUT_S, EngineError, engine_env, run_sync
from .identity import ensure_private_dir

log = logging.getLogger(__name__)

#: Inside the VM: where the session's host-only dir (connection files) is mounted read-only, and
#: the prefix of the kernel's sockets (on the VM's own disk: a unix socket cannot live on the
#: virtiofs share). The relayed sockets appear on the host in the session's run/ dir, which the VM
#: does not see; the host claims them from there like any kernel's (session_dirs.py).
GUEST_RUNTIME = "/run/coderunner/session"
GUEST_SOCKETS = "/run/coderunner/k"
STOP_WAIT_S = 2


@dataclass(frozen=True)
class AppleCommand:
    """Builds `container` argv; pure, so the exact flags are unit-testable (nothing runs here on Linux)."""

    cli: str
    image: str

    def run(
        self,
        spec: SandboxSpec,
        inner: list[str],
        name: str,
        *,
        sockets: list[tuple[str, str]] | None = None,
        tcp_ports: list[int] | None = None,
    ) -> list[str]:
        limits = spec.limits
        args = [self.cli, "run", "--rm", "--init", "--name", name]
        if limits.cpus is not None:
            args += ["--cpus", str(max(1, math.ceil(limits.cpus)))]
        if limits.memory_mb is not None:
            args += ["--memory", f"{limits.memory_mb}M"]
        # No network unless asked; TCP channels need the container network (it allows internet).
        args += ["--network", "default" if tcp_ports or spec.network == "internet" else "none"]
        for host, guest in sockets or []:
            args += ["--publish-socket", f"{host}:{guest}"]
        for port in tcp_ports or []:
            args += ["--publish", f"127.0.0.1:{port}:{port}"]  # without the IP it would listen on 0.0.0.0
        args += ["--volume", f"{spec.host_dir}:{GUEST_RUNTIME}:ro", "--volume", f"{spec.workspace}:{WORKSPACE}"]
        for mount in spec.mounts:
            args += ["--volume", f"{mount.host}:{mount.sandbox}" + ("" if mount.writable else ":ro")]
        args += ["--workdir", WORKSPACE]
        for key, value in sandbox_environment({"HOME": "/tmp/home"}).items():
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

    def system_status(self) -> list[str]:
        return [self.cli, "system", "status"]

    def image_inspect(self) -> list[str]:
        return [self.cli, "image", "inspect", self.image]


def container_id(record: dict[str, Any]) -> str | None:
    """The name a record was created with (`configuration.id`; `id` in some versions)."""
    configuration = record.get("configuration")
    if isinstance(configuration, dict) and isinstance(configuration.get("id"), str):
        return configuration["id"]
    value = record.get("id") or record.get("name")
    return value if isinstance(value, str) else None


def parse_records(output: str) -> list[dict[str, Any]]:
    """`inspect` and `list --format json` print a JSON array (or, in some versions, one object)."""
    data = json.loads(output or "[]")
    if isinstance(data, dict):
        data = [data]
    return [item for item in data if isinstance(item, dict)]


def names_with_prefix(output: str, prefix: str) -> list[str]:
    return [name for record in parse_records(output) if (name := container_id(record)) and name.startswith(prefix)]


class AppleBackend:
    """Sandboxes as Apple `container` VMs of the CodeRunner image."""

    name = "apple"
    workspace_path = WORKSPACE
    python = IMAGE_PYTHON
    dir_mode = 0o700
    identity = None

    def __init__(self, image: str, runtime_base: Path, cli: str | None = None, channels: str = "auto") -> None:
        found = cli or shutil.which("container")
        if found is None:
            raise ContainerUnavailable(
                "Apple `container` is not installed (macOS 26 on Apple silicon): run ./install.sh, or install "
                "the signed package from https://github.com/apple/container/releases"
            )
        self.channels = "ipc" if channels == "auto" else channels
        self.command = AppleCommand(cli=found, image=image)
        self.tag = server_tag(runtime_base)
        self.runtime_base = runtime_base
        self.env = engine_env(dict(os.environ))
        ensure_private_dir(runtime_base, self.dir_mode)
        self._check_ready()
        self.sweep()

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

    def describe_isolation(self) -> str:
        net = (
            "no network (kernel sockets relayed over vsock)"
            if self.channels == "ipc"
            else ("container network (kernel ports published on 127.0.0.1)")
        )
        return (
            "Apple container: its own lightweight Linux VM (Virtualization.framework) per session, "
            f"VM memory and vCPU limits, {net}, only the session workspace and chosen folders shared"
        )

    def limit_reports(self, limits: Limits) -> dict[str, LimitReport]:
        return {
            "memory_mb": LimitReport(limits.memory_mb, "RLIMIT_AS + VM memory" if limits.memory_mb else None),
            "cpus": LimitReport(limits.cpus, "VM vCPUs (rounded up)" if limits.cpus else None),
            "pids": LimitReport(limits.pids, "RLIMIT_NPROC inside the VM" if limits.pids else None),
            "tmp_mb": LimitReport(limits.tmp_mb, None),
        }

    def network_problem(self, network: str) -> str | None:
        if network not in NETWORK_MODES:
            return f"unknown network mode {network!r}: use 'none', 'allowlist' or 'internet'"
        if network == "allowlist":
            # --publish-socket relays guest -> host listeners only (direction .outOf). The other way
            # exists too: a --volume whose source is a host socket becomes a relay into the guest
            # (apple/container SandboxService: UnixSocketConfiguration, default direction .into), which
            # could carry the proxy socket; it is not wired up or tested here, so refuse, never pretend.
            return (
                "network 'allowlist' is not available with Apple `container` yet (the policy proxy's socket "
                "is not relayed into the VM): use network 'none', or 'internet' (unfiltered), or run the "
                "server on Linux (bwrap or podman)"
            )
        if network == "none" and self.channels == "tcp":
            return "kernel_channels 'tcp' needs the container network: use network 'internet' or kernel_channels 'ipc'"
        return None

    def plan(self, spec: SandboxSpec, argv: list[str], name: str) -> list[str]:
        """The `container run` argv for this kernel: channels relayed or published, paths as the VM sees them."""
        info = connection_info(argv)
        # A dedicated VM: RLIMIT_NPROC of its one user is exactly the session's process limit.
        prefix = rlimit_prefix(spec.limits, spec.limits.pids, memory_cgroup=True)
        ports = channel_ports(info)
        if self.channels == "tcp":
            inner = with_guest_connection(argv, "0.0.0.0", GUEST_RUNTIME)
            return self.command.run(spec, [*prefix, *inner], name, tcp_ports=ports)
        inner = with_guest_connection(argv, GUEST_SOCKETS, GUEST_RUNTIME)
        sockets = [(f"{info['ip']}-{port}", f"{GUEST_SOCKETS}-{port}") for port in ports]
        return self.command.run(spec, [*prefix, *inner], name, sockets=sockets)

    async def spawn(
        self, spec: SandboxSpec, argv: list[str], task_group: TaskGroup, *, pipes: bool = False
    ) -> SandboxProcess:
        with start_failures("Apple container"):
            return await self._spawn(spec, argv, task_group, pipes=pipes)

    async def _spawn(
        self, spec: SandboxSpec, argv: list[str], task_group: TaskGroup, *, pipes: bool = False
    ) -> SandboxProcess:
        if pipes:
            # The VM sees the runtime dir at another path, and one-shot runs name files in it.
            raise ContainerUnavailable(
                "one-shot runs (execute_code, validate_code) are not available on the Apple container backend "
                "yet: use run_python in a session"
            )
        problem = self.network_problem(spec.network)
        if problem:
            raise ContainerUnavailable(problem)
        name = container_name(self.tag, session_key(spec))
        process = await anyio.open_process(
            self.plan(spec, argv, name),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=self.env,
        )
        cleanup = [self.command.stop(name), self.command.delete(name)]
        return ContainerProcess(process, task_group, cleanup=cleanup, engine_env=self.env)

    def remove_stale(self, name: str) -> None:
        self._remove_prefixed(name_prefix(self.tag, name))

    def sweep(self) -> None:
        """At start: delete this configuration's VMs whose session dir is gone."""
        output = self._query(self.command.list_all())
        prefix = name_prefix(self.tag)
        for name in names_with_prefix(output or "[]", prefix):
            session = name[len(prefix) :].rsplit("-", 1)[0]
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
