"""Leasing a sandbox's host side: its dirs, its host uid, its mounts, its egress proxy, and handing them back.

Sessions and one-shot runs both take a SandboxLease here before they start a sandbox and release
it when it ends, so the order (uid, dirs and workspace, mounts, egress; then the reverse) is written once.
The layout itself is session_dirs.py's; the workspace is hostfs/workspaces.py's. The slow parts (mkfs,
mount, an id-map helper, chown walks) run in worker threads.

One set of dirs is kept made ahead (`keep_spare`): a session's create with the server's default network and disk
size takes it, and the next is made in the background. A capped workspace is an image that mkfs formats and a loop
mount (about 10 ms of a create's 80 on the kernel template's path); the spare holds nothing else (no process, no
memory), is this server's alone (its dirs are locked by it, as a session's are, so its sweeper removes them should
it die), and is removed when the server closes.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from coderunner.config import Settings
from coderunner.errors import SessionError
from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs.exports import ExportError, client_folder, folder_owner, prepare_export_dir
from coderunner.hostfs.sandbox_mounts import ExportPlan, MountsError, SandboxMounts, prepare_mounts
from coderunner.hostfs.session_dirs import SandboxDirs, open_sandbox_dirs
from coderunner.hostfs.workspaces import Workspace, WorkspaceError, named_workspace_dir
from coderunner.sandbox import Mount, SandboxBackend, SandboxSpec, UidPool
from coderunner.sandbox.common import EGRESS_SOCKET
from coderunner.sessions.sandbox_options import SandboxOptions
from coderunner.vocabulary.network import NetworkMode, offline_install

if TYPE_CHECKING:  # the egress wiring runs its proxy in these dirs
    from anyio.abc import TaskGroup

    from coderunner.sessions.egress_wiring import EgressHub, SessionEgress

log = logging.getLogger(__name__)


@dataclass
class SandboxLeases:
    """Hands out and takes back the host side of sandboxes, for one server's settings and backend."""

    settings: Settings
    backend: SandboxBackend
    #: A root server's per-sandbox host uids (None: all sandboxes run as one user).
    users: UidPool | None = None
    _spare: _Spare = field(default_factory=lambda: _Spare())

    async def lease(
        self, options: SandboxOptions, throwaway: bool = False, owner: tuple[int, int] | None = None
    ) -> SandboxLease:
        """A new lease holding the sandbox's dirs (see open_dirs); its mounts and egress are added to it."""
        return SandboxLease(self, options, await self.open_dirs(options, throwaway, owner))

    def keep_spare(self, options: SandboxOptions, task_group: TaskGroup) -> None:
        """From now on, keep one set of dirs for `options` (the server's defaults) made ahead in `task_group`;
        close_spare ends it."""
        self._spare.options, self._spare.task_group = options, task_group
        self._refill_spare()

    async def spare_key(self) -> str | None:
        """The key of the dirs kept ahead (None: none are), once any being made are (what tests tell apart from a
        session's dirs)."""
        if (making := self._spare.making) is not None:
            await making.wait()
        return self._spare.dirs.key if self._spare.dirs is not None else None

    async def close_spare(self) -> None:
        """Make no more spares, and remove the one kept (once one being made is done)."""
        spare = self._spare
        spare.closed = True
        with anyio.CancelScope(shield=True):
            if spare.making is not None:
                await spare.making.wait()
            if spare.dirs is not None:
                dirs, spare.dirs = spare.dirs, None
                await self.close_dirs(dirs)

    def _take_spare(
        self, options: SandboxOptions, throwaway: bool, owner: tuple[int, int] | None
    ) -> SandboxDirs | None:
        """The spare, if it fits `options` (a session's non-persistent workspace of the spare's network and size)."""
        spare = self._spare
        if spare.dirs is None or spare.options is None or throwaway or owner is not None or options.persistent:
            return None
        if (options.network, options.limits.disk_mb) != (spare.options.network, spare.options.limits.disk_mb):
            return None
        dirs, spare.dirs = spare.dirs, None
        dirs.taken()
        self._refill_spare()
        return dirs

    def _refill_spare(self) -> None:
        spare = self._spare
        if spare.closed or spare.dirs is not None or spare.task_group is None or spare.making is not None:
            return
        spare.making = anyio.Event()
        spare.task_group.start_soon(self._make_spare, spare.making)

    async def _make_spare(self, made: anyio.Event) -> None:
        spare = self._spare
        assert spare.options is not None
        try:
            with anyio.CancelScope(shield=True):  # made whole, then kept or removed: never left half-made
                dirs = await self._make_dirs(spare.options, False, None, ahead=True)
                if spare.closed:
                    await self.close_dirs(dirs)
                else:
                    spare.dirs = dirs
        except SessionError as exc:  # the next create makes its own, and says why if it cannot either
            log.warning("could not make a session's dirs ahead: %s", exc)
        finally:
            spare.making = None
            made.set()

    async def open_dirs(
        self, options: SandboxOptions, throwaway: bool = False, owner: tuple[int, int] | None = None
    ) -> SandboxDirs:
        """A sandbox's host side (see session_dirs.py): the spare if it fits, else made in a worker thread
        (creating a capped workspace runs mkfs and mount). Raises SessionError.

        `throwaway` (a one-shot run): the capped workspace is a tmpfs, at most the memory limit in size.
        `owner`: the host (uid, gid) a gVisor checkpoint's processes run as, for its restored copy.
        """
        spare = self._take_spare(options, throwaway, owner)
        if spare is not None:
            return spare
        return await self._make_dirs(options, throwaway, owner)

    async def _make_dirs(
        self, options: SandboxOptions, throwaway: bool, owner: tuple[int, int] | None, ahead: bool = False
    ) -> SandboxDirs:
        stable = f"named/{options.client}/{options.name}" if options.persistent else None
        if self.users is None:
            user = self.backend.identity
        elif owner is not None:
            try:
                user = self.users.adopt(*owner)
            except ValueError as exc:
                raise SessionError(f"cannot restore this snapshot here: {exc}") from None
        else:
            user = self.users.allocate(stable)

        def make_workspace(key: str, owner: tuple[int, int] | None) -> Workspace:
            if options.persistent:
                assert options.name is not None
                path = named_workspace_dir(self.settings.workspaces_dir, options.client, options.name,
                                           self.backend.dir_mode)  # fmt: skip
            else:
                path = self.settings.workspaces_dir / key
            size_mb = options.limits.disk_mb
            if throwaway and size_mb is not None and options.limits.memory_mb:
                size_mb = min(size_mb, options.limits.memory_mb)
            workspace = Workspace.create(
                path, size_mb, self.settings.workspace_quota, persistent=options.persistent, throwaway=throwaway
            )
            try:
                if owner is not None:
                    chown_workspace(workspace, owner)
            except BaseException:
                workspace.remove()
                raise
            return workspace

        def make() -> SandboxDirs:
            return open_sandbox_dirs(
                self.settings.runtime_dir,
                network=options.network,
                dir_mode=self.backend.dir_mode,
                user=user,
                make_workspace=make_workspace,
                ahead=ahead,
            )

        try:
            return await anyio.to_thread.run_sync(make)
        except (OSError, WorkspaceError) as exc:
            if self.users is not None:
                self.users.release(user)
            raise SessionError(f"could not open the session workspace: {exc}") from None

    async def close_dirs(self, dirs: SandboxDirs) -> None:
        """Remove a sandbox's dirs and give its host uid back (shielded: it must finish)."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(dirs.close)
        self.release_user(dirs)

    def release_user(self, dirs: SandboxDirs) -> None:
        """Give the sandbox's host uid back to the pool, once nothing of it runs."""
        if self.users is not None:
            self.users.release(dirs.user)

    def export_plan(self, client: str) -> ExportPlan | None:
        """Where `client`'s sandboxes save exports (export_mount) and where those land on the host."""
        export_dir = self.settings.export_dir
        if export_dir is None:
            return None
        root = prepare_export_dir(export_dir)
        return ExportPlan(
            mount=self.settings.export_mount,
            target=client_folder(root, client),
            limit_bytes=self.settings.export_limit_mb * 2**20,
            owner=folder_owner(root, None),
        )

    def prepare_mounts(self, options: SandboxOptions, dirs: SandboxDirs, fresh: bool = True) -> SandboxMounts:
        """A sandbox's mounts (staged in its host-only dir on a root server) and its outbox; raises
        SessionError. Runs in a worker thread (mount syscalls, an id-map helper process)."""
        try:
            return prepare_mounts(options.mounts, dirs.top, dirs.workspace.path, dirs.owner,
                                  self.export_plan(options.client), fresh_workspace=fresh)  # fmt: skip
        except (MountsError, ExportError, OSError) as exc:
            raise SessionError(f"could not prepare the sandbox's folders: {exc}") from None


