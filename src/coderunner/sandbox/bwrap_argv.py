"""The bwrap argv of one sandbox: pure, so the exact flags are unit-testable (tests/test_bwrap_command.py)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from coderunner.sandbox.base import SandboxSpec
from coderunner.sandbox.common import (
    ENV_MOUNT,
    GUEST_LIB,
    PROC_MASKED_DIRS,
    PROC_MASKED_FILES,
    SANDBOX_INIT_BOOT,
    SHM_MB,
    egress_launcher,
    rlimit_prefix,
    sandbox_environment,
    spec_environment,
)
from coderunner.vocabulary.network import NetworkMode
from coderunner.vocabulary.sandbox_layout import HOME, SANDBOX_GID, SANDBOX_UID, WORKSPACE, etc_files

GUEST_SOURCE = Path(__file__).resolve().parent.parent / "guest"
#: Top-level entries of a merged-/usr system that are symlinks into /usr, or real dirs elsewhere.
USR_ALIASES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: Harmless host /etc files some programs need (dynamic linker cache, time zone, TLS roots, fonts).
ETC_PASSTHROUGH = ("ld.so.cache", "localtime", "ssl/certs", "fonts", "mime.types")
#: /proc entries made read-only: sysctls are checked against the writer's host uid, and when the
#: server runs as root the sandbox's uid maps to host root (kernel.core_pattern would be a host
#: root escape). bwrap 0.8 does not cover /proc/sys itself, so this must.
PROC_READ_ONLY = ("sys", "sysrq-trigger", "fs", "irq", "bus")
#: A sandbox's program meaning none: its init says it is ready and holds it (guest/sandbox_init.py --hold), for a
#: kernel template's fork to enter. No rlimits: nothing runs under them (the fork sets its own).
HOLD: list[str] = []
#: The mode of the files bwrap copies into a sandbox's own root (root_files): read-only for everyone, and the root
#: they are in is remounted read-only besides.
ROOT_FILE_MODE = "0444"


def root_files(spec: SandboxSpec) -> list[tuple[str, bytes]]:
    """(path inside, content) of what bwrap copies into the sandbox's own root, each from an fd: its own /etc
    files (vocabulary/sandbox_layout.py: never the host's) and the spec's private files (a kernel's connection
    file). Copied, not bound: every bind mount costs a sandbox's start a walk of every mount it sees (bwrap reads
    the mount table to make each read-only), and a host holding a hundred sessions' workspaces has hundreds, so
    five binds cost 1 CPU-ms a start on a quiet host and 4 CPU-ms beside 200 mounts."""
    own_etc = [(f"/etc/{name}", text.encode()) for name, text in etc_files(spec.network).items()]
    return [*own_etc, *spec.private_files]


@dataclass(frozen=True)
class BwrapCommand:
    """Builds the bwrap argv; pure, so the exact flags are unit-testable."""

    bwrap: str
    env_dir: Path
    host_root: Path = Path("/")
    guest_dir: Path = GUEST_SOURCE
    #: The compiled init's file in env_dir (sandbox/init_binary.py), or None: the Python one (guest/sandbox_init.py).
    init_binary: Path | None = None

    def argv(
        self,
        spec: SandboxSpec,
        inner: list[str],
        *,
        gate_fd: int,
        seccomp_fd: int | None = None,
        info_fd: int | None = None,
        block_fd: int | None = None,
        nproc: int | None = None,
        memory_cgroup: bool = False,
        root_fds: tuple[tuple[int, str], ...] = (),
    ) -> list[str]:
        """`gate_fd`: the start gate's read end (sandbox/pid1.py), which the sandbox's init waits on.
        `root_fds`: (fd, path inside) of each of root_files(spec), read by bwrap into a read-only file of this
        sandbox's own root (no bind of a host path: no other sandbox sees it, and no mount is made).

        pid 1 is our own init (--as-pid-1; guest/sandbox_init.c, or .py where none was compiled), not bwrap's: it
        makes itself non-dumpable, so nothing in the sandbox can write the process its namespace hangs on. No
        --die-with-parent: the server's watcher, not a death signal, ends a dead server's sandboxes
        (bwrap_watch.py), and the init ends with the server through its gate."""
        args = [
            self.bwrap,
            "--unshare-all",
            "--unshare-user",
            "--uid", str(SANDBOX_UID),
            "--gid", str(SANDBOX_GID),
            "--disable-userns",
            "--as-pid-1",
            "--new-session",
            "--cap-drop", "ALL",
            "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
        ]  # fmt: skip
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        if info_fd is not None:
            args += ["--info-fd", str(info_fd)]
        if block_fd is not None:
            args += ["--block-fd", str(block_fd)]
        args += self.system_binds
        tmp_size = ["--size", str(spec.limits.tmp_mb * 2**20)] if spec.limits.tmp_mb else []
        args += [
            "--ro-bind", str(self.env_dir), ENV_MOUNT,
            "--ro-bind", str(self.guest_dir), f"{GUEST_LIB}/coderunner_guest",
            "--proc", "/proc",
            *self._proc_cover,
            "--dev", "/dev",
            *tmp_size, "--tmpfs", "/tmp",
            "--size", str(SHM_MB * 2**20), "--tmpfs", "/dev/shm",
            "--dir", HOME,
            "--bind", str(spec.runtime_dir), str(spec.runtime_dir),
            "--ro-bind", str(spec.host_dir), str(spec.host_dir),
            "--bind", str(spec.workspace), WORKSPACE,
            *_mount_binds(spec),
            *[arg for fd, path in root_fds for arg in ("--perms", ROOT_FILE_MODE, "--file", str(fd), path)],
            "--chdir", WORKSPACE,
            "--remount-ro", "/",
            "--clearenv",
        ]  # fmt: skip
        for key, value in sandbox_environment(spec_environment(spec)).items():
            args += ["--setenv", key, value]
        init = [*self.init_program, str(gate_fd)]
        if inner == HOLD:
            if spec.network == NetworkMode.ALLOWLIST:
                raise ValueError("a sandbox in network 'allowlist' needs a program: its forwarder starts it")
            return [*args, "--", *init, "--hold"]
        inner = egress_launcher(f"{ENV_MOUNT}/bin/python", spec.network, str(spec.host_dir), inner)
        return [*args, "--", *init, "--", *rlimit_prefix(spec.limits, nproc, memory_cgroup), *inner]

    @property
    def init_program(self) -> list[str]:
        """pid 1's argv before its gate: the compiled init as the sandbox sees it (the environment is bound at
        ENV_MOUNT), or the Python one."""
        if self.init_binary is not None:
            return [f"{ENV_MOUNT}/{self.init_binary.relative_to(self.env_dir)}"]
        return [f"{ENV_MOUNT}/bin/python", "-I", "-S", "-c", SANDBOX_INIT_BOOT]

    @functools.cached_property
    def system_binds(self) -> list[str]:
        """The host's /usr aliases and the /etc entries every sandbox (and the kernel template) reads, as the host
        has them. Looked up once per backend (about 25 stats a start otherwise): what the host's / holds is the same
        while a server runs."""
        args: list[str] = []
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
        return args

    @functools.cached_property
    def _proc_cover(self) -> list[str]:
        """Read-only binds and masks over the sandbox's /proc, for entries the host has (looked up once, as above)."""
        args: list[str] = []
        proc = self.host_root / "proc"
        for name in PROC_READ_ONLY:
            if (proc / name).exists():
                args += ["--ro-bind", f"/proc/{name}", f"/proc/{name}"]
        for name in PROC_MASKED_FILES:
            if (proc / name).exists():
                args += ["--ro-bind", "/dev/null", f"/proc/{name}"]
        for name in PROC_MASKED_DIRS:
            if (proc / name).is_dir():
                args += ["--tmpfs", f"/proc/{name}"]
        return args


def _mount_binds(spec: SandboxSpec) -> list[str]:
    args: list[str] = []
    for mount in spec.mounts:
        args += ["--bind" if mount.writable else "--ro-bind", str(mount.host), mount.sandbox]
    return args
