"""What a local SessionHost offers besides sessions: its snapshots and named workspaces, and what its
sandboxes are like (SandboxProfile). A SessionManager holds one and hands these calls on.

The store and workspace calls are file work: they run in the server's worker threads (offload.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import anyio

from coderunner.config import Settings
from coderunner.hostfs.workspaces import NamedWorkspace, delete_named, list_named
from coderunner.offload import off_loop
from coderunner.sandbox import Mount, SandboxBackend
from coderunner.sessions.sandbox_options import SandboxOptions
from coderunner.sessions.seam import SandboxProfile, SessionHandle
from coderunner.sessions.session import Session
from coderunner.sessions.session_snapshots import Seed, SessionSnapshots, Taken, keep_id, takes_memory
from coderunner.snapshots.store import Listing, SnapshotMeta, SnapshotNotFound
from coderunner.vocabulary.network import modes_within


class HostServices:
    """The SessionHost calls that are not about one session, on what its manager set up."""

    def __init__(
        self, settings: Settings, backend: SandboxBackend, base_mounts: list[Mount], snapshots: SessionSnapshots,
        defaults: Callable[[], SandboxOptions],
    ) -> None:  # fmt: skip
        self.settings = settings
        self.backend = backend
        self.base_mounts = base_mounts
        self.snapshots = snapshots
        #: The default options, checked (SessionManager.options).
        self.defaults = defaults

    def profile(self) -> SandboxProfile:
        """The sandboxes here as get_capabilities describes them (the default options' limits)."""
        return sandbox_profile(self.settings, self.backend, self.base_mounts, self.defaults())

    async def take_snapshot(self, session: SessionHandle, name: str) -> Taken:
        return await self.snapshots.take(local_session(session), name=name)

    async def snapshot(self, client: str, snapshot_id: str) -> SnapshotMeta:
        return await off_loop(self.snapshots.store.get, client, snapshot_id)

    async def snapshot_listing(self, client: str) -> Listing:
        return await off_loop(self.snapshots.store.listing, client)

    async def delete_snapshot(self, client: str, snapshot_id: str) -> None:
        await off_loop(self.snapshots.store.delete, client, snapshot_id)

    async def snapshots_of(self, session: SessionHandle) -> list[str]:
        mark, client = session.session_id[:8], session.options.client
        found = await off_loop(self.snapshots.store.list, client)
        return [meta.snapshot_id for meta in found if meta.source_session == mark]

    async def list_workspaces(self, client: str) -> list[NamedWorkspace]:
        return await off_loop(list_named, self.settings.workspaces_dir, client)

    async def delete_workspace(self, client: str, name: str) -> None:
        await off_loop(delete_named, self.settings.workspaces_dir, client, name, bulk=True)
        # Its saved kernel state (keep_state) goes with it.
        with contextlib.suppress(SnapshotNotFound):
            await off_loop(self.snapshots.store.delete, client, keep_id(name))

    async def kept_state(self, options: SandboxOptions) -> Seed | None:
        """A keep_state session's saved state, as a seed (state only: the workspace is its own), or None."""
        assert options.name is not None
        with contextlib.suppress(SnapshotNotFound):
            await anyio.to_thread.run_sync(self.snapshots.store.get, options.client, keep_id(options.name))
            return Seed(options.client, keep_id(options.name), with_workspace=False)
        return None


def local_session(session: SessionHandle) -> Session:
    """A handle this manager gave out is one of its own sessions."""
    assert isinstance(session, Session), "a session of another host"
    return session


def sandbox_profile(
    settings: Settings, backend: SandboxBackend, base_mounts: list[Mount], defaults: SandboxOptions
) -> SandboxProfile:
    """What sandboxes of `backend` are like, as get_capabilities describes them (`defaults`' limits)."""
    modes = modes_within(settings.network_ceiling)
    return SandboxProfile(
        backend=backend.name,
        isolation=backend.describe_isolation(),
        workspace_path=backend.workspace_path,
        network_problems={mode: backend.network_problem(mode) for mode in modes},
        limit_reports=backend.limit_reports(defaults.limits),
        mounts=tuple((mount.sandbox, mount.writable) for mount in base_mounts),
        memory_snapshots=takes_memory(backend),
    )