@dataclass
class _Spare:
    """The dirs SandboxLeases keeps made ahead: for which options, where they are made, and, while one is being
    made, what is set once it is."""

    options: SandboxOptions | None = None
    task_group: TaskGroup | None = None
    dirs: SandboxDirs | None = None
    making: anyio.Event | None = None
    closed: bool = False


@dataclass(eq=False)
class SandboxLease:
    """One sandbox's host side, held from before it starts until after it ends: its dirs (with its host uid
    and workspace), its mounts and export outbox, its egress proxy. release() hands them back in reverse."""

    leases: SandboxLeases
    #: The options it was taken for.
    options: SandboxOptions
    dirs: SandboxDirs
    mounts: SandboxMounts | None = None
    egress: SessionEgress | None = None
    #: A warm pool's allowlist sandbox: its proxy socket, made before it started, until a session takes it.
    egress_socket: socket.socket | None = None
    _user_released: bool = False

    async def mount(self, fresh: bool = True) -> SandboxMounts:
        """Prepare its mounts and outbox (in a worker thread: mount syscalls); raises SessionError."""
        self.mounts = await anyio.to_thread.run_sync(self.leases.prepare_mounts, self.options, self.dirs, fresh)
        return self.mounts

    async def open_egress(
        self, hub: EgressHub | None, task_group: TaskGroup, label: str, options: SandboxOptions | None = None
    ) -> SessionEgress | None:
        """Network 'allowlist': start its policy proxy, labelled `label` in the audit log (None otherwise), on
        the socket reserved for it (`reserve_egress`) if it has one."""
        if hub is not None:
            listener, self.egress_socket = self.egress_socket, None
            try:
                self.egress = await hub.open(options or self.options, self.dirs, task_group, label, listener)
            except BaseException:
                if listener is not None:
                    listener.close()
                raise
        return self.egress

    def reserve_egress(self, hub: EgressHub) -> None:
        """A warm pool's sandbox: make its proxy socket before it starts, served once a session takes it."""
        self.egress_socket = hub.reserve(self.options, self.dirs)

    def spec(self, options: SandboxOptions | None = None) -> SandboxSpec:
        """What a backend needs to start the sandbox: its mounts as it gets them (staged on a root server)."""
        options = options or self.options
        mounts = self.mounts.mounts if self.mounts is not None else options.mounts
        return sandbox_spec(options, self.dirs, mounts, self.leases.settings.network_ceiling)

    async def release(self) -> bool:
        """Hand back its egress proxy, mounts and dirs, in that order (shielded: it must finish). False when a
        staged mount would not detach: its dirs are then left, never deleted beneath it. The uid is release_user's."""
        with anyio.CancelScope(shield=True):
            if self.egress is not None:
                await self.egress.aclose()
            if self.egress_socket is not None:  # never taken
                self.egress_socket.close()
                self.egress_socket = None
                self.dirs.remove_host_file(EGRESS_SOCKET)
            if self.mounts is not None and not await anyio.to_thread.run_sync(self.mounts.close):
                return False
            await anyio.to_thread.run_sync(self.dirs.close)
        return True

    async def close(self) -> None:
        """release(), then the uid too unless something was left (a sandbox that ended: a one-shot run's)."""
        if await self.release():
            self.release_user()

    def release_user(self) -> None:
        """Give its host uid back to the pool, once, when nothing of the sandbox runs."""
        if not self._user_released:
            self._user_released = True
            self.leases.release_user(self.dirs)


