"""gVisor's checkpointer: a live sandbox saved whole by `runsc checkpoint`, and a copy started from
the image by `runsc restore`, in another session's dirs if need be (the paths inside are fixed).

A kernel runs behind the channel relay (guest/channel_relay.py, the container's init): it binds the
kernel's channels as host sockets in the run dir, drops them on SIGUSR1 and binds them again on
SIGUSR2, reporting in RELAY_STATE. A sandbox holding no host socket can be checkpointed (this runsc
panics saving a bound host socket: "Cannot save endpoint with bound host socket").
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from pathlib import Path

import anyio
from anyio.abc import TaskGroup

from coderunner.hostfs import dirfd as hostfs
from coderunner.sandbox.base import (
    KILL_WAIT_S,
    Checkpointer,
    SandboxProcess,
    SandboxSpec,
    SandboxUnavailable,
    start_failures,
)
from coderunner.sandbox.common import RELAY_STATE, RELAY_STATE_MAX_BYTES
from coderunner.sandbox.gvisor_process import RUNSC_CALL_S, GvisorProcess, RunscBackend
from coderunner.sandbox.runsc import inner_argv, parse_relay_state, short_reason

#: Bounds: the relay's answer to USR1/USR2, and its polling; runsc state's polling on restore.
RELAY_WAIT_S = 30.0
RELAY_POLL_S = 0.01
STATE_POLL_S = 0.05
#: Beside runsc's image in a checkpoint's dir: the host uid/gid its processes keep (checkpoint_owner).
OWNER_FILE = "coderunner-owner.json"
#: The relay's host-visible sockets in the run dir: jupyter's ipc naming, <ip basename>-<port>.
RELAY_SOCKET = re.compile(r"k[0-9]{1,9}-[0-9]{1,5}")


class CheckpointError(SandboxUnavailable):
    """A checkpoint or restore did not work; the message says what runsc or the relay said."""


def write_owner(image_dir: Path, ids: tuple[int, int]) -> None:
    """Beside runsc's image: the host uid and gid its processes run as (they keep them when restored)."""
    with hostfs.dir_fd(image_dir) as folder:
        hostfs.write_new_file(folder, OWNER_FILE, json.dumps({"uid": ids[0], "gid": ids[1]}).encode(), mode=0o600)


