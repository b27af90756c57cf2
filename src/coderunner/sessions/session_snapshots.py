"""Session snapshots: save a session (workspace files and kernel state) into the store, and seed a
new session from one. The manager opens sessions; this module says what goes into and out of them.

Saving: with no cell running, the guest (coderunner_guest/snapshot.py) pickles the user's namespace
inside the sandbox into WORKSPACE/.coderunner/snapshot while the host copies the workspace (that
folder left out) into a draft in the store; then the host copies that folder beside it, both
through directory fds (snapshots/store.py), and commits. Restoring: before any sandbox runs on the
new workspace, the host copies the snapshot's files into it and moves planted start-up hooks aside
as for a reopened workspace (startup_hooks.py); while the kernel starts, it stages the state
read-only in the new sandbox's host dir (host-only, bound read-only); once the kernel is up the
guest loads it there. Nothing of a snapshot is unpickled on the host, and loading runs no code but unpickling
the user's own objects, inside the new sandbox.

Memory snapshots (a backend with a checkpointer: gvisor): manage_snapshots save, fork and
restore save and restore the whole sandbox instead (runsc checkpoint: every variable, thread,
open file and /tmp), its workspace copied while it is stopped so that files and memory agree. The
image is written and read by runsc only, in the host-only store. keep_state stays on the pickled
path on every backend (it must survive an upgrade of runsc or the image, which a checkpoint does not).

What the guest reports (its save and load accounts) comes from inside the sandbox: it is checked
against a schema (SaveReport, LoadReport) and cut to a fixed size before it is kept in meta.json or
shown; one of the wrong shape refuses the snapshot. A padded report can thus neither bloat the
store's records nor hide a snapshot from its owner (a record past MAX_META_BYTES would be unreadable).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from coderunner.config import Settings
from coderunner.errors import CodeRunnerError
from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs.session_dirs import SandboxDirs
from coderunner.kernel.process import CheckpointFailed
from coderunner.kernel.startup_hooks import disable_startup_hooks
from coderunner.offload import alongside, off_loop
from coderunner.sandbox import SandboxBackend
from coderunner.sessions.session import GUEST_MARGIN_S, Session
from coderunner.sessions.snapshot_reports import (
    REPORT_TEXT,
    SaveReport,
    bounded_load_report,
    bounded_report,
    report_count,
)
from coderunner.snapshots.store import CopyReport, SnapshotError, SnapshotMeta, SnapshotStore

log = logging.getLogger(__name__)

#: Where the guest writes the state, relative to the workspace (host-read by fds, then removed).
STATE_IN_WORKSPACE = ".coderunner/snapshot"
#: The staged state's folder in a restored sandbox's host dir (read-only there).
STAGED_STATE = "snapshot"
#: What a keep_state session's own snapshot is called.
KEEP_PREFIX = "keep-"
#: Kinds of SnapshotMeta.
SNAPSHOT, PERSISTENT = "snapshot", "persistent"


def keep_id(name: str) -> str:
    """The snapshot id of a persistent session's saved state."""
    return f"{KEEP_PREFIX}{name}"


@dataclass
class Taken:
    """A snapshot just made, and what its workspace copy took."""

    meta: SnapshotMeta
    workspace: CopyReport | None
    seconds: float


@dataclass
class Seed:
    """What a new session starts from: a snapshot (its workspace files, if `with_workspace`, and its
    kernel state), filled in by `SessionSnapshots.plant`, `start` and `load`."""

    client: str
    snapshot_id: str
    with_workspace: bool = True
    meta: SnapshotMeta | None = None
    workspace: CopyReport | None = None
    #: The guest's account of the load (restored, modules, failed, not_carried).
    loaded: dict[str, Any] = field(default_factory=dict)
    #: Start-up hooks found in the restored files (startup_hooks.py), for the reply.
    startup: dict[str, Any] | None = None
    #: A memory snapshot's checkpoint, restored in place of a fresh kernel (set by `plant`).
    memory: MemoryImage | None = None


@dataclass(frozen=True)
class MemoryImage:
    """A gVisor checkpoint in the store: runsc reads `image_dir`; `connection` reaches the kernel in it;
    `owner` is the host (uid, gid) its processes run as and keep when restored (None: the server's)."""

    image_dir: Path
    connection: dict[str, Any]
    owner: tuple[int, int] | None


#: What a memory snapshot carries, and what it cannot (for replies).
MEMORY_CARRIES = "the kernel's whole memory: every variable, import, running thread, open file and /tmp"
MEMORY_NEVER = ["connections to the outside (the host reconnects the kernel's own channels)"]


