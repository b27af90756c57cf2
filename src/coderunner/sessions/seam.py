"""The seam between the tools and where sessions live: SessionHost (the place) and SessionHandle (one session).

The tools (tools/*) speak to sessions only through these two interfaces (and to one-shot runs through
oneshot/host.py's OneShotHost, a layer above); they never reach into a
kernel, a sandbox backend, a session's dirs or the host's file system. Today's SessionManager and
Session implement them in this process; a cluster mode may implement them with a session living
elsewhere (a detached actor on another node), and the tools do not change.

What crosses the seam is data (options, statuses, reports, job updates, a session's file view) and calls: a
job is asked about by its id, and every answer is a JobUpdate (job_updates.py), never a live Job.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from coderunner.edge.callers import LOCAL_CALLER
from coderunner.edge.owners import LOCAL_CLIENT

if TYPE_CHECKING:
    from coderunner.config import Settings
    from coderunner.hostfs.sandbox_files import SandboxFiles
    from coderunner.hostfs.workspaces import NamedWorkspace
    from coderunner.kernel.output_capture import WorkspaceWriter
    from coderunner.sandbox import LimitReport
    from coderunner.sessions.egress_wiring import SessionEgress
    from coderunner.sessions.job_updates import JobUpdate
    from coderunner.sessions.sandbox_options import SandboxOptions
    from coderunner.sessions.session_snapshots import Seed, Taken
    from coderunner.sessions.session_status import SessionStatus
    from coderunner.snapshots.store import Listing, SnapshotMeta
    from coderunner.vocabulary.sandbox_request import SandboxRequest


@dataclass(frozen=True)
class SandboxProfile:
    """What the sandboxes of a host are like, as get_capabilities tells a model (no backend object crosses)."""

    backend: str
    isolation: str
    #: Where the workspace is inside a sandbox.
    workspace_path: str
    #: Network mode -> why it is unavailable here (None: available).
    network_problems: dict[str, str | None]
    #: Each limit of the default options and how it is enforced.
    limit_reports: dict[str, LimitReport]
    #: The configured mounts every sandbox gets: (path inside the sandbox, writable).
    mounts: tuple[tuple[str, bool], ...]
    #: Whether snapshots carry the whole sandbox's memory (a checkpointing backend).
    memory_snapshots: bool


class SessionHandle(Protocol):
    """One session, as the tools may use it: runs, jobs, reset, files, guest operations, status."""

    @property
    def session_id(self) -> str: ...
    @property
    def owner(self) -> str:
        """The caller that created it (callers.py): its client is the only one that may use it."""
        ...

    @property
    def options(self) -> SandboxOptions: ...
    @property
    def export_note(self) -> str | None:
        """What the last copy-out to the export folder did, for the reply."""
        ...

    @property
    def startup(self) -> dict[str, Any] | None:
        """A reopened workspace's start-up files and packages, for create_session's reply."""
        ...

    @property
    def seeded(self) -> Seed | None:
        """The snapshot seed it started from, with what the load reported."""
        ...

    @property
    def close_note(self) -> str | None: ...
    @property
    def egress(self) -> SessionEgress | None:
        """Network 'allowlist': the session's policy proxy and its decisions (None otherwise)."""
        ...

    @property
    def files(self) -> SandboxFiles:
        """The session's files as the host may touch them: workspace and mounts, symlink-safe."""
        ...

    @property
    def sandbox_uid(self) -> int | None:
        """The host uid the sandbox runs as, when it has one of its own (a root server)."""
        ...

    def reply_writer(self) -> WorkspaceWriter:
        """Where a reply too big to send spills: the session's workspace, owned by its sandbox user."""
        ...

    def note_restored_from(self, text: str) -> None:
        """Say where the session came from (a fork, whose snapshot is already gone)."""
        ...

    async def start_run(
        self, code: str, timeout_s: float | None, variables: dict[str, Any] | None = None, wait_s: float = 0.0
    ) -> JobUpdate:
        """Start a cell as this session's job and wait up to `wait_s` for its end (job_updates.py: one that
        ended comes whole and is forgotten; cancelling this call cancels the cell)."""
        ...

    async def wait_job(self, job_id: str, wait_s: float) -> JobUpdate:
        """The run's own further wait for its job's end, as start_run's."""
        ...

    async def read_job(self, job_id: str, wait_s: float = 0.0, take: bool = True) -> JobUpdate:
        """Up to `wait_s` for the job's end, then where it stands and (`take`) what is new since the last read
        (cancelling this leaves the job running)."""
        ...

    async def cancel_job(self, job_id: str) -> None:
        """Interrupt a job; a kernel that ignores that is restarted."""
        ...

    async def list_jobs(self) -> list[dict[str, Any]]:
        """Its jobs as manage_jobs list shows them."""
        ...

    def holds_job(self, job_id: str) -> bool:
        """Whether `job_id` is one of its jobs (manage_jobs finds a job's session by it)."""
        ...

    @property
    def kernel_reported(self) -> bool:
        """Whether a reply has named this session's kernel yet (the first says 'new session')."""
        ...

    def kernel_state(self, lost: bool = False) -> tuple[int, bool]:
        """(generation, state_preserved) for a reply; every reply that reports it moves the mark."""
        ...

    async def reset(self) -> None: ...
    async def copy_out(self) -> None: ...
    async def guest_op(
        self, tool: str, op: str, args: dict[str, Any], timeout_s: float, *,
        paths: Iterable[str] = (), input_path: str | None = None,
    ) -> dict[str, Any]: ...  # fmt: skip
    async def install_packages(self, packages: list[str], timeout_s: float) -> dict[str, Any]: ...
    async def status(self) -> SessionStatus: ...


class SessionHost(Protocol):
    """Where sessions live: creating, finding (for a caller), listing and closing them; their snapshots
    and named workspaces."""

    @property
    def settings(self) -> Settings: ...
    def options(self, request: SandboxRequest = ...) -> SandboxOptions: ...
    async def create(
        self, options: SandboxOptions | None = None, owner: str = LOCAL_CALLER, pool_wait_s: float = 0.0,
        seed: Seed | None = None,
    ) -> SessionHandle: ...  # fmt: skip
    async def resolve(
        self, session_id: str | None, owner: str = LOCAL_CALLER, client: str = LOCAL_CLIENT
    ) -> SessionHandle:
        """The named session (if `owner`'s client may use it), or `owner`'s default one."""
        ...

    async def close(self, session_id: str, owner: str | None = None) -> SessionHandle: ...
    def is_default(self, session: SessionHandle) -> bool: ...
    async def release_caller(self, owner: str) -> None: ...
    def profile(self) -> SandboxProfile: ...

    async def take_snapshot(self, session: SessionHandle, name: str) -> Taken: ...
    async def snapshot(self, client: str, snapshot_id: str) -> SnapshotMeta: ...
    async def snapshot_listing(self, client: str) -> Listing: ...
    async def delete_snapshot(self, client: str, snapshot_id: str) -> None: ...
    async def snapshots_of(self, session: SessionHandle) -> list[str]:
        """The ids of the snapshots taken of `session` (kept in its client's store)."""
        ...

    async def list_workspaces(self, client: str) -> list[NamedWorkspace]: ...
    async def delete_workspace(self, client: str, name: str) -> None:
        """A persistent workspace and its saved kernel state (keep_state)."""
        ...

    def list(self, owner: str | None = None) -> Sequence[SessionHandle]:
        """Every open session, or those `owner` created."""
        ...
