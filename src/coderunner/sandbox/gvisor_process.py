"""A running gvisor sandbox as the host sees it: `runsc run` (or `runsc restore`) of one container,
whose kill deletes the container and releases its root file system and cgroup.

`RunscBackend` is what it and the checkpointer (gvisor_checkpoint.py) use of the backend that makes
them (gvisor.py's GvisorBackend), so that neither imports gvisor.py back.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Protocol

import anyio
from anyio.abc import Process, TaskGroup

from coderunner.sandbox.base import SandboxProcess, SandboxSpec
from coderunner.sandbox.engine import REMOVE_TIMEOUT_S
from coderunner.sandbox.gvisor_instances import container_cgroup
from coderunner.sandbox.runsc import Runsc

#: Bound on a runsc kill or state call.
RUNSC_CALL_S = 20.0


class RunscBackend(Protocol):
    """The gvisor backend as its processes and checkpointer use it (gvisor.py GvisorBackend)."""

    @property
    def name(self) -> str: ...
    @property
    def runsc(self) -> Runsc: ...
    @property
    def runsc_version(self) -> str: ...
    @property
    def image_id(self) -> str: ...
    async def call(self, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str] | None: ...
    def release(self, container: str, top: Path | None = None) -> None: ...
    def ids(self, spec: SandboxSpec | None) -> tuple[int, int]: ...
    def network_problem(self, network: str) -> str | None: ...
    async def launch(
        self, spec: SandboxSpec, inner: list[str], task_group: TaskGroup, *, pipes: bool, image_dir: Path | None
    ) -> GvisorProcess: ...


class GvisorProcess(SandboxProcess):
    """`runsc run` (or `runsc restore`) of one container; kill() deletes the container and its rootfs."""

    def __init__(
        self, process: Process, task_group: TaskGroup, backend: RunscBackend, container: str, spec: SandboxSpec,
        *, pipes: bool,
    ) -> None:  # fmt: skip
        super().__init__(process, task_group, cgroup=container_cgroup(container), pipes=pipes)
        self.backend = backend
        self.container = container
        self.spec = spec
        #: The relay's generation last seen (RELAY_STATE's n).
        self.relay_generation = 0
        self._released = False

    def take_cgroup(self) -> None:
        """Never handed out: kill() kills through it (runsc's own teardown may be slow) and release() removes it."""
        return None

    async def _kill(self) -> None:
        """Kill and delete the container (bounded; kill() shields it), reap runsc, release the rootfs and cgroup."""
        runsc = self.backend.runsc
        if self.alive:  # first: `runsc run` then returns (a delete alone leaves it waiting)
            await self.backend.call(runsc.kill(self.container, "KILL"), RUNSC_CALL_S)
        # The Sentry, its gofer and ptrace stubs, at once: runsc's own teardown of a ptrace sandbox can
        # take seconds (a server's shutdown has about two), and its delete waits for it.
        if self.cgroup is not None:
            self.cgroup.kill_all()
        deleted = await self.backend.call(runsc.delete(self.container), REMOVE_TIMEOUT_S)
        # SIGKILL runsc's process group and reap it. The cgroup goes in release(), in a thread: its
        # removal waits for the last tasks to leave, which must not block the event loop.
        cgroup, self.cgroup = self.cgroup, None
        try:
            await super()._kill()
        finally:
            self.cgroup = cgroup
        if not self._released:
            self._released = True
            if deleted is None or deleted.returncode != 0:
                # A runsc killed half-way through creating may have made it only now.
                await self.backend.call(runsc.delete(self.container), REMOVE_TIMEOUT_S)
            await anyio.to_thread.run_sync(self.backend.release, self.container)
