"""A session kept whole across its server's death: the record its watcher holds, and its successor's adoption.

A node agent's sessions are separate processes (sandbox, kernel) with their host side on the node's disk
(dirs, workspace mount, staged outbox, cgroups): the agent's death need end none of them. What does end with
it is what it alone held open, and what it alone knew:
- the gate's write end (the sandbox's init exits on its end of file), the dirs' lock and the uid's claim (a
  sweep would remove the dirs, another sandbox could draw the uid), a forked kernel's pidfd and output pipe;
- the kernel's key and channel names, the session's options, owner and generation.
`record_of` collects both for the agent's watcher (sandbox/handover.py): the fds by `keep`, the rest as one
plain-data SessionRecord. A successor that receives them `adopt`s each: the dirs reopened by key and checked
against the lock it was handed, the uid's claim and the cgroups taken as they are, the sandbox held by its
pidfds, the kernel's client connected to the sockets already claimed into the host-only sock/ dir. Its kernel
keeps its variables; what it ran meanwhile is not known (the job that ran it was the dead agent's).

What is adopted, and what is not (then ended at once, as before: the watcher ends what was not kept):
- bubblewrap sandboxes only (ended by pidfds; other backends' containers end with the server's watcher);
- network 'none' and 'allowlist'. An allowlist sandbox's proxy ran in the dead server, but its listening socket
  is kept too: the sandbox's connections wait in its backlog until the successor serves it, with the session's
  own list and the user's decisions so far (hosts allowed, and declined, for this session; the ceiling is the
  successor's, so a decision it no longer covers is dropped). Connections that were open through the dead proxy
  ended with it. An internet session's slirp4netns ends with its server: not adopted;
- a persistent (named) workspace with its own lock, handed over like the dirs' (no other session mounts it
  meanwhile);
- the session's live kernel only: its standby (started after a reset) ends, and is started again.

One idea: what a session needs to outlive its server, written by one and read back by the next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import TypeAdapter, ValidationError

from coderunner.errors import SessionError
from coderunner.hostfs.exports import Exporter
from coderunner.hostfs.sandbox_mounts import SandboxMounts
from coderunner.hostfs.session_dirs import SandboxDirs, reopen_sandbox_dirs
from coderunner.hostfs.workspaces import Workspace
from coderunner.kernel.host_channels import Deadline
from coderunner.sandbox import Mount
from coderunner.sandbox.cgroups import SessionCgroup
from coderunner.sandbox.handover import Handed, hold, receive, taken
from coderunner.sandbox.pid1 import SandboxHold
from coderunner.sessions.leases import SandboxLease
from coderunner.sessions.sandbox_options import SandboxOptions
from coderunner.sessions.session import Session
from coderunner.sessions.warm_take import StartedFrom
from coderunner.vocabulary.host_identity import HostIdentity
from coderunner.vocabulary.network import NetworkMode

if TYPE_CHECKING:
    from coderunner.sessions.manager import SessionManager

log = logging.getLogger(__name__)

#: The fds a record's sandbox is handed with, in this order; the optional ones only when it has them.
GATE, DIRS_LOCK, UID_CLAIM, KERNEL_PIDFD, KERNEL_OUTPUT = "gate", "dirs_lock", "uid_claim", "kernel_pidfd", "output"
#: An allowlist sandbox's proxy socket (listening); a persistent workspace's lock.
EGRESS_LISTENER, WORKSPACE_LOCK = "egress_listener", "workspace_lock"
#: What an adopted session's status says of its sandbox's start.
ADOPTED = "adopted by this node agent after the one that started it died"


@dataclass(frozen=True)
class KernelRecord:
    """The live kernel: its number, its sandbox's name, its connection (its key: the record is host-only), how it
    started, and a forked kernel's host pid."""

    generation: int
    spec_name: str
    connection: dict[str, Any]
    started_how: str | None
    program_pid: int | None


