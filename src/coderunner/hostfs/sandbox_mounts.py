"""What one sandbox sees of the host besides its workspace: its mounts and its export outbox.

Made per sandbox (session or one-shot run) in a host-only dir of its own: on a root server every
configured mount is staged there (see staging.py), id-mapped to the sandbox's host user where
the kernel can, and the outbox is a folder of the workspace staged by fd. A server that is not
root binds configured folders by path (they are the user's own) and gives the outbox a fresh
host-private folder. `close()` detaches every staged point; a dead server's are detached by
`release_mounts()` before its dirs are deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from coderunner.hostfs import dirfd as hostfs
from coderunner.hostfs import staging
from coderunner.hostfs.exports import WORKSPACE_OUTBOX, Exporter, ExportReport
from coderunner.vocabulary.mounts import Mount

log = logging.getLogger(__name__)

#: Under a sandbox's host-only dir: staged mount points, and (not root) the outbox.
STAGING_DIR = "mnt"
OUTBOX_DIR = "outbox"
#: Under the runtime dir, one per root server process (`.live-<token>`, a mount of its own, with a lock file
#: `.live-<token>.lock` it holds while it lives): its clones, for one start each, of what a sandbox is built from
#: (`<key>-<token>/<n>`, sandbox/start_namespace.py), detached once bwrap has built the sandbox.
START_CLONES_PREFIX = ".live-"
LOCK_SUFFIX = ".lock"


class MountsError(RuntimeError):
    """The sandbox's mounts could not be prepared; the message says why."""


@dataclass(frozen=True)
class ExportPlan:
    """Where a sandbox's export mount appears, and where its files go on the host."""

    mount: str
    target: Path
    limit_bytes: int
    owner: tuple[int, int] | None


@dataclass
class SandboxMounts:
    mounts: tuple[Mount, ...]
    staged_dir: Path | None = None
    exporter: Exporter | None = None
    export_mount: str | None = None
    #: The same folders as the host's file tools reach them: configured folders by their own path
    #: (an id-mapped mount refuses a writer it cannot map, root included), the outbox as staged.
    host_view: tuple[Mount, ...] = ()
    #: Sandbox path -> the owner of an id-mapped folder: what the file tools create there is theirs.
    owners: dict[str, tuple[int, int]] = field(default_factory=dict)

    def export(self) -> ExportReport | None:
        return self.exporter.export() if self.exporter is not None else None

    def nothing_to_export(self) -> bool:
        """No exporter, or an outbox with no entry (export() would copy nothing): no worker thread needed."""
        return self.exporter is None or self.exporter.outbox_empty()

    def note(self, report: ExportReport | None) -> str | None:
        return report.note(self.export_mount or "") if report is not None else None

    def close(self) -> bool:
        """Detach what was staged; True when nothing is left mounted (the dir may then be deleted)."""
        if self.staged_dir is None:
            return True
        done = staging.release_all(self.staged_dir)
        if done:
            self.staged_dir = None
        return done


def prepare_mounts(
    configured: tuple[Mount, ...],
    host_dir: Path,
    workspace: Path,
    owner: tuple[int, int] | None,
    export: ExportPlan | None,
    *,
    fresh_workspace: bool = True,
) -> SandboxMounts:
    """Stage `configured` (root) and make the outbox; raises MountsError with the reason."""
    root = staging.available()
    plan = SandboxMounts(mounts=())
    mounts: list[Mount] = []
    view: list[Mount] = list(configured)
    try:
        if root and (configured or export):
            plan.staged_dir = host_dir / STAGING_DIR
            _passable_dir(plan.staged_dir)
        for index, mount in enumerate(configured):
            if not root:
                mounts.append(mount)
                continue
            mounts.append(_stage_configured(mount, plan, index, owner))
        if export is not None:
            outbox = _outbox(plan, host_dir, workspace, owner, root)
            mounts.append(Mount(outbox, export.mount, writable=True))
            view.append(mounts[-1])
            plan.exporter = Exporter(outbox, export.target, export.limit_bytes, export.owner)
            plan.export_mount = export.mount
            if not fresh_workspace:
                plan.exporter.baseline()
    except BaseException:
        plan.close()
        raise
    plan.mounts = tuple(mounts)
    plan.host_view = tuple(view)
    return plan


def _passable_dir(path: Path) -> None:
    """A fresh host-only folder the sandbox user may pass through (0711 whatever the umask: the backend
    binds what is staged in it as that user, who could not reach it at 0700)."""
    with hostfs.dir_fd(path.parent) as parent:
        os.close(hostfs.make_private_dir(parent, path.name, 0o711))


