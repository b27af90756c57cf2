"""A one-shot sandbox started ahead: its interpreter up and waiting for its program (guest `wait`).

A run with the same options as the last one skips the start by taking it. Each is used once;
unused for READY_IDLE_S, it is dropped. Allowlist runs never get one: their proxy is made per run.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Literal

import anyio
from anyio.abc import TaskGroup

from coderunner.egress.ceiling import NetworkMode
from coderunner.sandbox import SandboxBackend, SandboxProcess
from coderunner.sandbox.common import product_python
from coderunner.sessions.leases import SandboxLease, SandboxLeases
from coderunner.sessions.oneshot_program import LAUNCHER
from coderunner.sessions.sandbox_options import SandboxOptions

log = logging.getLogger(__name__)

#: A sandbox started ahead is dropped when no run took it this long.
READY_IDLE_S = 60.0
#: How long a run waits for the sandbox being started ahead for it, before starting its own.
READY_WAIT_S = 5.0
#: Bound on a sandbox started ahead saying it is up, and what it says (guest oneshot.READY).
READY_START_S = 30.0
READY_BYTE = b"R"


def ready_key(options: SandboxOptions) -> SandboxOptions:
    """What a sandbox started ahead must match: everything but the timeout (the host keeps that)."""
    return dataclasses.replace(options, timeout_s=0.0)


@dataclass(eq=False)
class ReadySandbox:
    """A throwaway sandbox started ahead for runs with `key` options: used by one run, or dropped.

    Its keeper task owns it while `state` is preparing or ready; a run that sets it to taken
    (no await between the check and the change) owns it from then on.
    """

    key: SandboxOptions
    done: anyio.Event = field(default_factory=anyio.Event)
    #: Set when a run took it or it was dropped: the keeper stops waiting.
    released: anyio.Event = field(default_factory=anyio.Event)
    state: Literal["preparing", "ready", "taken", "gone"] = "preparing"
    #: Its dirs and mounts (no egress: never an allowlist run's).
    lease: SandboxLease | None = None
    process: SandboxProcess | None = None


@dataclass
class ReadySandboxes:
    """Keeps at most one sandbox started ahead, for the options of the last run."""

    backend: SandboxBackend
    task_group: TaskGroup
    leases: SandboxLeases
    _next: ReadySandbox | None = None

    async def take(self, options: SandboxOptions) -> ReadySandbox | None:
        """The sandbox started ahead for these options, waited for (bounded) if still starting; else None."""
        entry = self._next
        if entry is None or entry.key != ready_key(options):
            return None
        with anyio.move_on_after(READY_WAIT_S):
            await entry.done.wait()
        if entry.state != "ready":
            return None
        entry.state = "taken"
        if self._next is entry:
            self._next = None
        entry.released.set()
        assert entry.process is not None
        if not entry.process.alive:
            with anyio.CancelScope(shield=True):
                await self._drop(entry)
            return None
        return entry

    def start_ahead(self, options: SandboxOptions) -> None:
        """Have a sandbox for the next run with these options start now (the previous one is dropped)."""
        if options.network == NetworkMode.ALLOWLIST:
            return  # its proxy is made per run, with the run (a sandbox started ahead would have none)
        key = ready_key(options)
        current = self._next
        if current is not None and current.key == key and current.state in ("preparing", "ready"):
            return
        if current is not None:
            self._next = None
            current.released.set()  # its keeper drops it
        entry = ReadySandbox(key)
        self._next = entry
        self.task_group.start_soon(self._keep, entry)

    async def _keep(self, entry: ReadySandbox) -> None:
        """Start `entry`'s sandbox, then keep it until a run takes it, it is replaced, or READY_IDLE_S pass."""
        options = entry.key
        try:
            try:
                entry.lease = lease = await self.leases.lease(options, throwaway=True)
                await lease.mount()
                argv = product_python(self.backend.python, "-c", LAUNCHER, "wait", str(lease.dirs.host_dir),
                                      str(options.limits.memory_mb or 0))  # fmt: skip
                entry.process = await self.backend.spawn(lease.spec(), argv, self.task_group, pipes=True)
                # Ready once its interpreter is up and says so (the first byte of its stdout, never the program's).
                with anyio.fail_after(READY_START_S):
                    said = await entry.process.streams[1].receive(1)
                if said == READY_BYTE and self._next is entry:
                    entry.state = "ready"
            except Exception as exc:  # a run then starts its own sandbox, and says why if it fails too
                log.info("could not start a one-shot sandbox ahead: %s", exc)
            finally:
                entry.done.set()
            if entry.state == "ready":
                with anyio.move_on_after(READY_IDLE_S):
                    await entry.released.wait()
        finally:
            if entry.state != "taken":
                entry.state = "gone"
                if self._next is entry:
                    self._next = None
                with anyio.CancelScope(shield=True):
                    await self._drop(entry)

    @staticmethod
    async def _drop(entry: ReadySandbox) -> None:
        if entry.process is not None:
            await entry.process.kill()
        if entry.lease is not None:
            await entry.lease.close()
