"""Pure builders for the runsc-direct gVisor backend: runsc's argv, the sandbox's OCI config, and
the translation of host paths to the fixed paths a sandbox sees.

Nothing here runs or touches anything, so every flag and every field is unit-testable
(tests/test_container_commands.py); gvisor.py does the running.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coderunner.sandbox.base import SandboxSpec
from coderunner.sandbox.common import (
    CHANNEL_RELAY,
    GUEST_LIB,
    HOST_INSIDE,
    IMAGE_PYTHON,
    RUN_INSIDE,
    SHM_MB,
    rlimit_prefix,
    sandbox_environment,
    spec_environment,
)
from coderunner.vocabulary.sandbox_layout import WORKSPACE

#: runsc's global flags; a checkpoint restores only under the same ones (checkpoint_key).
#:   platform=ptrace   the kvm platform hangs on this kind of machine; ptrace needs no /dev/kvm
#:   network=none      no network stack at all (a loopback only)
#:   host-uds=create   the relay binds the kernel's channels in the run dir as host sockets the
#:                     server connects to; the sandbox may not connect to the host's
#:   overlay2=none     binds (the workspace) are the host's files, not an in-memory copy
RUNTIME_FLAGS = ("platform=ptrace", "network=none", "host-uds=create", "overlay2=none")
#: Host pids the Sentry may use per guest task, and on top: under ptrace each guest task costs a
#: stub thread and a tracing thread on the host. A Sentry that cannot make a host thread dies
#: (Go runtime, exit 2), so the guest's own bound (RLIMIT_NPROC, which gVisor enforces) must come
#: first: a fork bomb then gets EAGAIN inside and the kernel lives, as under bwrap.
HOST_PIDS_PER_TASK = 8  # measured: 256 forked guest processes made 1,343 host tasks
HOST_PIDS_BASE = 256
CPU_PERIOD_US = 100_000
#: Development knob: a host copy of src/coderunner/guest bound read-only over the image's, so a
#: guest change runs without rebuilding the image. Never set in production.
DEV_GUEST_LIB_ENV = "CODERUNNER_DEV_GUEST_LIB"
NO_CAPABILITIES: dict[str, list[str]] = {
    name: [] for name in ("bounding", "effective", "inheritable", "permitted", "ambient")
}


def host_pids(guest_pids: int) -> int:
    return HOST_PIDS_PER_TASK * guest_pids + HOST_PIDS_BASE


@dataclass(frozen=True)
class Runsc:
    """runsc's command lines under one --root (one per server process)."""

    binary: str
    root: Path
    flags: tuple[str, ...] = RUNTIME_FLAGS

    def base(self) -> list[str]:
        return [self.binary, f"--root={self.root}", *(f"--{flag}" for flag in self.flags)]

    def run(self, bundle: Path, container: str) -> list[str]:
        return [*self.base(), "run", f"--bundle={bundle}", container]

    def restore(self, image_dir: Path, bundle: Path, container: str) -> list[str]:
        return [*self.base(), "restore", f"--image-path={image_dir}", f"--bundle={bundle}", container]

    def checkpoint(self, image_dir: Path, container: str) -> list[str]:
        return [*self.base(), "checkpoint", f"--image-path={image_dir}", container]

    def kill(self, container: str, signal: str) -> list[str]:
        return [*self.base(), "kill", container, signal]

    def delete(self, *containers: str) -> list[str]:
        return [*self.base(), "delete", "--force", *containers]

    def state(self, container: str) -> list[str]:
        return [*self.base(), "state", container]

    def list(self) -> list[str]:
        return [*self.base(), "list", "-quiet"]


def _inside(path: str, host: str, inside: str) -> str | None:
    if path == host:
        return inside
    if path.startswith(host + "/"):
        return inside + path[len(host) :]
    return None


def translate(argv: list[str], spec: SandboxSpec) -> list[str]:
    """Each element naming the session's host or run dir (or a file below one) as seen inside."""
    pairs = ((str(spec.host_dir), HOST_INSIDE), (str(spec.runtime_dir), RUN_INSIDE))
    out = []
    for arg in argv:
        for host, inside in pairs:
            if (found := _inside(arg, host, inside)) is not None:
                arg = found
                break
        out.append(arg)
    return out


def inner_argv(spec: SandboxSpec, argv: list[str], *, pipes: bool) -> list[str]:
    """What the container runs: a one-shot program directly; a kernel behind the channel relay
    (the container's init). The program keeps its rlimits: RLIMIT_AS as a soft limit (the cgroup is
    the hard bound) and the session's pids as RLIMIT_NPROC, which gVisor's kernel enforces."""
    limits = spec.limits
    program = [*rlimit_prefix(limits, limits.pids, memory_cgroup=True), *translate(argv, spec)]
    if pipes:
        return program
    return [IMAGE_PYTHON, "-I", "-S", CHANNEL_RELAY, "--run-dir", RUN_INSIDE, "--", *program]