def memory_key(meta: SnapshotMeta) -> str | None:
    """The runtime a memory snapshot needs (Checkpointer.key), or None for a pickled one."""
    memory = meta.state_report.get("memory")
    return str(memory.get("runtime")) if isinstance(memory, dict) else None


def takes_memory(backend: SandboxBackend) -> bool:
    """Does `backend` save sandboxes whole (a checkpointer: gvisor), so snapshots keep memory?"""
    return backend.checkpointer is not None


class SessionSnapshots:
    """The server's snapshots: its store, and saving and seeding sessions with it."""

    def __init__(self, store: SnapshotStore, settings: Settings, backend: SandboxBackend) -> None:
        self.store = store
        self.settings = settings
        self.backend = backend

    @classmethod
    def for_settings(cls, settings: Settings, backend: SandboxBackend) -> SessionSnapshots:
        store = SnapshotStore(
            settings.snapshot_root,
            limit_bytes=settings.snapshot_limit_mb * 2**20,
            keep=settings.snapshot_keep,
            retention_s=settings.snapshot_retention_s,
        )
        return cls(store, settings, backend)

    async def open(self) -> None:
        await anyio.to_thread.run_sync(self.store.open)

    async def take(
        self, session: Session, *, name: str = "", kind: str = SNAPSHOT, snapshot_id: str | None = None,
        wait_s: float | None = None,
    ) -> Taken:  # fmt: skip
        """Snapshot `session` (its workspace too unless `kind` is PERSISTENT) with no cell running.

        Waits `wait_s` (default: snapshot_timeout_s) for a running call; refuses at once while a job
        runs detached. Raises SessionError, GuestCallError, SnapshotError.
        """
        started = time.monotonic()
        if kind != PERSISTENT and takes_memory(self.backend):
            return await self._take_memory(session, name, snapshot_id, wait_s, started)
        timeout = self.settings.snapshot_timeout_s
        state_dir = f"{self.backend.workspace_path}/{STATE_IN_WORKSPACE}"
        arguments = {"op": "save", "dir": state_dir, "limit_bytes": self.store.limit_bytes}
        client = session.options.client
        with_workspace = kind != PERSISTENT
        async with session.held(timeout if wait_s is None else wait_s):
            draft = await off_loop(self.store.draft, client)
            try:

                def copy_workspace() -> CopyReport | None:
                    if not with_workspace:
                        return None
                    with hostfs.dir_fd(session.workspace.path) as workspace_fd:
                        return draft.copy_workspace(workspace_fd, STATE_IN_WORKSPACE)

                def take_state(report: dict[str, Any], copied: CopyReport | None) -> SnapshotMeta:
                    with hostfs.dir_fd(session.workspace.path) as workspace_fd:
                        # Copied, not removed: the guest removes its own folder (see discard).
                        state_bytes = draft.take_state(workspace_fd, STATE_IN_WORKSPACE, remove=False)
                    return draft.commit(self._meta(session, name, kind, snapshot_id, copied, state_bytes, report))

                # The workspace is copied while the guest pickles (no cell runs, and the copy
                # leaves the state's folder out): the snapshot takes the longer of the two, not both.
                raw, copied = await alongside(
                    copy_workspace, lambda: session.call_guest_held("snapshot", arguments, timeout)
                )
                report = bounded_report(raw, SaveReport)  # before anything of it is kept
                meta = await off_loop(take_state, report, copied, bulk=True)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await off_loop(draft.discard)
                raise
            finally:
                # The guest's folder never outlives the call, whatever failed: removed from inside
                # first (under gVisor a host-side delete leaves the space taken until the sandbox
                # ends), then by the host through fds in case the guest could not.
                with anyio.move_on_after(2 * GUEST_MARGIN_S, shield=True):  # a cancelled call cleans up too
                    with contextlib.suppress(CodeRunnerError):
                        await session.call_guest_held("snapshot", {"op": "discard", "dir": state_dir}, GUEST_MARGIN_S)
                    await off_loop(_remove_state_dir, session)
        return Taken(meta, copied, time.monotonic() - started)

    async def _take_memory(
        self, session: Session, name: str, snapshot_id: str | None, wait_s: float | None, started: float
    ) -> Taken:
        """A memory snapshot: the sandbox checkpointed by runsc (and restored in place to run on), its
        workspace copied while it is stopped. A failed checkpoint keeps nothing; the reply says
        whether the kernel carried on."""
        timeout = self.settings.snapshot_timeout_s
        client = session.options.client
        checkpointer = self.backend.checkpointer
        assert checkpointer is not None, "memory snapshots are taken only on a backend with a checkpointer"
        async with session.held(timeout if wait_s is None else wait_s):
            kernel = session.kernel
            assert kernel is not None
            draft = await off_loop(self.store.draft, client)
            try:
                image_dir = await off_loop(draft.memory_dir)
                copied: list[CopyReport] = []

                def copy_workspace() -> None:
                    with hostfs.dir_fd(session.workspace.path) as workspace_fd:
                        copied.append(draft.copy_workspace(workspace_fd, STATE_IN_WORKSPACE))

                async def while_stopped() -> None:
                    await off_loop(copy_workspace, bulk=True)

                try:
                    await kernel.checkpoint(image_dir, timeout, while_stopped)
                except CheckpointFailed as exc:
                    lost = "" if kernel.alive else "; the kernel did not survive it: the next call starts a fresh one"
                    raise SnapshotError(f"the memory checkpoint failed: {exc}{lost}") from None
                state_bytes = await off_loop(draft.charge_memory, kernel.saved_connection())
                report = {"memory": {"runtime": checkpointer.key()}, "not_carried": MEMORY_NEVER}
                workspace = copied[0] if copied else None
                meta = self._meta(session, name, SNAPSHOT, snapshot_id, workspace, state_bytes, report)
                meta = await off_loop(draft.commit, meta)
            except BaseException:
                await off_loop(draft.discard)
                raise
        return Taken(meta, copied[0] if copied else None, time.monotonic() - started)

    def _meta(
        self, session: Session, name: str, kind: str, snapshot_id: str | None, copied: CopyReport | None,
        state_bytes: int, report: dict[str, Any],
    ) -> SnapshotMeta:  # fmt: skip
        return SnapshotMeta(
            snapshot_id=snapshot_id or self.store.new_id(),
            client=session.options.client,
            name=name[:REPORT_TEXT],
            created=time.time(),
            kind=kind,
            source_session=session.session_id[:8],
            backend=self.backend.name,
            options=restore_options(session),
            workspace_bytes=copied.bytes if copied is not None else 0,
            state_bytes=state_bytes,
            state_report=report,
        )

    def resolve(self, seed: Seed) -> None:
        """Look `seed`'s snapshot up (a worker thread), before the new sandbox's dirs are made: a
        memory snapshot says whose uid they must be. Raises SnapshotNotFound, SnapshotError."""
        seed.meta = self.store.get(seed.client, seed.snapshot_id)
        if (needs := memory_key(seed.meta)) is not None:
            checkpointer = self.backend.checkpointer
            if checkpointer is None or needs != checkpointer.key():
                raise SnapshotError(
                    f"snapshot {seed.snapshot_id} is a gVisor memory snapshot and restores only on the gvisor "
                    "backend with the same runsc and sandbox image it was taken with; this server runs "
                    f"{self.backend.name}" + (" with another runsc or image" if checkpointer is not None else "")
                )
            image_dir, connection = self.store.memory_image(seed.client, seed.snapshot_id)
            owner = checkpointer.image_owner(image_dir)
            seed.memory = MemoryImage(image_dir, connection, owner)

    def plant(self, seed: Seed, dirs: SandboxDirs) -> None:
        """Fill a new sandbox's workspace from `seed` (after `resolve`) before any sandbox runs on it (a
        worker thread): the workspace files, planted start-up hooks moved aside."""
        if seed.meta is None:
            self.resolve(seed)
        if not seed.with_workspace:
            return
        try:
            with hostfs.dir_fd(dirs.workspace.path) as workspace_fd:
                cap = dirs.workspace.size_mb * 2**20 if dirs.workspace.size_mb is not None else None
                seed.workspace = self.store.restore_workspace(
                    seed.client, seed.snapshot_id, workspace_fd, dirs.owner, limit_bytes=cap
                )
            seed.startup = disable_startup_hooks(dirs.workspace.path).as_dict()
        except OSError as exc:
            raise _not_restored(seed, exc) from None

    def stage(self, seed: Seed, dirs: SandboxDirs) -> None:
        """Stage `seed`'s pickled state read-only in the sandbox's host dir (a worker thread). The host
        dir is host-only and bound read-only, so this may run while the sandbox starts: the sandbox
        can neither change the staged files nor enter their folder before it is complete."""
        try:
            self.store.stage_state(seed.client, seed.snapshot_id, dirs.host_fd, STAGED_STATE, dirs.owner)
        except OSError as exc:
            raise _not_restored(seed, exc) from None

    async def start(self, seed: Seed, session: Session) -> None:
        """Start `session`'s kernel from `seed` (after `plant`): a memory snapshot's is restored whole;
        else a fresh kernel starts while the state is staged (`stage`), for `load` to load next."""
        if seed.memory is not None:
            await session.restore_kernel(seed.memory.image_dir, seed.memory.connection)
            return
        await alongside(lambda: self.stage(seed, session.dirs), session.start_kernel)

    async def load(self, seed: Seed, session: Session) -> None:
        """Load the staged state into `session`'s fresh kernel, then drop the staged copy."""
        if seed.memory is not None:  # the kernel was restored whole (Session.restore_kernel)
            seed.loaded = {"restored": [MEMORY_CARRIES], "not_carried": MEMORY_NEVER}
            return
        inside = f"{self.backend.host_dir_inside(session.spec)}/{STAGED_STATE}"
        try:
            raw = await session.call_guest("snapshot", {"op": "load", "dir": inside}, self.settings.snapshot_timeout_s)
            seed.loaded = bounded_load_report(raw)
        finally:
            await off_loop(_drop_staged, session.dirs)

    async def save_on_close(self, session: Session) -> str | None:
        """A keep_state session is closing: save its kernel state as keep-<name> unless nothing ran
        since the last save (bounded). What happened, in words, or None when there was nothing to do."""
        if not session.options.keep_state or not session.kept.armed or session.options.name is None:
            return None
        if not session.kept.dirty(session.last_used):
            return session.kept.note or "kernel state unchanged since it was loaded"
        return await self.save_kept(session, wait_s=self.settings.interrupt_grace_s)

    async def save_kept(self, session: Session, wait_s: float) -> str:
        """Save a keep_state session's kernel state as keep-<name> (bounded); what happened, in words
        (also kept as the session's state_note). A failure keeps the last saved state."""
        assert session.options.name is not None
        kernel = session.kernel
        if kernel is None or not kernel.alive:
            return "kernel state not saved: the kernel was not running (the last saved state is kept)"
        try:
            with anyio.fail_after(self.settings.snapshot_timeout_s + 5):
                taken = await self.take(
                    session, kind=PERSISTENT, snapshot_id=keep_id(session.options.name), wait_s=wait_s
                )
        except TimeoutError:
            note = "kernel state not saved: saving took too long (the last saved state is kept)"
        except CodeRunnerError as exc:
            note = f"kernel state not saved: {exc} (the last saved state is kept)"
        except Exception:  # a bug: the session goes on, and the log has the traceback
            log.exception("session %s…: saving its kept state failed", session.session_id[:6])
            note = "kernel state not saved: an internal error (see the server log); the last saved state is kept"
        else:
            saved = report_count(taken.meta.state_report, "saved")
            size = taken.meta.state_bytes / 2**20
            when = time.strftime("%H:%M:%SZ", time.gmtime(taken.meta.created))
            note = f"kernel state saved at {when} ({saved} variables, {size:.1f} MiB); keep_state reopens it"
        # Saved or not, this state was tried: the next attempt waits for new work (no retry loop).
        session.kept.mark_saved(session.last_used, note)
        return note


