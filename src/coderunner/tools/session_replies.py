"""How the session tools describe a session: a brief line by default, the fuller view for status.

Both are read from SessionStatus (sessions/session_status.py) and cost what an agent pays for every
call, so neither carries host paths, float noise (seconds to 0.1, MiB as whole numbers) or the
isolation paragraph (get_capabilities says how the sandbox is built, once).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coderunner.sessions.session_status import SessionStatus

#: Most bytes of a brief description (create_session, reset, one entry of list); tests hold us to it.
BRIEF_BYTES = 400


def kernel_of(status: SessionStatus) -> str:
    """One word for where the kernel stands ("state" is what a session's variables did: restored, saved)."""
    if not status.alive:
        return "dead"
    return "busy" if status.busy else "idle"


def brief(status: SessionStatus, default: bool) -> dict[str, Any]:
    """What an agent acts on: the id, whether it can run, its network and the limits a run meets."""
    described: dict[str, Any] = {"session_id": status.session_id, "kernel": kernel_of(status)}
    if status.name is not None:
        described["name"] = status.name
    if status.persistent:
        described["persistent"] = True
    if status.keep_state:
        described["keep_state"] = True
    described["network"] = status.network
    described["timeout_s"] = seconds(status.timeout_s)
    for limit in ("memory_mb", "cpus"):
        report = status.limits.get(limit)
        if report is not None and report.value is not None:
            described[limit] = report.value
    if status.job is not None:
        described["job_id"] = status.job["job_id"]
    if status.node is not None:
        described["node"] = status.node
    described["default"] = default
    return described


def detailed(status: SessionStatus, default: bool) -> dict[str, Any]:
    """manage_sessions status: the brief view plus usage against each limit (and how it is held), the
    kernel's history, mounts by their sandbox side, the running job, the standby, the saved state and how its
    sandbox started (warm from the pool or cold, and why) and its kernel (from the warm template or cold, and why)."""
    described = brief(status, default)
    described.update(
        kernel_generation=status.kernel_generation,
        restarts=status.restarts,
        uptime_s=seconds(status.uptime_s),
        idle_s=seconds(status.idle_s),
        usage={name: _rounded(value) for name, value in status.usage.items() if value is not None},
        limits={name: asdict(report) for name, report in status.limits.items() if report.value is not None},
    )
    mounts = [{key: value for key, value in mount.items() if key != "host"} for mount in status.mounts]
    if mounts:
        described["mounts"] = mounts
    if status.job is not None:
        described["job"] = status.job
    if status.standby is not None:
        described["standby"] = {name: _rounded(value) for name, value in status.standby.items()}
    if status.restored_from is not None:
        described["restored_from"] = status.restored_from
    if status.state_note is not None:
        described["state_note"] = status.state_note
    if status.started is not None:
        described["started"] = status.started
    if status.kernel_start is not None:
        described["kernel_start"] = status.kernel_start
    return described


def seconds(value: float) -> float | int:
    """Seconds to 0.1, and a whole number as an int (900, not 900.0)."""
    tenths = round(value, 1)
    return int(tenths) if tenths.is_integer() else tenths


def _rounded(value: Any) -> Any:
    """MiB and other measures as whole numbers; what is not a float as it is."""
    return round(value) if isinstance(value, float) else value