def sandbox_spec(options: SandboxOptions, dirs: SandboxDirs, mounts: tuple[Mount, ...], ceiling: str) -> SandboxSpec:
    """What a backend needs to start a sandbox with these options in these dirs, with these mounts
    (as the sandbox gets them: staged on a root server), under the user's network `ceiling`."""
    return SandboxSpec(
        name=dirs.key,
        workspace=dirs.workspace.path,
        runtime_dir=dirs.run_dir,
        host_dir=dirs.host_dir,
        limits=options.limits,
        network=options.network,
        mounts=mounts,
        user=dirs.user,
        install_refusal=offline_install(ceiling) if options.network == NetworkMode.NONE else None,
    )


def chown_workspace(workspace: Workspace, owner: tuple[int, int]) -> None:
    """Chown the workspace to the sandbox's host user, by fd; a reopened persistent one whose files
    belong to another uid (an older server's) is re-owned entry by entry, links never followed."""
    with hostfs.dir_fd(workspace.path) as fd:
        if workspace.persistent and (os.fstat(fd).st_uid, os.fstat(fd).st_gid) != owner:
            if not hostfs.chown_tree(fd, owner):
                log.warning("workspace %s: some entries (too deep, or too many) keep their old owner", workspace.path)
        else:
            os.fchown(fd, *owner)
