"""The bubblewrap backend: the Linux default, no daemon, no root.

Each sandbox gets new user, pid, network, ipc, uts and cgroup namespaces, a read-only root
made of /usr and the sandbox Python environment, a private /tmp, and exactly two host folders:
its own workspace (writable) and its own runtime dir (kernel sockets, same path inside).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskGroup

from .base import LimitReport, Limits, SandboxProcess, SandboxSpec

ENV_MOUNT = "/opt/coderunner/env"
WORKSPACE = "/workspace"
HOME = "/tmp/home"
SANDBOX_UID = 1000
SANDBOX_GID = 1000
#: Top-level entries of a merged-/usr system that are symlinks into /usr, or real dirs elsewhere.
USR_ALIASES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: Harmless host /etc files some programs need (dynamic linker cache, time zone, TLS roots, fonts).
ETC_PASSTHROUGH = ("ld.so.cache", "localtime", "ssl/certs", "fonts", "mime.types")


class BwrapUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here."""


def sandbox_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment of the kernel: nothing of the host's crosses (bwrap --clearenv)."""
    env = {
        "PATH": f"{ENV_MOUNT}/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": HOME,
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "SHELL": "/bin/sh",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TMPDIR": "/tmp",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        # glibc reserves 64 MiB of address space per thread arena; under RLIMIT_AS that is waste.
        "MALLOC_ARENA_MAX": "2",
    }
    env.update(extra or {})
    return env


def _etc_files(runtime_dir: Path) -> Path:
    """Write the sandbox's own passwd, group and hosts: the host's are never shown."""
    etc = runtime_dir / "etc"
    etc.mkdir(mode=0o755, exist_ok=True)
    (etc / "passwd").write_text(
        f"sandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:{HOME}:/bin/sh\nnobody:x:65534:65534::/:/usr/sbin/nologin\n"
    )
    (etc / "group").write_text(f"sandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n")
    (etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
    (etc / "hostname").write_text("sandbox\n")
    return etc


@dataclass(frozen=True)
class BwrapCommand:
    """Builds the bwrap argv; pure, so the exact flags are unit-testable."""

    bwrap: str
    env_dir: Path
    host_root: Path = Path("/")

    def argv(self, spec: SandboxSpec, inner: list[str], etc_dir: Path) -> list[str]:
        args = [
            self.bwrap,
            "--unshare-all",
            "--unshare-user",
            "--uid", str(SANDBOX_UID),
            "--gid", str(SANDBOX_GID),
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--cap-drop", "ALL",
            "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
        ]  # fmt: skip
        for name in USR_ALIASES:
            host = self.host_root / name
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), f"/{name}"]
            elif host.is_dir():
                args += ["--ro-bind", str(host), f"/{name}"]
        for name in ETC_PASSTHROUGH:
            host = self.host_root / "etc" / name
            if host.exists():
                args += ["--ro-bind", str(host), f"/etc/{name}"]
        for name in ("passwd", "group", "hosts", "hostname"):
            args += ["--ro-bind", str(etc_dir / name), f"/etc/{name}"]
        args += [
            "--ro-bind", str(self.env_dir), ENV_MOUNT,
            "--proc", "/proc",
            "--dev", "/dev",
            "--tmpfs", "/tmp",
            "--tmpfs", "/dev/shm",
            "--dir", HOME,
            "--bind", str(spec.runtime_dir), str(spec.runtime_dir),
            "--bind", str(spec.workspace), WORKSPACE,
            "--chdir", WORKSPACE,
            "--remount-ro", "/",
            "--clearenv",
        ]  # fmt: skip
        for key, value in sandbox_environment().items():
            args += ["--setenv", key, value]
        return [*args, "--", *_with_rlimits(spec.limits, inner)]


def _with_rlimits(limits: Limits, inner: list[str]) -> list[str]:
    """RLIMIT_AS gives user code a clean MemoryError instead of the OOM killer."""
    if limits.memory_mb is None:
        return inner
    return ["/usr/bin/prlimit", f"--as={limits.memory_mb * 1024 * 1024}", "--", *inner]


class BwrapBackend:
    """Sandboxes made with bubblewrap (Debian/Ubuntu package `bubblewrap`)."""

    name = "bwrap"
    workspace_path = WORKSPACE
    python = f"{ENV_MOUNT}/bin/python"

    def __init__(self, env_dir: Path, bwrap: str | None = None) -> None:
        found = bwrap or shutil.which("bwrap")
        if found is None:
            raise BwrapUnavailable("bubblewrap (bwrap) is not installed: sudo apt-get install bubblewrap")
        if not (env_dir / "bin" / "python").exists():
            raise BwrapUnavailable(
                f"the sandbox Python environment {env_dir} is missing: run `coderunner setup` (or ./install.sh)"
            )
        self.command = BwrapCommand(bwrap=found, env_dir=env_dir)

    def describe_isolation(self) -> str:
        return (
            "bubblewrap: own user/pid/net/ipc/uts/cgroup namespaces, no capabilities, read-only root "
            "(/usr + sandbox env), private /tmp, only the session workspace writable, no network"
        )

    def limit_reports(self, limits: Limits) -> dict[str, LimitReport]:
        return {
            "memory_mb": LimitReport(limits.memory_mb, "RLIMIT_AS" if limits.memory_mb else None),
            "cpus": LimitReport(limits.cpus, None),
        }

    async def spawn(self, spec: SandboxSpec, argv: list[str], task_group: TaskGroup) -> SandboxProcess:
        if spec.network != "none":
            raise ValueError(f"network mode {spec.network!r} is not supported by the bwrap backend yet")
        etc_dir = _etc_files(spec.runtime_dir)
        full = self.command.argv(spec, argv, etc_dir)
        process = await anyio.open_process(
            full,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
        return SandboxProcess(process, task_group, description=self.describe_isolation())