def checkpoint_owner(image_dir: Path) -> tuple[int, int] | None:
    """The host uid and gid a checkpoint's processes run as (and keep when restored): a restore must
    give the new sandbox the same (SandboxSpec.user). None for an image without the note."""
    try:
        with hostfs.dir_fd(image_dir) as folder:
            fd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
            with open(fd, "rb") as handle:
                data = json.loads(handle.read(4096))
        return int(data["uid"]), int(data["gid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_relay_state(run_dir: Path) -> tuple[str, int] | None:
    """What the relay says in the (sandbox-writable) run dir: read by the dir's fd, never a link, a
    FIFO or a big file; None when there is nothing (yet) or nothing valid."""
    try:
        with hostfs.dir_fd(run_dir) as folder:
            fd = os.open(RELAY_STATE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, RELAY_STATE_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse_relay_state(data) if len(data) <= RELAY_STATE_MAX_BYTES else None


def clear_relay_sockets(run_dir: Path) -> int:
    """Unlink the relay's closed sockets (k<gen>-<port>) still in the run dir, by its fd, before it is
    told to bind again: gVisor refuses the relay an unlink of a host socket (EPERM), and a bind fails
    while the path is there. The host claims only some channels (kernel.HOST_CHANNELS); the rest stay.
    Only sockets go (a name the sandbox swapped for something else is left alone)."""
    removed = 0
    with contextlib.suppress(OSError), hostfs.dir_fd(run_dir) as folder:
        for name in hostfs.entries(folder):
            if not RELAY_SOCKET.fullmatch(name):
                continue
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=folder)
                    removed += 1
    return removed


async def wait_relay(run_dir: Path, word: str, after: int, timeout_s: float, process: SandboxProcess) -> int:
    """Wait for the relay to say "<word> n" with n > after; the n. Raises CheckpointError."""
    with anyio.move_on_after(timeout_s):
        while process.alive:
            found = read_relay_state(run_dir)
            if found is not None and found[1] > after:
                if found[0] == word:
                    return found[1]
                if found[0] == "failed":
                    raise CheckpointError(
                        f"the sandbox's channel relay failed to {'bind' if word == 'open' else 'close'} its sockets"
                    )
            await anyio.sleep(RELAY_POLL_S)
        raise CheckpointError(f"the sandbox ended before its channel relay reported {word!r}")
    raise CheckpointError(f"the sandbox's channel relay did not report {word!r} within {timeout_s:g} s")


class GvisorCheckpointer(Checkpointer):
    """Checkpoints of one gvisor backend's sandboxes (its runsc, image and uids)."""

    def __init__(self, backend: RunscBackend) -> None:
        self.backend = backend

    def key(self) -> str:
        """What a checkpoint depends on: image id, runsc version, runsc flags (a restore needs the same)."""
        backend = self.backend
        return f"runsc {backend.runsc_version} [{' '.join(backend.runsc.flags)}] image {backend.image_id[:19]}"

    def image_owner(self, image_dir: Path) -> tuple[int, int] | None:
        return checkpoint_owner(image_dir)

    async def checkpoint(self, process: SandboxProcess, image_dir: Path, timeout_s: float) -> None:
        """Quiesce the relay (USR1, 'closed n'), `runsc checkpoint` into image_dir (an empty host-only
        dir), then delete the container and release its rootfs: `process` has ended afterwards.

        Quiescing failed: the relay is told to bind again and the sandbox runs on (CheckpointError).
        runsc failed: the sandbox is gone (killed fully; CheckpointError with runsc's reason)."""
        assert isinstance(process, GvisorProcess), "not a gvisor sandbox"
        run_dir = process.spec.runtime_dir
        found = read_relay_state(run_dir)
        before = found[1] if found else process.relay_generation
        try:
            said = await self.backend.call(self.backend.runsc.kill(process.container, "USR1"), RUNSC_CALL_S)
            if said is None or said.returncode != 0:
                raise CheckpointError(f"could not signal the sandbox: {short_reason(said.stderr if said else '')}")
            wait_s = min(timeout_s, RELAY_WAIT_S)
            process.relay_generation = await wait_relay(run_dir, "closed", before, wait_s, process)
        except BaseException:  # refused, or cancelled while quiescing: the relay binds again
            with anyio.CancelScope(shield=True):
                if process.alive:
                    await anyio.to_thread.run_sync(clear_relay_sockets, run_dir)
                    await self.backend.call(self.backend.runsc.kill(process.container, "USR2"), RUNSC_CALL_S)
            raise
        # From here every step is bounded and runs to its end: a half-done checkpoint owns a stopped sandbox.
        with anyio.CancelScope(shield=True):
            done = await self.backend.call(self.backend.runsc.checkpoint(image_dir, process.container), timeout_s)
            if done is None or done.returncode != 0:
                await process.kill()
                reason = short_reason(done.stderr) if done else f"it did not finish within {timeout_s:g} s"
                raise CheckpointError(f"runsc could not checkpoint the sandbox: {reason}")
            with anyio.move_on_after(KILL_WAIT_S):
                await process.wait()  # runsc run returns once its container has stopped
            await process.kill()
            await anyio.to_thread.run_sync(write_owner, image_dir, self.backend.ids(process.spec))

    async def restore(
        self, spec: SandboxSpec, image_dir: Path, task_group: TaskGroup, timeout_s: float
    ) -> SandboxProcess:
        """A new container from `spec` started by `runsc restore --image-path image_dir`; then USR2 and
        wait for 'open n': the relay has bound the kernel's sockets again in spec.runtime_dir.
        Raises CheckpointError (with runsc's reason) and leaves nothing running on failure."""
        problem = self.backend.network_problem(spec.network)
        if problem:
            raise CheckpointError(problem)
        owner = await anyio.to_thread.run_sync(checkpoint_owner, image_dir)
        if owner is not None and owner != self.backend.ids(spec):
            # The restored processes keep the uid they had (it is in the image): in dirs owned by another
            # uid they could not write their run dir nor their workspace.
            raise CheckpointError(
                f"this checkpoint's sandbox ran as host uid {owner[0]}, the new one would run as uid "
                f"{self.backend.ids(spec)[0]}: restore it into a sandbox of the same uid"
            )
        # The argv is in the image; the config needs one (runsc takes the restored process's).
        inner = inner_argv(spec, ["/bin/true"], pipes=False)
        try:
            with start_failures(self.backend.name):
                process = await self.backend.launch(spec, inner, task_group, pipes=False, image_dir=image_dir)
        except SandboxUnavailable as exc:
            raise CheckpointError(str(exc)) from None
        try:
            with anyio.fail_after(timeout_s):
                await self._await_running(process)
                found = read_relay_state(spec.runtime_dir)
                before = found[1] if found else 0
                await anyio.to_thread.run_sync(clear_relay_sockets, spec.runtime_dir)
                said = await self.backend.call(self.backend.runsc.kill(process.container, "USR2"), RUNSC_CALL_S)
                if said is None or said.returncode != 0:
                    raise CheckpointError(
                        f"could not signal the restored sandbox: {short_reason(said.stderr if said else '')}"
                    )
                process.relay_generation = await wait_relay(spec.runtime_dir, "open", before, timeout_s, process)
        except (CheckpointError, TimeoutError) as exc:
            with anyio.CancelScope(shield=True):
                tail = await process.stderr_settled() if not process.alive else process.stderr_tail()
                await process.kill()
            reason = short_reason(tail) if tail.strip() else str(exc) or f"not running within {timeout_s:g} s"
            raise CheckpointError(f"runsc could not restore the sandbox: {reason}") from None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await process.kill()
            raise
        return process

    async def _await_running(self, process: GvisorProcess) -> None:
        while True:
            if not process.alive:
                raise CheckpointError("runsc restore ended")
            done = await self.backend.call(self.backend.runsc.state(process.container), RUNSC_CALL_S)
            if done is not None and done.returncode == 0:
                with contextlib.suppress(ValueError):
                    if json.loads(done.stdout).get("status") == "running":
                        return
            await anyio.sleep(STATE_POLL_S)