def restore_options(session: Session) -> dict[str, Any]:
    """The options a restore starts from (no mounts, no name: those belong to the original)."""
    options = session.options
    return {
        "network": options.network,
        "allow": list(options.allow),
        "memory_mb": options.limits.memory_mb,
        "cpus": options.limits.cpus,
        "timeout_s": options.timeout_s,
    }


def _remove_state_dir(session: Session) -> None:
    """Remove WORKSPACE/.coderunner/snapshot, by fds, if the guest left it (links never followed)."""
    parent, _, name = STATE_IN_WORKSPACE.rpartition("/")
    with contextlib.suppress(OSError), hostfs.dir_fd(session.workspace.path) as workspace_fd:
        parent_fd = hostfs.open_dir(parent, dir_fd=workspace_fd)
        try:
            hostfs.remove_tree(parent_fd, name)
        finally:
            os.close(parent_fd)


def _not_restored(seed: Seed, exc: OSError) -> SnapshotError:
    return SnapshotError(
        f"could not restore snapshot {seed.snapshot_id}: {exc.strerror or exc} (the snapshot is unchanged)"
    )


def _drop_staged(dirs: SandboxDirs) -> None:
    """Remove the staged state from the host-only host/ dir: its folder is made writable again first
    (it is 0500 so that the sandbox user, its owner, cannot change it; a server that is not root
    needs the write bit back to empty it)."""
    with contextlib.suppress(FileNotFoundError):
        folder = hostfs.open_dir(STAGED_STATE, dir_fd=dirs.host_fd)
        try:
            os.fchmod(folder, 0o700)
        finally:
            os.close(folder)
    hostfs.remove_tree(dirs.host_fd, STAGED_STATE)