@dataclass(frozen=True)
class SessionRecord:
    """Everything a successor needs of a session besides the fds it is handed with (`fds` names them)."""

    session_id: str
    owner: str
    options: SandboxOptions
    generation: int
    next_kernel: int
    kernel: KernelRecord
    dirs_key: str
    user: HostIdentity | None
    workspace_path: Path
    workspace_size_mb: int | None
    workspace_image: Path | None
    workspace_tmpfs: bool
    mounts: tuple[Mount, ...]
    staged_dir: Path | None
    export_mount: str | None
    host_view: tuple[Mount, ...]
    owners: dict[str, tuple[int, int]]
    cgroup_version: int | None
    cgroup_dirs: dict[str, Path]
    fds: tuple[str, ...]
    #: The caller's own (a node agent's: what the session reserved of its node).
    extra: dict[str, Any] = field(default_factory=dict)
    #: Network 'allowlist': the hosts its proxy allows now (its own list and what the user allowed since), and
    #: those the user declined.
    egress_allowed: tuple[str, ...] = ()
    egress_declined: tuple[str, ...] = ()
    #: A named session's workspace, kept when it closes (its lock comes as WORKSPACE_LOCK).
    workspace_persistent: bool = False


RECORDS: TypeAdapter[SessionRecord] = TypeAdapter(SessionRecord)


def unadoptable(session: Session) -> str | None:
    """Why `session` cannot outlive its server as it is now (None: it can)."""
    kernel = session.kernel
    process = kernel.process if kernel is not None else None
    if kernel is None or process is None or not process.alive or kernel.sandbox.info is None:
        return "no live kernel"
    if not isinstance(process.hold, SandboxHold) or process.hold.init is None or process.hold.gate.write < 0:
        return "its sandbox is not held by pidfds (bubblewrap only)"
    egress = session.lease.egress
    if session.options.network == NetworkMode.ALLOWLIST and (egress is None or egress.listener is None):
        return "network 'allowlist' with no proxy socket"
    if session.options.network not in (NetworkMode.NONE, NetworkMode.ALLOWLIST):
        return f"network '{session.options.network}' is served by its server's own processes"
    if session.workspace.persistent and session.workspace.lock_fd is None:
        return "a persistent workspace without its lock"
    if session.closed or session.close_done is not None:
        return "closing"
    return None


def record_of(session: Session, claim_fd: int | None, extra: dict[str, Any]) -> tuple[str, list[int]]:
    """The record of `session` and the fds it is kept whole with (see the module docstring), once unadoptable
    said it can be. `claim_fd`: this process's claim on its uid, if it has one."""
    kernel = session.kernel
    assert kernel is not None and kernel.process is not None and kernel.sandbox.info is not None
    process, hold_ = kernel.process, kernel.process.hold
    assert isinstance(hold_, SandboxHold)
    names, fds = [GATE, DIRS_LOCK], [hold_.gate.write, session.dirs.lock_fd]
    if claim_fd is not None:
        names.append(UID_CLAIM)
        fds.append(claim_fd)
    if process.program_fds is not None:
        names += [KERNEL_PIDFD, KERNEL_OUTPUT]
        fds += list(process.program_fds)
    egress = session.lease.egress
    if egress is not None and egress.listener is not None:
        names.append(EGRESS_LISTENER)
        fds.append(egress.listener.fileno())
    if session.workspace.lock_fd is not None:
        names.append(WORKSPACE_LOCK)
        fds.append(session.workspace.lock_fd)
    plan = session.sandbox_mounts
    cgroup = process.cgroup
    record = SessionRecord(
        session_id=session.session_id,
        owner=session.owner,
        options=session.options,
        generation=session.generation,
        next_kernel=session._next_kernel,
        kernel=KernelRecord(
            kernel.generation,
            kernel.spec.name,
            dict(kernel.sandbox.info),
            kernel.sandbox.started_how,
            process.program_pid if process.program_fds is not None else None,
        ),
        dirs_key=session.dirs.key,
        user=session.dirs.user,
        workspace_path=session.workspace.path,
        workspace_size_mb=session.workspace.size_mb,
        workspace_image=session.workspace.image,
        workspace_tmpfs=session.workspace.tmpfs,
        workspace_persistent=session.workspace.persistent,
        mounts=plan.mounts if plan is not None else (),
        staged_dir=plan.staged_dir if plan is not None else None,
        export_mount=plan.export_mount if plan is not None else None,
        host_view=plan.host_view if plan is not None else (),
        owners=dict(plan.owners) if plan is not None else {},
        cgroup_version=cgroup.version if cgroup is not None else None,
        cgroup_dirs=dict(cgroup.dirs) if cgroup is not None else {},
        fds=tuple(names),
        extra=extra,
        egress_allowed=egress.proxy.policy.hosts if egress is not None else (),
        egress_declined=tuple(sorted(egress.proxy.declined)) if egress is not None else (),
    )
    return RECORDS.dump_json(record).decode(), fds


