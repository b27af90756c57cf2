"""One sandbox's only way out in network mode 'allowlist': its own policy proxy on a unix socket.

The socket is made by the host in the sandbox's host-only dir (host/, bound read-only at the same
path: the sandbox may connect through it but never replace it), owned by the sandbox's host user
with mode 0600, and served for the sandbox's life by an EgressProxy (egress/policy_proxy.py). Inside,
the forwarder (guest/egress_forwarder.py) exposes it as 127.0.0.1:EGRESS_PORT, handing each client's
socket over it (egress/handoff.py) or, where fds cannot cross, relaying the bytes. No other sandbox
sees this dir, and on a root server no other sandbox uid may connect, so a session can never use
another's proxy or policy.

`EgressHub` is the server-wide part: the user's ceiling (Settings.egress, parsed once) and the
audit file every session's decisions also go to.

This is per-sandbox wiring, beside the lease that opens it (leases.py): egress/ holds the policy
proxy itself and knows no settings, sandboxes or sessions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path

import anyio
from anyio.abc import TaskGroup

from coderunner.config import Settings
from coderunner.egress.audit import AuditFile, DecisionLog
from coderunner.egress.policy_proxy import Asker, EgressProxy, ProxyLimits
from coderunner.errors import SessionError
from coderunner.hostfs.session_dirs import SandboxDirs
from coderunner.policy.egress import EgressPolicy
from coderunner.sandbox.common import EGRESS_SOCKET
from coderunner.sessions.sandbox_options import SandboxOptions
from coderunner.vocabulary.network import NetworkMode

log = logging.getLogger(__name__)

DEFAULT_LIMITS = ProxyLimits()

#: Connections the kernel may queue on the proxy socket before it accepts them.
LISTEN_BACKLOG = 128


class SessionEgress:
    """The proxy of one allowlist sandbox (a session, or a one-shot run): start, serve, close."""

    def __init__(
        self,
        policy: EgressPolicy,
        ceiling: EgressPolicy,
        *,
        session_id: str,
        audit: AuditFile | None = None,
        limits: ProxyLimits = DEFAULT_LIMITS,
    ) -> None:
        self.session_id = session_id
        self.log = DecisionLog(session_id, sink=audit)
        self.proxy = EgressProxy(policy, ceiling, session_id=session_id, log=self.log, limits=limits)
        self._listener: socket.socket | None = None
        self._dirs: SandboxDirs | None = None
        self._scope: anyio.CancelScope | None = None
        self._stopped = anyio.Event()

    def set_asker(self, asker: Asker | None) -> None:
        """Who is asked about a host inside the ceiling but outside this session's list (MCP
        elicitation, set for the length of a call that can ask); None: nobody, such a host is
        denied with a hint on how to allow it (not recorded as declined by the user)."""
        self.proxy.asker = asker

    @property
    def listener(self) -> socket.socket | None:
        """The listening socket it serves (None once closed): kept by a node agent's watcher, should it die, so
        that the next agent serves the sandbox on it (sessions/adoption.py)."""
        return self._listener

    @property
    def socket_path(self) -> Path | None:
        return self._dirs.host_dir / EGRESS_SOCKET if self._dirs is not None else None

    async def start(self, dirs: SandboxDirs, task_group: TaskGroup, listener: socket.socket | None = None) -> None:
        """Serve the proxy until aclose on `listener` (a warm pool's sandbox's, made when it started:
        EgressHub.reserve), or on a socket made now in `dirs`' host-only dir."""
        self._listener = listener if listener is not None else make_socket(dirs)
        self._dirs = dirs
        task_group.start_soon(self._serve)

    async def _serve(self) -> None:
        assert self._listener is not None
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                await self.proxy.serve(self._listener)
        except Exception:
            log.exception("egress proxy of %s… failed: that sandbox has no network now", self.session_id[:6])
        finally:
            self._stopped.set()

    async def aclose(self) -> None:
        """Stop serving, close every connection, remove the socket (shielded, bounded)."""
        with anyio.CancelScope(shield=True):
            if self._scope is not None:
                self._scope.cancel()
                with anyio.move_on_after(5.0):
                    await self._stopped.wait()
            with anyio.move_on_after(5.0), contextlib.suppress(Exception):
                await self.proxy.aclose()
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            if self._dirs is not None:
                self._dirs.remove_host_file(EGRESS_SOCKET)
                self._dirs = None
            self.log.close()  # the audit's counts of folded denials (egress/audit.py SessionAudit)


