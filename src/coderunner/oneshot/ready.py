"""One-shot sandboxes started ahead: bash and the Python launcher up, waiting for the program (READY_WAITER).

After a run, a sandbox with the same options starts for the next one (one per option set, for the
`most` sets used last); a run with those options skips the start by taking it. The rules that keep
this safe, as the warm pool's (sessions/pool.py):
- each is used by one run, or dropped: never reused, never handed back;
- it holds only room the manager grants (`room`): under max_sessions beside the sessions and the
  pool, and within the idle sandboxes' memory budget. A user's session takes the room back at once
  (evict_one), and nothing here ever makes a create or a run fail or wait longer than its own start;
- unused for READY_IDLE_S, replaced by a more recent option set, or drained, it is dropped.
An allowlist run's gets its proxy's socket made with it, served only once a run takes it, with that run's
policy (the pool's rule too: leases.py reserve_egress); it matches only runs of the same options, allowlist
included.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import anyio
from anyio.abc import TaskGroup

from coderunner.offload import off_loop
from coderunner.oneshot.program import ready_argv
from coderunner.sandbox import SandboxBackend, SandboxProcess
from coderunner.sessions.egress_wiring import EgressHub
from coderunner.sessions.leases import SandboxLease, SandboxLeases
from coderunner.sessions.sandbox_options import SandboxOptions
from coderunner.vocabulary.network import NetworkMode

log = logging.getLogger(__name__)

#: A sandbox started ahead is dropped when no run took it this long.
READY_IDLE_S = 60.0
#: How long a run waits for the sandbox being started ahead for it, before starting its own.
READY_WAIT_S = 5.0
#: Bound on a sandbox started ahead saying it is up, and what it says (guest oneshot.READY).
READY_START_S = 30.0
READY_BYTE = b"R"
#: Work a run leaves for after its reply (the next sandbox's start, its own dirs' removal) waits this
#: long first: a start is a burst of CPU that on a small machine would share two cores with the reply.
REPLY_FIRST_S = 0.05
#: Bound on a user's session waiting for the sandbox it takes the room of to be gone.
EVICT_WAIT_S = 10.0

#: Whether `count` sandboxes started ahead, each using `member_mb` (None: not measured yet), fit the
#: user's limits beside everything else the server holds (the manager's answer).
Room = Callable[[int, float | None], bool]


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
    #: Set when its start ended, ready or not.
    done: anyio.Event = field(default_factory=anyio.Event)
    #: Set when a run took it or it is no longer wanted: the keeper stops waiting.
    released: anyio.Event = field(default_factory=anyio.Event)
    #: Set once its keeper is done with it (dropped, or handed to a run).
    gone: anyio.Event = field(default_factory=anyio.Event)
    state: Literal["preparing", "ready", "taken", "gone"] = "preparing"
    #: Its dirs and mounts (and for an allowlist run's, its proxy's socket, not served until a run takes it).
    lease: SandboxLease | None = None
    process: SandboxProcess | None = None


@dataclass(frozen=True)
class ReadyStats:
    """What the sandboxes started ahead did, for get_capabilities and the bench."""

    ready: int
    starting: int
    #: Runs that took a sandbox started ahead, and runs that started their own.
    runs_taken: int
    runs_cold: int
    #: Sandboxes dropped unused (idle, replaced, room taken back, drained).
    dropped: int


@dataclass
class ReadySandboxes:
    """At most one sandbox started ahead per option set, for the `most` option sets used last."""

    backend: SandboxBackend
    task_group: TaskGroup
    leases: SandboxLeases
    #: Option sets kept at once: never more idle one-shot sandboxes than may run at once.
    most: int = 1
    room: Room = lambda count, member_mb: True
    #: Network 'allowlist': the server's egress hub, which reserves a proxy socket per sandbox (None: no allowlist).
    egress: EgressHub | None = None
    #: Wanted sandboxes (preparing or ready), the option set used least recently first.
    _entries: dict[SandboxOptions, ReadySandbox] = field(default_factory=dict)
    #: The most memory a ready sandbox was measured to use (None until one was).
    member_mb: float | None = None
    _closed: bool = False
    _taken: int = 0
    _cold: int = 0
    _dropped: int = 0

    @property
    def held(self) -> int:
        """Sandboxes preparing or ready: what they hold of the server's room."""
        return len(self._entries)

    @property
    def held_mb(self) -> float:
        return self.held * (self.member_mb or 0.0)

    def stats(self) -> ReadyStats:
        ready = sum(entry.state == "ready" for entry in self._entries.values())
        return ReadyStats(ready=ready, starting=self.held - ready, runs_taken=self._taken, runs_cold=self._cold,
                          dropped=self._dropped)  # fmt: skip

    async def take(self, options: SandboxOptions) -> ReadySandbox | None:
        """The sandbox started ahead for these options, waited for (bounded) if still starting; else None."""
        entry = self._entries.get(ready_key(options))
        if entry is not None:
            with anyio.move_on_after(READY_WAIT_S):
                await entry.done.wait()
        if entry is None or entry.state != "ready" or self._entries.get(entry.key) is not entry:
            self._cold += 1
            return None
        entry.state = "taken"
        del self._entries[entry.key]
        entry.released.set()
        assert entry.process is not None
        if not entry.process.alive:  # died waiting (killed from outside): never hand it out, drop it here
            self._dropped += 1
            self._cold += 1
            with anyio.CancelScope(shield=True):
                await self._drop(entry)
            return None
        self._taken += 1
        return entry

    def start_ahead(self, options: SandboxOptions) -> None:
        """Have a sandbox for the next run with these options start now, if the room allows."""
        if self._closed or (options.network == NetworkMode.ALLOWLIST and self.egress is None):
            return
        key = ready_key(options)
        current = self._entries.pop(key, None)
        if current is not None:
            self._entries[key] = current  # still wanted: now the most recently used
            return
        while len(self._entries) >= self.most:
            self._unwant(next(iter(self._entries)))
        if not self.room(self.held + 1, self.member_mb):
            return
        entry = ReadySandbox(key)
        self._entries[key] = entry
        self.task_group.start_soon(self._keep, entry)

    async def evict_one(self) -> bool:
        """Give one sandbox's room back to a user's session (the least recently used option set first);
        True if one was. A ready one is gone on return; one still starting goes when its start ends."""
        if not self._entries:
            return False
        entry = self._unwant(next(iter(self._entries)))
        if entry.state == "ready":
            with anyio.move_on_after(EVICT_WAIT_S, shield=True):
                await entry.gone.wait()
        return True

    async def drain(self) -> None:
        """Start no more; drop every sandbox started ahead (those starting go when their start ends)."""
        self._closed = True
        entries = [self._unwant(key) for key in list(self._entries)]
        with anyio.move_on_after(EVICT_WAIT_S, shield=True):
            for entry in entries:
                if entry.state == "ready":
                    await entry.gone.wait()

    def _unwant(self, key: SandboxOptions) -> ReadySandbox:
        """No run will take the sandbox for `key`: its keeper drops it (now, or once its start ends)."""
        entry = self._entries.pop(key)
        entry.released.set()
        return entry

    def _wanted(self, entry: ReadySandbox) -> bool:
        return self._entries.get(entry.key) is entry

    async def _keep(self, entry: ReadySandbox) -> None:
        """Start `entry`'s sandbox, then keep it until a run takes it, it is unwanted, or READY_IDLE_S pass."""
        options = entry.key
        try:
            try:
                await anyio.sleep(REPLY_FIRST_S)
                if not self._wanted(entry):
                    return
                entry.lease = lease = await self.leases.lease(options, throwaway=True)
                await lease.mount()
                if options.network == NetworkMode.ALLOWLIST and self.egress is not None:
                    lease.reserve_egress(self.egress)  # served once a run takes it (runs.py: open_egress)
                argv = ready_argv(self.backend.python, lease.dirs, options.limits.memory_mb)
                entry.process = process = await self.backend.spawn(lease.spec(), argv, self.task_group, pipes=True)
                # Ready once its interpreter is up and says so (the first byte of its stdout, never the program's).
                with anyio.fail_after(READY_START_S):
                    said = await process.streams[1].receive(1)
                if said == READY_BYTE and self._wanted(entry):
                    used = await off_loop(process.memory_used_mb)
                    if used is not None:
                        self.member_mb = max(self.member_mb or 0.0, used)
                    # Offered only if it still fits (a session may have taken the room while it started).
                    if self._wanted(entry) and self.room(self.held, self.member_mb):
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
                if self._wanted(entry):
                    del self._entries[entry.key]
                self._dropped += 1
                with anyio.CancelScope(shield=True):
                    await self._drop(entry)
            entry.gone.set()

    @staticmethod
    async def _drop(entry: ReadySandbox) -> None:
        if entry.process is not None:
            await entry.process.kill()
        if entry.lease is not None:
            await entry.lease.close()
