"""The host's side of an Apple VM's readiness: the guest marks its kernel ready in a share of the
sandbox's run dir, which the host looks into by fd (the share is the sandbox's to write)."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import anyio

from coderunner.hostfs import dirfd as hostfs
from coderunner.sandbox.base import SandboxProcess
from coderunner.sandbox.container import ContainerUnavailable

#: On the host: that share, a dir in the sandbox's run/ dir (which the VM does not otherwise see).
STATE_DIR = "vm"
READY_POLL_S = 0.02


class GuestReady:
    """The host's side of the guest's readiness marker: a share in run/ the VM writes to.

    `--publish-socket` creates the host-side socket files as the VM starts, before the kernel
    binds, so they say nothing; the guest creates `<container>.ready` once its sockets are
    bound (vm_init), and spawn waits for that, bounded. The share is the sandbox's to write:
    the host only looks for one name in it through a dir fd, without following links.
    """

    def __init__(self, run_dir: Path, name: str, owner: tuple[int, int] | None = None) -> None:
        self.path = run_dir / STATE_DIR
        self.name = name
        #: Host (uid, gid) the guest writes as, when not the server's own (a root server's sandbox user).
        self.owner = owner
        self._fd: int | None = None

    def __enter__(self) -> GuestReady:
        uid = self.owner[0] if self.owner else os.getuid()
        with hostfs.dir_fd(self.path.parent) as run_fd:
            with contextlib.suppress(FileExistsError):
                os.mkdir(STATE_DIR, 0o700, dir_fd=run_fd)
            fd = os.open(STATE_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=run_fd)
        if self.owner and os.fstat(fd).st_uid == os.getuid():
            os.fchown(fd, *self.owner)
        if os.fstat(fd).st_uid != uid:
            os.close(fd)
            raise ContainerUnavailable(f"{self.path} is not the sandbox's own: remove it")
        # Writable whatever uid the guest's user appears as through virtiofs; run/ above it is
        # private to the host, so nobody else reaches it.
        os.fchmod(fd, 0o777)
        self._fd = fd
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.name, dir_fd=self._fd)
            os.close(self._fd)
            self._fd = None

    def marked(self) -> bool:
        assert self._fd is not None
        try:
            found = os.stat(self.name, dir_fd=self._fd, follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISREG(found.st_mode)

    async def wait(self, sandbox: SandboxProcess, timeout_s: float) -> None:
        """Until the marker is there or the VM has exited (the kernel's start then reports why)."""
        with anyio.move_on_after(timeout_s):
            while sandbox.alive and not self.marked():
                await anyio.sleep(READY_POLL_S)
            return
        raise ContainerUnavailable(
            f"the kernel in the VM did not bind its sockets within {timeout_s:g}s (`container logs` may say why)"
        )
