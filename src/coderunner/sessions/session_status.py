"""A session as it stands: its state, uptime, usage, limits and mounts (tools/session_replies.py picks what
each session reply says of it).

Read from the session without changing it; usage is one walk of /proc (or its cgroup) and the workspace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from coderunner.hostfs.sandbox_mounts import SandboxMounts
from coderunner.hostfs.workspaces import Workspace
from coderunner.kernel.incarnation import Kernel
from coderunner.sandbox import LimitReport, SandboxBackend
from coderunner.sessions.job_runner import JobTable
from coderunner.sessions.kept_state import KeptState
from coderunner.sessions.sandbox_options import SandboxOptions
from coderunner.sessions.standby import Standby
from coderunner.sessions.usage import session_usage
from coderunner.sessions.warm_take import StartedFrom


@dataclass
class SessionStatus:
    session_id: str
    name: str | None
    persistent: bool
    alive: bool
    busy: bool
    uptime_s: float
    kernel_uptime_s: float
    memory_used_mb: float | None
    usage: dict[str, float | None]
    idle_s: float
    restarts: int
    network: str
    timeout_s: float
    workspace: str
    mounts: list[dict[str, str]]
    limits: dict[str, LimitReport]
    isolation: str
    kernel_generation: int = 0
    #: The running job, if any (its id, kind, elapsed time, first line of code).
    job: dict[str, Any] | None = None
    #: The snapshot it was restored or forked from; keep_state: its state is saved at close.
    restored_from: str | None = None
    keep_state: bool = False
    #: keep_state: when the state was last saved, or why not.
    state_note: str | None = None
    #: Cluster mode: the Ray node that holds the session (None on one machine, and then not shown).
    node: str | None = None
    #: Its standby kernel (reset_standby): ready, starting or none, and the memory it holds beside
    #: `memory_used_mb` (None: no standby kept, by the setting or the backend).
    standby: dict[str, Any] | None = None
    #: Whether its sandbox came warm from the pool or started cold, and why (None: not said, e.g. a cluster's).
    started: dict[str, Any] | None = None
    #: How its kernel started: "template" (a fork of the warm template) or "cold start: <why not>" (None: not said).
    kernel_start: str | None = None


class Reported(Protocol):
    """What a status reads of a session (Session is one)."""

    @property
    def session_id(self) -> str: ...

    @property
    def options(self) -> SandboxOptions: ...

    @property
    def backend(self) -> SandboxBackend: ...

    @property
    def kernel(self) -> Kernel | None: ...

    @property
    def busy(self) -> bool: ...

    @property
    def created_at(self) -> float: ...

    @property
    def last_used(self) -> float: ...

    @property
    def restarts(self) -> int: ...

    @property
    def generation(self) -> int: ...

    @property
    def workspace(self) -> Workspace: ...

    @property
    def sandbox_mounts(self) -> SandboxMounts | None: ...

    @property
    def jobs(self) -> JobTable: ...

    @property
    def restored_from(self) -> str | None: ...

    @property
    def kept(self) -> KeptState: ...

    @property
    def standby(self) -> Standby: ...

    @property
    def started(self) -> StartedFrom | None: ...


def session_status(session: Reported) -> SessionStatus:
    """`session` as it stands now."""
    kernel = session.kernel
    alive = kernel is not None and kernel.alive
    now = time.monotonic()
    usage = session_usage(kernel, session.workspace)  # one walk of /proc: memory_used_mb is its memory_mb
    options, backend, workspace = session.options, session.backend, session.workspace
    return SessionStatus(
        session_id=session.session_id,
        name=options.name,
        persistent=options.persistent,
        alive=alive,
        busy=session.busy,
        uptime_s=now - session.created_at,
        kernel_uptime_s=(now - kernel.started_at) if kernel is not None and alive else 0.0,
        memory_used_mb=usage["memory_mb"],
        usage=usage,
        idle_s=0.0 if session.busy else now - session.last_used,
        restarts=session.restarts,
        network=options.network,
        timeout_s=options.timeout_s,
        workspace=backend.workspace_path,
        mounts=[
            {"sandbox": m.sandbox, "host": str(m.host), "mode": "rw" if m.writable else "ro"} for m in options.mounts
        ]
        + export_status(session.sandbox_mounts),
        limits={
            **backend.limit_reports(options.limits),
            "disk_mb": LimitReport(workspace.size_mb, workspace.enforced_by),
        },
        isolation=backend.describe_isolation(),
        kernel_generation=session.generation,
        job=running.describe() if (running := session.jobs.running()) is not None else None,
        restored_from=session.restored_from,
        keep_state=options.keep_state,
        state_note=session.kept.note,
        standby=session.standby.describe(),
        started=session.started.describe() if session.started is not None else None,
        kernel_start=kernel.started_how if kernel is not None else None,
    )


def export_status(plan: SandboxMounts | None) -> list[dict[str, str]]:
    """The export mount, as a status lists it beside the others."""
    if plan is None or plan.exporter is None or plan.export_mount is None:
        return []
    return [export_entry(plan.export_mount, plan.exporter.target)]


def export_entry(mount: str, target: Path) -> dict[str, str]:
    """The export mount as a status lists it: where the sandbox saves, where that lands on the host."""
    return {"sandbox": mount, "host": str(target), "mode": "rw", "exported": "after each call"}