def _clean_destination(path: str) -> str:
    """A mount's destination inside: absolute, normalised, never the root nor above it."""
    normal = posixpath.normpath(path)
    if not path.startswith("/") or normal == "/" or ".." in normal.split("/"):
        raise ValueError(f"a sandbox mount path must be absolute and below /: {path!r}")
    return normal


def mount_points(spec: SandboxSpec, dev_guest_lib: Path | None = None) -> list[str]:
    """Directories the rootfs must have for the binds (runsc's gofer cannot make them in a read-only root)."""
    found = [WORKSPACE, RUN_INSIDE, HOST_INSIDE, *(_clean_destination(mount.sandbox) for mount in spec.mounts)]
    if dev_guest_lib is not None:
        found.append(f"{GUEST_LIB}/coderunner_guest")
    return found


def _bind(source: Path | str, destination: str, *, writable: bool) -> dict[str, Any]:
    return {
        "destination": destination,
        "type": "bind",
        "source": str(source),
        "options": ["rbind", "rw" if writable else "ro", "nosuid", "nodev"],
    }


def _tmpfs(destination: str, *options: str) -> dict[str, Any]:
    return {"destination": destination, "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", *options]}


@dataclass(frozen=True)
class ConfigInputs:
    """What the config needs besides the spec: the rootfs, who runs, which cgroup, which rlimits."""

    rootfs: Path
    uid: int
    gid: int
    cgroup: str
    nofile: int
    nproc: int
    dev_guest_lib: Path | None = None


def oci_config(spec: SandboxSpec, inner: list[str], inputs: ConfigInputs, *, pipes: bool) -> dict[str, Any]:
    """The OCI runtime config of one sandbox: everything podman's flags gave, said to runsc directly."""
    limits = spec.limits
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        _tmpfs("/tmp", f"size={limits.tmp_mb or 512}m", "mode=1777"),
        _tmpfs("/dev/shm", f"size={SHM_MB}m", "mode=1777"),
        # runsc's own /sys is synthetic but lists a cgroup tree and devices: an empty read-only one.
        _tmpfs("/sys", "ro"),
        _bind(spec.workspace, WORKSPACE, writable=True),
        _bind(spec.runtime_dir, RUN_INSIDE, writable=True),
        _bind(spec.host_dir, HOST_INSIDE, writable=False),
        *(_bind(m.host, _clean_destination(m.sandbox), writable=m.writable) for m in spec.mounts),
        # Our own hosts and resolv.conf (network 'none' is the only mode here), never the host's.
        *(_bind(spec.etc_dir / name, f"/etc/{name}", writable=False) for name in ("hosts", "resolv.conf")),
    ]
    if inputs.dev_guest_lib is not None:
        mounts.append(_bind(inputs.dev_guest_lib, f"{GUEST_LIB}/coderunner_guest", writable=False))
    uid, gid = (spec.user.uid, spec.user.gid) if spec.user is not None else (inputs.uid, inputs.gid)
    resources: dict[str, Any] = {}
    if limits.memory_mb is not None:
        size = limits.memory_mb * 2**20
        resources["memory"] = {"limit": size, "swap": size}
    if limits.cpus is not None:
        resources["cpu"] = {"quota": round(limits.cpus * CPU_PERIOD_US), "period": CPU_PERIOD_US}
    if limits.pids is not None:
        # The guest's own bound is RLIMIT_NPROC (inner_argv); the host's must leave room for the Sentry.
        resources["pids"] = {"limit": host_pids(limits.pids)}
    env = sandbox_environment({"HOME": "/tmp/home", **spec_environment(spec)})
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid, "additionalGids": [gid]},
            "args": inner,
            "env": [f"{key}={value}" for key, value in env.items()],
            "cwd": WORKSPACE,
            "capabilities": NO_CAPABILITIES,
            "noNewPrivileges": True,
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "hard": inputs.nofile, "soft": inputs.nofile},
                {"type": "RLIMIT_NPROC", "hard": inputs.nproc, "soft": inputs.nproc},
            ],
        },
        "root": {"path": str(inputs.rootfs), "readonly": True},
        "hostname": "sandbox",
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": kind} for kind in ("pid", "ipc", "uts", "mount", "network")],
            "cgroupsPath": f"/{inputs.cgroup}",
            "resources": resources,
        },
    }


def short_reason(said: str, limit: int = 400) -> str:
    """runsc's own words, short: its error or panic lines (an encoding error quotes whole objects)."""
    lines = [line.strip() for line in said.strip().splitlines() if line.strip()]
    wanted = [line for line in lines if "error" in line.lower() or "panic" in line.lower()] or lines[-3:]
    text = " | ".join(line if len(line) <= 200 else f"{line[:80]} ... {line[-110:]}" for line in wanted[-3:])
    return text[-limit:] or "runsc said nothing"


def parse_relay_state(data: bytes) -> tuple[str, int] | None:
    """The relay's "<open|closed|failed> <n>\\n", or None for anything else."""
    try:
        word, number = data.decode("ascii").split()
        value = int(number)
    except (UnicodeDecodeError, ValueError):
        return None
    if word not in ("open", "closed", "failed") or value < 0:
        return None
    return word, value