def _stage_configured(mount: Mount, plan: SandboxMounts, index: int, owner: tuple[int, int] | None) -> Mount:
    assert plan.staged_dir is not None
    point = plan.staged_dir / str(index)
    _passable_dir(point)
    try:
        fd = staging.open_folder(mount.host)
    except OSError as exc:
        raise MountsError(f"mount source {mount.host} cannot be opened: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        idmap = None
        if owner is not None and (info.st_uid, info.st_gid) != owner:
            if mount.writable and info.st_uid == 0:
                raise MountsError(
                    f"{mount.host} belongs to root: a writable mount would let sandboxed code create root-owned "
                    "files there; mount it ro, or use a folder owned by an ordinary user"
                )
            idmap = staging.IdMap(owner=(info.st_uid, info.st_gid), sandbox=owner)
        try:
            mapped = staging.stage(fd, point, read_only=not mount.writable, idmap=idmap)
        except staging.StagingError as exc:
            raise MountsError(f"mount {mount.host} could not be staged for the sandbox: {exc.strerror}") from None
    finally:
        os.close(fd)
    if mapped and idmap is not None:
        plan.owners[mount.sandbox] = idmap.owner
    return Mount(point, mount.sandbox, mount.writable)


def _outbox(plan: SandboxMounts, host_dir: Path, workspace: Path, owner: tuple[int, int] | None,
            root: bool) -> Path:  # fmt: skip
    """The sandbox's export folder: in its workspace, staged (root); else a host-private folder."""
    if root:
        assert plan.staged_dir is not None
        fd = _workspace_outbox(workspace, owner)
        if fd is not None:
            point = plan.staged_dir / "outputs"
            _passable_dir(point)
            try:
                staging.stage(fd, point, read_only=False)
                return point
            except staging.StagingError as exc:
                log.warning("could not stage the outbox in %s (%s); using a separate folder", workspace, exc)
                point.rmdir()
            finally:
                os.close(fd)
    outbox = host_dir / OUTBOX_DIR
    outbox.mkdir(mode=0o700)
    if owner is not None:
        os.chown(outbox, *owner, follow_symlinks=False)
    return outbox


def _workspace_outbox(workspace: Path, owner: tuple[int, int] | None) -> int | None:
    """An fd of workspace/.coderunner/outputs, made or found without following a link; None if the
    sandbox left something else there (a link, a file): then a separate folder is used."""
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in WORKSPACE_OUTBOX:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
            try:
                next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError:
                return None
            os.close(fd)
            fd = next_fd
            info = os.fstat(fd)
            if not stat.S_ISDIR(info.st_mode):
                return None
            if owner is not None and info.st_uid == 0:
                os.fchown(fd, *owner)
        result, fd = fd, -1
        return result
    finally:
        if fd >= 0:
            os.close(fd)


def release_mounts(host_dir: Path) -> bool:
    """Detach what a (possibly dead) server staged in a sandbox's host-only dir; True if none is left."""
    return staging.release_all(host_dir / STAGING_DIR)


def sweep_dead_start_clones(runtime_base: Path) -> None:
    """Detach and remove the start clones dir of every server process that is gone (its lock is free), with
    the clones of the starts it died in: before a dead sandbox's workspace is removed, which they would pin."""
    try:
        names = os.listdir(runtime_base)
    except OSError:
        return
    for name in names:
        if not name.startswith(START_CLONES_PREFIX) or name.endswith(LOCK_SUFFIX):
            continue
        try:
            if not stat.S_ISDIR(os.lstat(runtime_base / name).st_mode):
                continue  # only a server makes these, as a dir: anything else is no clones dir to detach under
        except OSError:
            continue
        lock_path = runtime_base / (name + LOCK_SUFFIX)
        try:
            lock = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            lock = -1  # its server died between making the dir and its lock, or its sweep was cut short
        except OSError:
            continue
        try:
            if lock >= 0:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # its server lives
            release_start_clones(runtime_base / name, lock_path)
        finally:
            if lock >= 0:
                os.close(lock)


def release_start_clones(clones: Path, lock_path: Path) -> bool:
    """Detach every start's clones in `clones`, then `clones` itself; remove it and its lock once all went."""
    clean = True
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for name in os.listdir(clones):
            clean = staging.release_all(clones / name) and clean
    if clean and staging.detach(clones):
        with contextlib.suppress(OSError):
            os.rmdir(clones)
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        return True
    return False