def record_mark(session: Session) -> tuple[Any, ...] | None:
    """What changes whenever the record would: the live kernel (its object and generation), and an allowlist
    proxy's decisions; None: no kernel."""
    kernel = session.kernel
    if kernel is None:
        return None
    egress = session.lease.egress
    decided = (egress.proxy.policy.hosts, egress.proxy.declined) if egress is not None else None
    return id(kernel), kernel.generation, decided


@dataclass
class _Held:
    """One handed sandbox on its way to a session. `loose`: the fds it came with that nothing here owns yet (each
    is closed once, by whichever owner took it: the hold, the dirs, the uid pool, the kernel's follower)."""

    handed: Handed
    record: SessionRecord
    loose: set[int]
    dirs: SandboxDirs | None = None
    sandbox: Any = None
    uid_held: bool = False


def read(handed: Handed) -> SessionRecord | None:
    """The record `handed` came with, if it is one this version can adopt (else None: it is let go and ends)."""
    try:
        record = RECORDS.validate_json(handed.record)
    except ValidationError as exc:
        log.warning("a handed sandbox's record is not one this version reads (%s): it ends", exc.error_count())
        return None
    if len(record.fds) != len(handed.fds) or GATE not in record.fds or DIRS_LOCK not in record.fds:
        log.warning("a handed sandbox came with fds its record does not name: it ends")
        return None
    return record


def take(manager: SessionManager, handed: Handed, record: SessionRecord) -> _Held:
    """Hold `handed` here (its watcher entry, its dirs, its uid): the part of an adoption that must be done before
    the predecessor's watcher is told "taken". Blocking (opens dirs); raises OSError or ValueError, having let go
    of all it came with (let_go)."""
    fds = dict(zip(record.fds, handed.fds, strict=True))
    held = _Held(handed, record, {handed.outer, *handed.inits, *handed.fds})
    try:
        users, user = manager.leases.users, record.user
        if users is not None and user is not None:
            claim = fds.get(UID_CLAIM)
            user = users.hold_claim(user.uid, claim)
            held.uid_held = True
            if claim is not None:
                held.loose.discard(claim)
        lock = fds.get(WORKSPACE_LOCK)
        if record.workspace_persistent and lock is None:
            raise ValueError("its persistent workspace came without its lock")
        workspace = Workspace(
            record.workspace_path, record.workspace_size_mb, record.workspace_image,
            persistent=record.workspace_persistent, lock_fd=lock, tmpfs=record.workspace_tmpfs,
        )  # fmt: skip
        held.dirs = reopen_sandbox_dirs(manager.settings.runtime_dir, record.dirs_key, user, workspace, fds[DIRS_LOCK])
        held.loose -= {fds[DIRS_LOCK], *([lock] if lock is not None else [])}  # the dirs' and their workspace's
        cgroup = SessionCgroup(record.cgroup_version, dict(record.cgroup_dirs)) if record.cgroup_version else None
        program = None
        if KERNEL_PIDFD in fds and record.kernel.program_pid is not None:
            program = (record.kernel.program_pid, fds[KERNEL_PIDFD], fds[KERNEL_OUTPUT])
        held.sandbox = hold(handed, manager.task_group, fds[GATE], cgroup, program)
        held.loose -= {handed.outer, *handed.inits[:1], fds[GATE]}
        if program is not None:
            held.loose -= set(program[1:])
    except BaseException:
        let_go(manager, held)
        raise
    return held


