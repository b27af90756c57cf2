"""Sessions: a workspace plus a sandboxed kernel each, and the manager that owns them all.

    seam.py           SessionHost, SessionHandle: all the tools may use of sessions (the manager and
                      Session implement them here; a session living elsewhere may implement them too)
    manager.py        SessionManager: handles, per-caller defaults, limits, the idle reaper
    host_services.py  the host's calls beside sessions: snapshots and named workspaces
    idle_room.py      IdleSandboxes: sandboxes a layer above keeps idle in the manager's room (oneshot/'s
                      started ahead), counted beside the sessions, evicted first, drained on shutdown
    session.py        Session: one kernel at a time, reset/close, the one start-or-replace path
    kernel_calls.py   what a call does with the kernel it holds: cells as jobs, guest calls
    session_status.py what a session reports; kept_state.py its snapshot bookkeeping
    job_runner.py     Job, JobTable: runs that outlive their call (detach, read since last, cancel)
    session_snapshots.py  snapshots of a session and sessions seeded from one (snapshot_reports.py:
                      the guest's accounts, checked and cut)
    pool.py           sandboxes started ahead (the warm pool)
    usage.py          what a session uses (cgroup or /proc, and its workspace's disk)
    sandbox_options.py  SandboxOptions: what a sandbox may be given, within the user's ceilings
    leases.py         one SandboxLease per sandbox: its dirs, host uid, workspace, mounts and egress
                      proxy, handed back in reverse in one place (sessions and one-shot runs alike)

The errors live in errors.py (one root) so those need not import this.
"""

from __future__ import annotations

from coderunner.errors import GuestCallError, SessionBusy, SessionError
from coderunner.sessions.manager import SHUTDOWN_TIMEOUT_S, SessionManager
from coderunner.sessions.sandbox_options import SandboxOptions, sandbox_options
from coderunner.sessions.session import Session
from coderunner.sessions.session_status import SessionStatus

__all__ = [
    "SHUTDOWN_TIMEOUT_S",
    "GuestCallError",
    "SandboxOptions",
    "Session",
    "SessionBusy",
    "SessionError",
    "SessionManager",
    "SessionStatus",
    "sandbox_options",
]