def make_socket(dirs: SandboxDirs) -> socket.socket:
    """A listening unix socket at host/EGRESS_SOCKET that only the sandbox's host user may connect to.

    host/ is the host's alone (the sandbox cannot write it or its parent), so the path is ours:
    bound before the sandbox starts, owner and mode set before anyone can connect.
    """
    dirs.remove_host_file(EGRESS_SOCKET)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(dirs.host_dir / EGRESS_SOCKET))
        if dirs.owner is not None:
            os.chown(EGRESS_SOCKET, *dirs.owner, dir_fd=dirs.host_fd, follow_symlinks=False)
        os.chmod(EGRESS_SOCKET, 0o600, dir_fd=dirs.host_fd)
        listener.listen(LISTEN_BACKLOG)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        dirs.remove_host_file(EGRESS_SOCKET)
        raise
    return listener


class EgressHub:
    """The server's side of network 'allowlist': the user's ceiling and the shared audit file."""

    def __init__(self, settings: Settings, limits: ProxyLimits = DEFAULT_LIMITS) -> None:
        self._settings = settings
        self._audit_path: Path | None = settings.egress.audit_log  # the ceiling is parsed here, at start
        self.limits = limits
        self._audit: AuditFile | None = None

    @property
    def ceiling(self) -> EgressPolicy:
        """The most any allowlist sandbox may reach (the settings' one parse: Settings.egress)."""
        return self._settings.egress.ceiling

    def _audit_file(self) -> AuditFile | None:
        if self._audit is None and self._audit_path is not None:
            try:
                self._audit_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._audit = AuditFile(self._audit_path)
            except OSError as exc:
                log.warning("egress audit log %s cannot be written (%s): decisions are kept per session only",
                            self._audit_path, exc)  # fmt: skip
                self._audit_path = None
        return self._audit

    def policy_for(self, options: SandboxOptions) -> EgressPolicy:
        """What one sandbox may reach: what it asked for (checked against the ceiling), or the ceiling."""
        return self.ceiling.narrowed(options.allow) if options.allow else self.ceiling

    async def open(
        self, options: SandboxOptions, dirs: SandboxDirs, task_group: TaskGroup, session_id: str,
        listener: socket.socket | None = None,
    ) -> SessionEgress | None:  # fmt: skip
        """The running proxy of an allowlist sandbox (None for other modes): before the sandbox starts, or,
        for a warm pool's sandbox, when it is taken, on the `listener` reserved for it when it started."""
        if options.network != NetworkMode.ALLOWLIST:
            return None
        audit = await anyio.to_thread.run_sync(self._audit_file)
        egress = SessionEgress(self.policy_for(options), self.ceiling, session_id=session_id, audit=audit,
                               limits=self.limits)  # fmt: skip
        try:
            await egress.start(dirs, task_group, listener)
        except OSError as exc:
            await egress.aclose()
            raise SessionError(f"could not set up the sandbox's network proxy: {exc}") from None
        return egress

    def reserve(self, options: SandboxOptions, dirs: SandboxDirs) -> socket.socket | None:
        """A warm pool's allowlist sandbox: its proxy socket, made before it starts, served by nobody until a
        session takes it (`open` then serves that session's policy on it, under that session's id). Until
        then a connection waits unanswered, and the sandbox runs only the server's warm-up. None for other
        modes. Raises SessionError."""
        if options.network != NetworkMode.ALLOWLIST:
            return None
        try:
            return make_socket(dirs)
        except OSError as exc:
            raise SessionError(f"could not set up the sandbox's network proxy: {exc}") from None

    def close(self) -> None:
        """Write what the audit file still has queued (bounded) and close it."""
        if self._audit is not None:
            self._audit.close()
            self._audit = None