def let_go(manager: SessionManager, held: _Held) -> None:
    """A sandbox that could not be adopted: ended by its pidfds, every fd it came with closed once (its init
    ends with its gate besides), its uid given back. Its dirs are left to a sweep once their lock is free (its
    processes may still be dying in them)."""
    if held.sandbox is not None and held.sandbox.hold is not None:
        held.sandbox.hold.kill()
        held.sandbox.hold.release()
    else:
        for pidfd in (*held.handed.inits, held.handed.outer):
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    if held.dirs is not None:
        for fd in (held.dirs.host_fd, held.dirs.run_fd, held.dirs.sock_fd, held.dirs.lock_fd,
                   held.dirs.workspace.lock_fd):  # fmt: skip
            if fd is None:
                continue
            with contextlib.suppress(OSError):
                os.close(fd)
    for fd in held.loose:
        with contextlib.suppress(OSError):
            os.close(fd)
    held.loose.clear()
    if held.uid_held and manager.leases.users is not None and held.record.user is not None:
        manager.leases.users.release(held.record.user)


async def adopt(manager: SessionManager, held: _Held, timeout_s: float) -> Session:
    """The session of a sandbox held here (take): its lease, its kernel connected again. Raises on failure,
    having ended the sandbox and given back what it held."""
    record, dirs = held.record, held.dirs
    assert dirs is not None
    options = record.options
    lease = SandboxLease(manager.leases, options, dirs, mounts=_mounts(manager, record))
    session = Session(
        session_id=record.session_id, options=options, lease=lease, backend=manager.backend,
        settings=manager.settings, task_group=manager.task_group, owner=record.owner,
        kernel_factory=manager.kernel_factory, standby_budget=manager.standby_budget,
    )  # fmt: skip
    spec = dataclasses.replace(session.spec, name=record.kernel.spec_name)
    generation = record.kernel.generation
    kernel = manager.kernel_factory(manager.backend, spec, manager.task_group, dirs, generation=generation)
    kernel.sandbox.process = held.sandbox
    kernel.sandbox.info = dict(record.kernel.connection)
    kernel.sandbox.started_how = record.kernel.started_how
    try:
        await _serve_egress(manager, held, lease)
        with anyio.fail_after(timeout_s):
            await kernel.client.connect(kernel.sandbox.host_side(), Deadline(time.monotonic() + timeout_s))
    except BaseException:
        with anyio.CancelScope(shield=True):
            await kernel.shutdown()
            await lease.close()
            for fd in held.loose:
                with contextlib.suppress(OSError):
                    os.close(fd)
            held.loose.clear()
        raise
    session.kernel = kernel
    session._generation, session._next_kernel = record.generation, record.next_kernel
    session.started = StartedFrom(warm=False, why=ADOPTED)
    session.kept.armed = True
    session.kept.mark_saved(time.monotonic(), None)
    return session


