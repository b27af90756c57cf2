"""What the container backends (podman/docker and Apple `container`) share.

A sandbox is one container per kernel, run attached (`ENGINE run --rm ...` in the foreground),
so the host has a process to wait on; killing that client does not stop the container, so a
`ContainerProcess` also removes the container by name, with a timeout, when it is killed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process, TaskGroup

from coderunner.hostfs import dirfd as hostfs
from coderunner.sandbox.base import SandboxProcess, SandboxSpec, SandboxUnavailable
from coderunner.sandbox.engine import REMOVE_TIMEOUT_S, EngineError, run_async

log = logging.getLogger(__name__)

#: Labels every container carries, so a later server can find what a crashed one left.
LABEL_SESSION = "coderunner.session"
LABEL_SERVER = "coderunner.server"
#: One server process (random per backend instance): what its watcher removes when it dies.
LABEL_INSTANCE = "coderunner.instance"
NAME_PREFIX = "coderunner"
#: Bound on letting an engine finish making a container before its client is killed (ContainerProcess._kill).
CREATE_SETTLE_S = 15.0
#: The five ZMQ channels of a kernel, as named in a connection file.
CHANNELS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


class ContainerUnavailable(SandboxUnavailable):
    """The engine or the image is missing, or cannot run here; the message says how to fix it."""


def server_tag(runtime_base: Path) -> str:
    """A short stable tag for one server configuration (its runtime dir), shared by its restarts."""
    return hashlib.sha256(str(runtime_base).encode()).hexdigest()[:8]


def session_key(spec: SandboxSpec) -> str:
    """The sandbox's key (its runtime dir's name, as SandboxSpec.name): what remove_stale gets for dead ones.

    Taken from the spec, not from the runtime dir's path, so that only session_dirs.py knows the layout.
    """
    return spec.name


def container_name(tag: str, session: str) -> str:
    """Unique per kernel (a restart may overlap the old container's removal), findable by prefix."""
    return f"{NAME_PREFIX}-{tag}-{session}-{secrets.token_hex(3)}"


def name_prefix(tag: str, session: str | None = None) -> str:
    return f"{NAME_PREFIX}-{tag}-" + (f"{session}-" if session else "")


def connection_info(argv: list[str]) -> dict[str, Any]:
    """The kernel's connection file, found after `-f` in its command (written by the host)."""
    try:
        path = argv[argv.index("-f") + 1]
    except (ValueError, IndexError):
        raise ContainerUnavailable("the kernel command names no connection file (-f)") from None
    return json.loads(Path(path).read_text())


def channel_ports(info: dict[str, Any]) -> list[int]:
    return [int(info[name]) for name in CHANNELS if name in info]


def with_guest_connection(argv: list[str], ip: str, guest_dir: str | None = None) -> list[str]:
    """The kernel command reading a copy of its connection file with the address as seen inside.

    ipykernel takes `ip` from the connection file over its command line, so a kernel that must
    bind elsewhere than the host connects (0.0.0.0 behind published ports, a socket path on the
    VM's own disk) gets its own file next to the host's. `guest_dir` is where the VM sees that dir.
    """
    index = argv.index("-f") + 1
    host_file = Path(argv[index])  # in the session's host-only dir (session_dirs.py)
    with hostfs.dir_fd(host_file.parent) as folder:
        with open(os.open(host_file.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)) as handle:
            info = json.load(handle)
            stat = os.fstat(handle.fileno())
        guest_file = host_file.with_name(host_file.stem + ".guest.json")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(guest_file.name, dir_fd=folder)
        owner = (stat.st_uid, stat.st_gid) if os.getuid() == 0 else None
        hostfs.write_new_file(folder, guest_file.name, json.dumps({**info, "ip": ip}).encode(),
                              mode=stat.st_mode & 0o777, owner=owner)  # fmt: skip
    inner = list(argv)
    inner[index] = f"{guest_dir}/{guest_file.name}" if guest_dir else str(guest_file)
    return inner


class ContainerProcess(SandboxProcess):
    """The attached engine client of one container; kill() also removes the container itself."""

    def __init__(
        self,
        process: Process,
        task_group: TaskGroup,
        cleanup: list[list[str]],
        engine_env: dict[str, str],
        pipes: bool = False,
        inspect_pid: list[str] | None = None,
    ) -> None:
        super().__init__(process, task_group, pipes=pipes)
        self.cleanup = cleanup
        self._engine_env = engine_env
        #: The engine command that prints the container's host pid (podman/docker on Linux): see _kill.
        self._inspect_pid = inspect_pid
        #: The container's init as a host pid, where the engine shares the host kernel.
        self.container_pid: int | None = None

    @property
    def pid(self) -> int:
        """For memory accounting: the container's process tree, not the client's."""
        return self.container_pid or super().pid

    async def _kill(self) -> None:
        """Kill and reap the client, then remove the container (bounded).

        In that order: a client killed while it still creates the container (a start cancelled at once)
        may leave the container made but never started; a removal before the kill found nothing yet, and
        that container was left behind (seen: podman containers in state Created from the `container`
        stand-in, one per suite run). The container itself goes on running without its client until removed.

        Nor while its engine creates it: podman's client killed then (a start cancelled 0.15 s in) let the removal
        find the container not yet made and forget it, and the monitor (conmon) went on to make it, its init left
        waiting for a start that never came, for ever and unknown to the engine. So a client whose container is
        not running yet is given until it runs (bounded: CREATE_SETTLE_S) before it is killed."""
        if self._inspect_pid is not None and self.container_pid is None and self.returncode is None:
            await self.watch_pid(self._inspect_pid, timeout_s=CREATE_SETTLE_S)
        await super()._kill()
        for argv in self.cleanup:
            try:
                await run_async(argv, REMOVE_TIMEOUT_S, check=False, env=self._engine_env)
            except EngineError as exc:
                log.warning("container cleanup: %s", exc)

    async def watch_pid(self, inspect_argv: list[str], timeout_s: float = 15.0) -> bool:
        """Wait until the container runs and learn its host pid (podman/docker on Linux only).

        True once it runs; False if the client exited first, or after `timeout_s`.
        """
        with anyio.move_on_after(timeout_s), contextlib.suppress(EngineError):
            while self.alive and self.container_pid is None:
                done = await run_async(inspect_argv, 5.0, check=False, env=self._engine_env)
                with contextlib.suppress(ValueError):
                    pid = int(done.stdout.strip() or 0)
                    if pid > 0:
                        self.container_pid = pid
                        return True
                await anyio.sleep(0.02)
        return self.container_pid is not None
