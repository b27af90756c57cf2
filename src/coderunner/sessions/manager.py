"""The SessionManager: the only owner of mutable server state.

It hands out high-entropy session handles, creates each caller's default session on first use,
enforces the session limits, closes idle sessions, and on start removes what a killed server
left behind. Options come from options.py, each sandbox's host side from leases.py.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time

import anyio
from anyio.abc import TaskGroup

from ..callers import LOCAL_CALLER, client_of_key
from ..config import Settings
from ..errors import SessionError
from ..leases import SandboxLeases
from ..mounts import MountSpec
from ..oneshot import OneShotRunner
from ..options import SandboxOptions, configured_mounts, sandbox_options
from ..owners import LOCAL_CLIENT
from ..sandbox import Mount, SandboxBackend, UidPool, ensure_private_dir, per_sandbox_uids
from ..session_dirs import remove_stale_dirs
from ..startup_hooks import disable_startup_hooks
from .jobs import JobTable
from .session import Session

log = logging.getLogger(__name__)

#: Bound on closing every session at server shutdown.
SHUTDOWN_TIMEOUT_S = 10.0


class SessionManager:
    """Owns every session of one server process, and the task group their sandboxes run in."""

    def __init__(self, settings: Settings, backend: SandboxBackend) -> None:
        self.settings = settings
        self.backend = backend
        self._sessions: dict[str, Session] = {}
        #: Each client's default session: caller key -> session id.
        self._default_ids: dict[str, str] = {}
        self._default_lock = anyio.Lock()
        self._task_group: TaskGroup | None = None
        self.base_mounts: list[Mount] = []
        #: The host side of every sandbox (dirs, host uid, mounts), sessions' and one-shot runs' alike.
        self.leases = SandboxLeases(settings, backend, UidPool() if per_sandbox_uids(settings.sandbox_user) else None)
        #: Throwaway sandboxes for execute_code / validate_code (set up on entry).
        self.oneshot: OneShotRunner
        #: execute_code runs that outlived their call (sessions' own jobs are in each session).
        self.jobs: JobTable

    async def __aenter__(self) -> SessionManager:
        ensure_private_dir(self.settings.runtime_dir, self.backend.dir_mode)
        ensure_private_dir(self.settings.workspaces_dir, self.backend.dir_mode)
        self.base_mounts = configured_mounts(self.settings, self.backend.identity)
        removed = remove_stale_dirs(self.settings.runtime_dir, self.settings.workspaces_dir, self.backend.remove_stale)
        if removed:
            log.info("removed %d session dir(s) left by a server that is gone", removed)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._reap_idle)
        self.jobs = JobTable(self._task_group)
        self.oneshot = OneShotRunner(
            backend=self.backend,
            task_group=self._task_group,
            leases=self.leases,
            output_limit_chars=self.settings.output_limit_chars,
            max_concurrent=self.settings.max_oneshot_runs,
            max_per_caller=self.settings.max_oneshot_runs_per_client,
        )
        return self

    async def _reap_idle(self) -> None:
        """Close sessions nobody used for idle_timeout_s (their sandboxes hold memory and disk)."""
        limit = self.settings.idle_timeout_s
        while True:
            await anyio.sleep(min(max(limit / 4, 0.5), 30.0))
            now = time.monotonic()
            for session in list(self._sessions.values()):
                if not session.busy and now - session.last_used > limit:
                    log.info("closing session %s… after %.0fs idle", session.session_id[:6], now - session.last_used)
                    with contextlib.suppress(SessionError):
                        await self.close(session.session_id)

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.move_on_after(SHUTDOWN_TIMEOUT_S, shield=True):
            await self.close_all()
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()
        await self._task_group.__aexit__(None, None, None)

    def options(
        self,
        network: str | None = None,
        memory_mb: int | None = None,
        cpus: float | None = None,
        timeout_s: float | None = None,
        mounts: list[MountSpec] | None = None,
        name: str | None = None,
        persistent: bool = False,
        client: str = LOCAL_CLIENT,
    ) -> SandboxOptions:
        """Options for a session or a one-shot run: the settings' defaults with what was asked for, checked."""
        return sandbox_options(
            self.settings,
            self.backend,
            self.base_mounts,
            network=network,
            memory_mb=memory_mb,
            cpus=cpus,
            timeout_s=timeout_s,
            mounts=mounts,
            name=name,
            persistent=persistent,
            client=client,
        )

    async def create(self, options: SandboxOptions | None = None, owner: str = LOCAL_CALLER) -> Session:
        options = options or self.options()
        if len(self._sessions) >= self.settings.max_sessions:
            raise SessionError(
                f"session limit reached ({self.settings.max_sessions} open): close one with close_session "
                "or raise max_sessions in the configuration"
            )
        held = sum(session.owner == owner for session in self._sessions.values())
        if owner != LOCAL_CALLER and held >= self.settings.max_sessions_per_client:
            raise SessionError(
                f"this client already holds {held} sessions, its share of this server: close one with "
                "close_session (list_sessions shows them), or raise max_sessions_per_client in the configuration"
            )
        assert self._task_group is not None, "SessionManager used outside its `async with`"
        session_id = secrets.token_urlsafe(18)
        dirs = await self.leases.open_dirs(options)
        workspace = dirs.workspace
        try:
            # File walks and mount syscalls (and, for an id mapping, a helper process): off the loop.
            startup = (
                await anyio.to_thread.run_sync(disable_startup_hooks, workspace.path) if workspace.reopened else None
            )
            mounts = await anyio.to_thread.run_sync(self.leases.prepare_mounts, options, dirs, not workspace.reopened)
        except OSError as exc:
            await self.leases.close_dirs(dirs)
            raise SessionError(f"could not check the reopened workspace's start-up files: {exc}") from None
        except BaseException:
            await self.leases.close_dirs(dirs)
            raise
        session = Session(
            session_id=session_id,
            options=options,
            dirs=dirs,
            backend=self.backend,
            settings=self.settings,
            task_group=self._task_group,
            owner=owner,
            sandbox_mounts=mounts,
            startup=startup.as_dict() if startup is not None else None,
        )
        self._sessions[session_id] = session
        try:
            await session.start_kernel()
        except BaseException:
            self._sessions.pop(session_id, None)
            await self._close_session(session)
            raise
        log.info("session %s… started", session_id[:6])
        return session

    async def _close_session(self, session: Session) -> None:
        await session.close()
        self.leases.release_user(session.dirs)

    async def resolve(self, session_id: str | None, owner: str = LOCAL_CALLER, client: str = LOCAL_CLIENT) -> Session:
        """The named session, or `owner`'s default one (created on first use).

        A session belongs to the client (bearer token) that created it: any caller of that client
        may use its id, a caller of another client is refused. The default session and the
        listing are per caller (callers.py).
        """
        if session_id:
            return self._owned(session_id, owner)
        async with self._default_lock:
            default_id = self._default_ids.get(owner)
            if default_id is None or default_id not in self._sessions:
                default_id = (await self.create(self.options(client=client), owner=owner)).session_id
                self._default_ids[owner] = default_id
            return self._sessions[default_id]

    def _owned(self, session_id: str, owner: str | None) -> Session:
        """The open session `session_id`, if `owner`'s client may use it (None: the server itself)."""
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionError(
                f"unknown or expired session_id {session_id!r}: call list_sessions to see open sessions, "
                "create_session for a new one, or omit session_id to use the default session"
            )
        if owner is not None and client_of_key(session.owner) != client_of_key(owner):
            raise SessionError(
                f"session_id {session_id!r} belongs to another client (it was created with another bearer "
                "token) and only that client may use it: omit session_id to use your own default session, "
                "or create_session for a new one"
            )
        return session

    async def close(self, session_id: str, owner: str | None = None) -> None:
        """Close a session: for `owner` only if its client may use it (None: the server, e.g. idle reaping)."""
        session = self._owned(session_id, owner)
        self._sessions.pop(session_id, None)
        if self._default_ids.get(session.owner) == session_id:
            del self._default_ids[session.owner]
        await self._close_session(session)

    async def release_caller(self, owner: str) -> None:
        """A client went away: close its default session (sessions it created keep their handles)."""
        session_id = self._default_ids.pop(owner, None)
        if session_id is not None and session_id in self._sessions:
            log.info("client gone: closing its default session %s…", session_id[:6])
            with contextlib.suppress(SessionError):
                await self.close(session_id)

    async def close_all(self) -> None:
        sessions = list(self._sessions.values())
        self._sessions.clear()
        self._default_ids.clear()
        async with anyio.create_task_group() as tg:
            for session in sessions:
                tg.start_soon(self._close_session, session)

    def list(self, owner: str | None = None) -> list[Session]:
        """Every open session, or those `owner` created."""
        return [s for s in self._sessions.values() if owner is None or s.owner == owner]

    def is_default(self, session: Session) -> bool:
        return self._default_ids.get(session.owner) == session.session_id