async def _serve_egress(manager: SessionManager, held: _Held, lease: SandboxLease) -> None:
    """An allowlist sandbox's proxy, served again on its kept socket (the lease owns it from here) with the
    session's decisions so far; nothing for other modes."""
    record = held.record
    listener = dict(zip(record.fds, held.handed.fds, strict=True)).get(EGRESS_LISTENER)
    if listener is None:
        return
    lease.egress_socket = socket.socket(fileno=listener)
    held.loose.discard(listener)
    lease.egress_socket.setblocking(False)
    egress = await lease.open_egress(manager.egress, manager.task_group, record.session_id, record.options)
    if egress is None:
        raise SessionError("its allowlist proxy could not be served again: this server has no egress hub")
    dropped = egress.proxy.restore(record.egress_allowed, record.egress_declined)
    if dropped:
        log.warning("session %s…: hosts the user allowed that this server's allowlist does not cover, dropped: %s",
                    record.session_id[:6], ", ".join(dropped))  # fmt: skip


def _mounts(manager: SessionManager, record: SessionRecord) -> SandboxMounts | None:
    """Its mounts as they were staged (they stayed mounted), with an export copier again for its outbox."""
    if not record.mounts and record.staged_dir is None and record.export_mount is None:
        return None
    plan = SandboxMounts(
        mounts=record.mounts, staged_dir=record.staged_dir, export_mount=record.export_mount,
        host_view=record.host_view, owners=dict(record.owners),
    )  # fmt: skip
    export = manager.leases.export_plan(record.options.client) if record.export_mount is not None else None
    outbox = next((mount.host for mount in record.mounts if mount.sandbox == record.export_mount), None)
    if export is not None and outbox is not None:
        # Not baselined: what the outbox got while no agent watched it is copied at the next call.
        plan.exporter = Exporter(outbox, export.target, export.limit_bytes, export.owner)
    return plan


def keep_whole(manager: SessionManager, session: Session, extra: dict[str, Any]) -> str | None:
    """Have `session` outlive this process should it die: its record and fds to its sandbox's watcher entry, for a
    successor (sandbox/handover.py). Why not, if it cannot outlive it as it is now (unadoptable). Sent again
    whenever its kernel changes (kernel_mark)."""
    why_not = unadoptable(session)
    if why_not is not None:
        return why_not
    users, user = manager.leases.users, session.dirs.user
    claim = users.claim_of(user.uid) if users is not None and user is not None else None
    kept = record_of(session, claim, extra)
    assert session.kernel is not None and session.kernel.process is not None
    hold_ = session.kernel.process.hold
    assert isinstance(hold_, SandboxHold)
    hold_.watcher.keep(hold_.entry, *kept)
    return None


async def adopt_all(manager: SessionManager, path: Path, timeout_s: float) -> list[tuple[Session, SessionRecord]]:
    """Every session a dead predecessor's watcher waiting at `path` kept, adopted here (none: nobody waits there).
    Each is held here before the watcher is told "taken" (so one is never held by nobody); its kernel is connected
    after, each within `timeout_s`. One that cannot be adopted is ended, saying why in the log."""
    got = await anyio.to_thread.run_sync(receive, path)
    if got is None:
        return []
    sock, handed = got
    held: list[_Held] = []
    try:
        while handed:
            entry = handed.pop(0)
            record = read(entry)
            if record is None:
                _end(entry)
                continue
            try:
                held.append(take(manager, entry, record))
            except (OSError, ValueError) as exc:
                log.warning("session %s… could not be taken over: %s", record.session_id[:6], exc)
    finally:
        for entry in handed:  # not reached (a cancel): ended, never held by nobody
            _end(entry)
        taken(sock)
    log.info("took over %d session(s) of this node's previous agent", len(held))
    adopted: list[tuple[Session, SessionRecord]] = []

    async def connect(one: _Held) -> None:
        try:
            adopted.append((await adopt(manager, one, timeout_s), one.record))
        except Exception as exc:
            log.warning(
                "session %s… could not be taken over: its kernel did not answer (%r)", one.record.session_id[:6], exc
            )

    async with anyio.create_task_group() as group:
        for one in held:
            group.start_soon(connect, one)
    return adopted


def _end(handed: Handed) -> None:
    """A handed sandbox nobody here will hold: killed by its pidfds, its fds closed."""
    for pidfd in (*handed.inits, handed.outer):
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    handed.close()
