"""The podman/docker argv of one container: pure, so the exact flags are unit-testable."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coderunner.sandbox.base import SandboxSpec
from coderunner.sandbox.common import (
    IMAGE_PYTHON,
    PROC_MASKED_DIRS,
    PROC_MASKED_FILES,
    SHM_MB,
    egress_launcher,
    sandbox_environment,
    spec_environment,
)
from coderunner.sandbox.container import LABEL_INSTANCE, LABEL_SERVER, LABEL_SESSION, ContainerUnavailable, session_key
from coderunner.sandbox.image_build import LABEL_SOURCES
from coderunner.vocabulary.network import NetworkMode
from coderunner.vocabulary.sandbox_layout import WORKSPACE

#: Open files per process inside; the engine's default (2^20) can exceed what the host allows.
NOFILE = 4096
#: Hidden under podman as under bwrap: all of /sys (bwrap mounts none; the engine's sysfs shows the
#: host's devices and cgroup tree) and the /proc entries bwrap masks (podman masks some already).
MASKED_PATHS = ("/sys", *(f"/proc/{name}" for name in (*PROC_MASKED_FILES, *PROC_MASKED_DIRS)))


@dataclass(frozen=True)
class OciCommand:
    """Builds podman/docker argv; pure, so the exact flags are unit-testable."""

    engine: str
    kind: str  # "podman" or "docker"
    image: str
    server: str
    runtime: str | None = None
    #: "UID:GID" the kernel runs as on the host, or None for the image's user.
    user: str | None = None
    #: Rootless podman: map the server's own user into the container.
    keep_id: bool = False
    nofile: int = NOFILE
    nproc: int | None = None
    #: Our tightened seccomp profile (see seccomp.tightened_profile), or None for the engine's.
    seccomp_profile: Path | None = None
    #: This server process's LABEL_INSTANCE value (what its watcher removes), or None.
    instance: str | None = None
    #: podman only: flags for the runtime itself ("platform=ptrace" becomes runsc's --platform=ptrace).
    runtime_flags: tuple[str, ...] = ()

    def base(self) -> list[str]:
        """The engine and its global flags (podman takes --runtime globally, docker per run)."""
        if self.kind == "podman" and self.runtime:
            flags = [arg for flag in self.runtime_flags for arg in ("--runtime-flag", flag)]
            return [self.engine, "--runtime", self.runtime, *flags]
        return [self.engine]

    def run(
        self,
        spec: SandboxSpec,
        inner: list[str],
        name: str,
        *,
        tcp_ports: list[int] | None = None,
        etc_dir: Path | None = None,
        interactive: bool = False,
    ) -> list[str]:
        """`etc_dir`: our own hosts and resolv.conf, over the engine's copies of the host's."""
        limits = spec.limits
        args = [
            *self.base(), "run", "--rm", "--init",
            *(["--interactive"] if interactive else []),
            "--name", name,
            "--label", f"{LABEL_SESSION}={session_key(spec)}",
            "--label", f"{LABEL_SERVER}={self.server}",
            *(["--label", f"{LABEL_INSTANCE}={self.instance}"] if self.instance else []),
            "--pull", "never",
            "--hostname", "sandbox",
            "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges",
            *(["--security-opt", f"seccomp={self.seccomp_profile}"] if self.seccomp_profile else []),
            "--read-only",
            "--tmpfs", f"/tmp:rw,nosuid,nodev,size={limits.tmp_mb or 512}m,mode=1777",
            "--shm-size", f"{SHM_MB}m",
            "--ulimit", f"nofile={self.nofile}:{self.nofile}",
        ]  # fmt: skip
        if self.nproc is not None:
            args += ["--ulimit", f"nproc={self.nproc}:{self.nproc}"]
        if self.kind == "docker" and self.runtime:
            args += ["--runtime", self.runtime]
        if self.kind == "podman":
            args += ["--http-proxy=false"]  # podman would copy the engine's proxy variables in
            # An empty read-only tmpfs over /sys, /dev/null over the /proc files. Docker's CLI has
            # no such option (its defaults mask less).
            args += ["--security-opt", "mask=" + ":".join(MASKED_PATHS)]
        if tcp_ports:
            # Published on loopback only; a bare port would listen on every interface.
            for port in tcp_ports:
                args += ["--publish", f"127.0.0.1:{port}:{port}"]
        elif spec.network in (
            NetworkMode.NONE,
            NetworkMode.ALLOWLIST,
        ):  # allowlist: out only through the bound proxy socket
            args += ["--network", "none"]
        if limits.memory_mb is not None:
            args += ["--memory", f"{limits.memory_mb}m", "--memory-swap", f"{limits.memory_mb}m"]
        if limits.cpus is not None:
            args += ["--cpus", f"{limits.cpus:g}"]
        if limits.pids is not None:
            args += ["--pids-limit", str(limits.pids)]
        if self.keep_id:
            args += ["--userns=keep-id"]
        if spec.user is not None:
            args += ["--user", f"{spec.user.uid}:{spec.user.gid}"]
        elif self.user:
            args += ["--user", self.user]
        args += [
            "--mount", _bind(spec.runtime_dir, str(spec.runtime_dir), writable=True),
            "--mount", _bind(spec.host_dir, str(spec.host_dir), writable=False),
            "--mount", _bind(spec.workspace, WORKSPACE, writable=True),
        ]  # fmt: skip
        for mount in spec.mounts:
            args += ["--mount", _bind(mount.host, mount.sandbox, writable=mount.writable)]
        if etc_dir is not None:
            for name_ in ("hosts", "resolv.conf"):
                args += ["--mount", _bind(etc_dir / name_, f"/etc/{name_}", writable=False)]
        args += ["--workdir", WORKSPACE]
        for key, value in sandbox_environment({"HOME": "/tmp/home", **spec_environment(spec)}).items():
            args += ["--env", f"{key}={value}"]
        inner = egress_launcher(IMAGE_PYTHON, spec.network, str(spec.host_dir), inner)
        return [*args, self.image, *inner]

    def remove(self, name: str) -> list[str]:
        return (
            [*self.base(), "rm", "--force", name]
            if self.kind == "docker"
            else [*self.base(), "rm", "--force", "--time", "0", name]
        )

    def inspect_pid(self, name: str) -> list[str]:
        return [*self.base(), "inspect", "--format", "{{.State.Pid}}", name]

    def list_server(self) -> list[str]:
        """Every container of this server configuration: name and session label, one per line."""
        return [
            *self.base(), "ps", "--all", "--filter", f"label={LABEL_SERVER}={self.server}",
            "--format", f'{{{{.Names}}}} {{{{index .Labels "{LABEL_SESSION}"}}}}',
        ]  # fmt: skip

    def image_exists(self) -> list[str]:
        """Prints the image's sources label (empty when unlabelled); fails when there is no image."""
        return [*self.base(), "image", "inspect", "--format", f'{{{{index .Config.Labels "{LABEL_SOURCES}"}}}}',
                self.image]  # fmt: skip


def _bind(host: Path, target: str, *, writable: bool) -> str:
    """A --mount spec (unlike -v, safe for paths that contain ':')."""
    if "," in str(host) or "," in target:
        raise ContainerUnavailable(f"paths with a comma cannot be mounted into a container: {host}")
    return f"type=bind,source={host},target={target}" + ("" if writable else ",readonly")


def parse_server_containers(output: str) -> list[tuple[str, str]]:
    """`ps --format '{{.Names}} {{index .Labels ...}}'` lines -> (name, session)."""
    found = []
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 2:
            found.append((parts[0], parts[1]))
    return found
