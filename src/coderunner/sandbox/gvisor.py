"""The gVisor backend: the podman backend with runsc as its runtime, so each kernel runs on a
kernel of its own (gVisor's Sentry) instead of the host's.

Everything the podman backend holds holds here too (the same OciCommand: no capabilities,
no-new-privileges, read-only root, size-capped /tmp, a per-sandbox host uid, memory/cpu/pids
limits, the host-only runtime dirs and socket claiming); runsc adds its own kernel between the
code and the host's. The runtime flags and why:

    platform=ptrace   the kvm platform hangs on this kind of machine; ptrace needs no /dev/kvm
    network=none      no network stack at all (podman's netns is not handed to runsc here, so
                      network 'internet' is refused rather than half-working)
    host-uds=create   the kernel binds its ZMQ ipc sockets in the bound run/ dir as real host
                      sockets the server can connect to; the sandbox may not connect to host ones
    overlay2=none     binds (the workspace) are the host's files, not an in-memory copy

Not used: oci-seccomp (enforcing the spec's seccomp profile inside the Sentry). With it, ZMQ's
I/O thread fails to start (EPERM, zmq src/thread.cpp:241) and so does the kernel. The syscall
boundary here is the Sentry itself, which runsc confines with its own host seccomp filter.

Checkpoint/restore (tried with Debian's runsc 0.0~20221219; bench/gvisor.py shows it): a live
kernel cannot be checkpointed. Its ZMQ channels are host sockets bound from inside, and the
Sentry refuses to save one: "Cannot save endpoint with bound host socket" (a panic in
connectionedEndpoint.beforeSave, pkg/sentry/socket/unix/transport/connectioned_state.go, still
there in gVisor's 2026 sources). The failed save leaves the sandbox stopped: the kernel dies.
Dialling out instead (host-uds=open, the host listens) fails too in this runsc (nil dereference
saving the connected host endpoint); newer gVisor saves such a connection by closing it. What
does work here: a sandbox holding no host socket at the moment of checkpoint is checkpointed and
restored with its threads, so a kernel whose channels went through an in-sandbox relay that
closes its host connections before a checkpoint and dials again after restore could be. Podman
4.3 itself refuses `podman container checkpoint` with runsc ("configured runtime does not
support checkpoint/restore"), so restore would also run outside podman's bookkeeping.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, fields, replace
from pathlib import Path

from anyio.abc import TaskGroup

from .base import LimitReport, Limits, SandboxProcess, SandboxSpec
from .common import NETWORK_MODES
from .container import ContainerUnavailable
from .identity import HostIdentity
from .oci import OciBackend, OciCommand

#: runsc's global flags (podman's --runtime-flag drops the dashes); see the module docstring.
RUNTIME_FLAGS = ("platform=ptrace", "network=none", "host-uds=create", "overlay2=none")
INSTALL_HINT = "sudo apt-get install runsc podman"
#: Host pids the Sentry may use per guest task, and on top: under ptrace each guest task costs a
#: stub thread and a tracing thread on the host. A Sentry that cannot make a host thread dies
#: (Go runtime, exit 2), so the guest's own bound (RLIMIT_NPROC, which gVisor enforces) must come
#: first: a fork bomb then gets EAGAIN inside and the kernel lives, as under bwrap.
HOST_PIDS_PER_TASK = 8  # measured: 256 forked guest processes made 1,343 host tasks
HOST_PIDS_BASE = 256
#: runsc ignores podman's masked paths: its own /sys (synthetic, but it lists a cgroup tree and
#: devices) is covered by an empty read-only tmpfs, as bwrap and podman show none.
SYS_MOUNT = "type=tmpfs,destination=/sys,ro=true"


def host_pids(guest_pids: int) -> int:
    return HOST_PIDS_PER_TASK * guest_pids + HOST_PIDS_BASE


def find_runsc(runsc: str | None = None) -> str:
    found = runsc or shutil.which("runsc")
    if found is None:
        raise ContainerUnavailable(f"runsc (gVisor) is not installed: {INSTALL_HINT}")
    return found


@dataclass(frozen=True)
class GvisorCommand(OciCommand):
    """podman's run command, with the mounts runsc needs to hide what podman's masks hide."""

    def run(self, spec: SandboxSpec, inner: list[str], name: str, **kwargs: object) -> list[str]:
        args = super().run(spec, inner, name, **kwargs)  # type: ignore[arg-type]
        image_at = len(args) - len(inner) - 1
        return [*args[:image_at], "--mount", SYS_MOUNT, *args[image_at:]]


class GvisorBackend(OciBackend):
    """Sandboxes as podman containers run by runsc (gVisor)."""

    def __init__(
        self,
        image: str,
        runtime_base: Path,
        identity: HostIdentity | None = None,
        runsc: str | None = None,
        engine: str | None = None,
    ) -> None:
        super().__init__(
            "podman",
            image,
            runtime_base,
            identity=identity,
            engine=engine,
            runtime=find_runsc(runsc),
            channels="ipc",
            runtime_flags=RUNTIME_FLAGS,
        )
        self.name = "gvisor"
        self.command = GvisorCommand(**{each.name: getattr(self.command, each.name) for each in fields(self.command)})

    def describe_isolation(self) -> str:
        user = f"; its files are host user {self.identity.name}'s, its processes host nobody's" if self.identity else ""
        return (
            "gVisor (runsc, ptrace platform) under podman: the code talks to gVisor's own kernel, not the "
            "host's, itself confined by runsc's seccomp filter; no capabilities, no-new-privileges, read-only root, "
            f"size-capped /tmp, no network stack, only the session workspace writable; container "
            f"memory/cpu/pids limits{user}"
        )

    def limit_reports(self, limits: Limits) -> dict[str, LimitReport]:
        reports = super().limit_reports(limits)
        if limits.pids:
            reports["pids"] = LimitReport(limits.pids, "RLIMIT_NPROC in gVisor's kernel + container pids limit")
        return reports

    async def _spawn(
        self, spec: SandboxSpec, argv: list[str], task_group: TaskGroup, *, pipes: bool = False
    ) -> SandboxProcess:
        """The session's pids bound the guest's tasks (RLIMIT_NPROC inside); the container's own
        pids limit, on the Sentry's host threads, is set above what those tasks can cost."""
        limits = spec.limits
        if limits.pids is not None:
            argv = ["/usr/bin/prlimit", f"--nproc={limits.pids}", "--", *argv]
            spec = replace(spec, limits=replace(limits, pids=host_pids(limits.pids)))
        return await super()._spawn(spec, argv, task_group, pipes=pipes)

    def network_problem(self, network: str) -> str | None:
        if network not in NETWORK_MODES:
            return f"unknown network mode {network!r}: use 'none', 'allowlist' or 'internet'"
        if network != "none":
            # 'allowlist' too: its proxy is a host socket the sandbox dials, and host-uds=create
            # lets the kernel bind its own sockets but never dial one of the host's.
            return (
                "the gvisor backend runs sandboxes without any network stack and cannot dial the host's "
                "egress proxy: use network 'none', or the bwrap or podman backend for 'allowlist' or 'internet'"
            )
        return None
