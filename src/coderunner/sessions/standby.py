"""A session's standby kernel: one fresh kernel started ahead, so that kernel_reset (or a restart) swaps to it.

A cold replacement kills the kernel and starts a sandbox: about 0.25 s on an idle machine, seconds under
load. With a standby the session kills the kernel and hands over one that started earlier, in a sandbox
of the same spec (workspace, mounts, network, limits, host uid) under the session's other sandbox name
(SandboxSpec.twin: its own cgroup, so its memory never eats the live kernel's limit; status shows it).
The rules that keep it honest:
- it is a fresh interpreter: it ran nothing but a silent warm-up and, once the session rested, the
  common imports (sessions/warm_up.py); the live kernel's code cannot reach it (its key is only in its own sandbox:
  SandboxSpec.private_files; pid, net, ipc namespaces of its own, its own /tmp). It shares with the
  live kernel what a reset keeps anyway (workspace, mounts), and the run dir its sockets are bound in,
  where the live kernel's code can at most make its start fail (a message without the key is dropped).
  At the swap it drops what it cached of the file system;
- it starts at the session's first quiet moment after a kernel started (no call, or one running
  for a while), in the background, one start at a time; a failed start is not retried before the next swap;
- taking it never waits for a start: not ready means the caller starts a kernel cold, as before;
- close() cancels a start under way and waits for it to end its sandbox, and shuts the ready one down;
- all sessions' standbys together stay within `reset_standby_memory_mb` (StandbyBudget, one per server): a
  start waits for room, judged by the largest standby measured so far, and one measured past the budget
  once ready is shut down instead of kept.
Enabled by the `reset_standby` setting, on backends with private files (bwrap).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup

from coderunner.config import Settings
from coderunner.kernel.execution import RunStatus
from coderunner.kernel.incarnation import Kernel
from coderunner.kernel.output_capture import OutputCollector
from coderunner.sessions.usage import memory_used_mb
from coderunner.sessions.warm_up import NO_OP_CODE, PRELOAD_STEP_CODES

log = logging.getLogger(__name__)

#: Wait after a kernel started before starting its standby: a start is a burst of CPU (bwrap, the
#: interpreter, imports) that the caller's next calls should not share two cores with.
START_DELAY_S = 0.5
#: How often a standby waiting for a quiet moment looks again.
QUIET_POLL_S = 0.1
#: Bound on the standby's warm-up and swap-in cells (a kernel that is up answers in milliseconds); its
#: preload, which imports the data stack, has the kernel start's bound (startup_timeout_s).
CELL_TIMEOUT_S = 10.0
#: How often a standby waiting for room in the server's budget looks again (a session it would not
#: fit may wait long: a slower poll).
ROOM_POLL_S = 1.0
#: What a ready standby is taken to hold when its memory cannot be read.
UNMEASURED_MB = 64.0
#: The swap-in cell: the file system may have changed since the standby started (install_packages made the
#: package folder, say). The import system forgets what it cached of it, then guest/warm_imports.py's
#: still_current raises if a module its warm-up imported is no longer what the user's import would find (one put
#: in the workspace or the session's packages since, another matplotlibrc), and the reset starts a kernel cold.
#: Silent: nothing in the user's namespace. It also shows the standby answers before it is handed out.
SWAP_IN_CODE = (
    "__import__('importlib').invalidate_caches(); "
    "__import__('coderunner_guest.warm_imports').warm_imports.still_current()"
)


@dataclass
class _Fill:
    """A standby start under way: close cancels it and waits for it to end its sandbox."""

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ended: anyio.Event = field(default_factory=anyio.Event)
    #: The kernel being started, once made (its sandbox name is taken).
    kernel: Kernel | None = None
    #: Counted as starting in the server's standby budget.
    counted: bool = False
    #: The kernel it offered (Standby.kernel), whose preload it then waits to run, and whether that runs.
    offered: Kernel | None = None
    preloading: bool = False
    #: Set by take(): run no further step of the preload.
    stop_preload: bool = False


@dataclass
class StandbyBudget:
    """The memory every session's standby of a server holds together (reset_standby_memory_mb): one
    more starts only while it fits, judged by the largest measured so far (none measured yet: one
    start at a time), and a ready one is kept only if its measured memory fits."""

    limit_mb: float
    #: Standby (by id) -> the memory its ready kernel was measured to hold.
    ready: dict[int, float] = field(default_factory=dict)
    starting: int = 0
    largest_mb: float | None = None

    @property
    def held_mb(self) -> float:
        """Ready standbys' measured memory, and the largest measured for each one starting."""
        return sum(self.ready.values()) + self.starting * (self.largest_mb or 0.0)

    def admits(self) -> bool:
        """Whether one more standby may start now."""
        if self.limit_mb <= 0:
            return False
        if self.largest_mb is None:
            return self.starting == 0 and not self.ready
        return self.held_mb + self.largest_mb <= self.limit_mb

    def keep(self, owner: int, used_mb: float) -> bool:
        """A standby measured ready at `used_mb`: counted, if it fits (False: it must be shut down)."""
        self.largest_mb = max(self.largest_mb or 0.0, used_mb)
        if sum(self.ready.values()) + used_mb > self.limit_mb:
            return False
        self.ready[owner] = used_mb
        return True

    def release(self, owner: int) -> None:
        self.ready.pop(owner, None)

    def remeasured(self, owner: int, used_mb: float) -> None:
        """A ready standby grew (its preload imported the data stack): counted at what it holds now."""
        if owner in self.ready:
            self.ready[owner] = used_mb
            self.largest_mb = max(self.largest_mb or 0.0, used_mb)


@dataclass
class Standby:
    """At most one ready standby kernel of a session, and at most one start of one."""

    settings: Settings
    task_group: TaskGroup
    #: Makes a kernel, not yet started, under a sandbox name no other kernel of the session uses.
    make: Callable[[], Kernel]
    #: Whether the session is quiet enough for a start now.
    quiet: Callable[[], bool]
    enabled: bool
    #: The server's budget for all sessions' standbys (None: this one is not counted).
    budget: StandbyBudget | None = None
    #: Whether it has rested enough for the standby's preload (preload_imports) now.
    settled: Callable[[], bool] = lambda: True
    #: Returns once what its kernels start from is ready (a kernel template's start under way ended): a standby,
    #: which nobody waits for, forks from it rather than start cold beside it in a server's first seconds.
    starter_ready: Callable[[], Awaitable[None]] | None = None
    kernel: Kernel | None = None
    closed: bool = False
    _fill: _Fill | None = None
    #: The kernel whose preload ran to its end (for status).
    _preloaded: Kernel | None = None
    #: Standbys swapped in, and those that failed to start or to swap in (for status).
    taken: int = 0
    failed: int = 0

    def kernels(self) -> list[Kernel]:
        """Its kernels, ready or starting: their sandbox names are taken."""
        starting = self._fill.kernel if self._fill is not None else None
        return [kernel for kernel in (self.kernel, starting) if kernel is not None]

    def want(self) -> None:
        """Start one in the background (after START_DELAY_S, at a quiet moment) unless one is ready or starting."""
        if not self.enabled or self.closed or self.kernel is not None or self._fill is not None:
            return
        fill = _Fill()
        self._fill = fill
        self.task_group.start_soon(self._run_fill, fill)

    async def _run_fill(self, fill: _Fill) -> None:
        try:
            with fill.scope:
                await anyio.sleep(START_DELAY_S)
                while True:
                    if not self.quiet():
                        await anyio.sleep(QUIET_POLL_S)
                    elif self.budget is not None and not self.budget.admits():
                        await anyio.sleep(ROOM_POLL_S)
                    else:
                        break
                if self.starter_ready is not None:
                    await self.starter_ready()
                if self.budget is not None:
                    self.budget.starting += 1
                    fill.counted = True
                fill.kernel = self.make()
                await fill.kernel.start(self.settings.startup_timeout_s)
                await self._cell(fill.kernel, NO_OP_CODE, "warm-up")  # a first execute's one-off costs, paid now
                if self.closed or not await self._fits(fill):
                    return
                self.kernel = fill.offered = fill.kernel
                fill.kernel = None
                if self.settings.preload_imports:
                    await self._preload(fill)
        except Exception as exc:  # never the caller's: the next reset starts cold, and this tries again after it
            self.failed += 1
            log.warning("a standby kernel failed to start (%s); the next reset starts one cold", exc)
        finally:
            if fill.counted and self.budget is not None:
                self.budget.starting -= 1
                fill.counted = False
            with anyio.CancelScope(shield=True):
                if fill.kernel is not None:  # cancelled, failed or closed meanwhile: never left running
                    await fill.kernel.shutdown()
                    fill.kernel = None
                self._fill = None
                fill.ended.set()

    async def _fits(self, fill: _Fill) -> bool:
        """Whether the standby just started fits the server's budget (measured now); False: not kept."""
        if self.budget is None or fill.kernel is None:
            return True
        kernel = fill.kernel
        used = await anyio.to_thread.run_sync(memory_used_mb, kernel)
        self.budget.starting -= 1
        fill.counted = False
        if self.budget.keep(id(self), UNMEASURED_MB if used is None else used):
            return True
        log.info("a standby kernel would pass reset_standby_memory_mb (%d MiB); not kept", self.budget.limit_mb)
        return False

    def _let_go(self) -> Kernel | None:
        """The ready standby, no longer this session's nor counted in the budget."""
        kernel, self.kernel = self.kernel, None
        if self.budget is not None:
            self.budget.release(id(self))
        return kernel

    async def _preload(self, fill: _Fill) -> None:
        """The common imports (sessions/warm_up.py: a second or so of CPU) in the offered kernel, once the
        session rests (beside its first cells they would slow them), unless it was taken meanwhile; then
        counted in the server's budget at what it holds with them."""
        while not self.settled():
            await anyio.sleep(QUIET_POLL_S)
        if self.kernel is not fill.offered or fill.offered is None:
            return
        fill.preloading = True
        for code in PRELOAD_STEP_CODES:
            if fill.stop_preload:  # taken: it goes with the steps done so far
                return
            await self._cell(fill.offered, code, "preload", self.settings.startup_timeout_s)
        self._preloaded = fill.offered
        if self.budget is not None and self.kernel is fill.offered:
            used = await anyio.to_thread.run_sync(memory_used_mb, fill.offered)
            if used is not None:
                self.budget.remeasured(id(self), used)

    async def take(self) -> Kernel | None:
        """The ready standby, made ready for user code (it forgot what it cached of the file system), or
        None: none ready, or the one ready died or failed its swap-in (then it is shut down). A step of
        its preload under way is waited for (a few hundred ms), and no further step runs; a preload not
        yet begun never runs in it: the kernel goes as it is."""
        kernel = self._let_go()
        if kernel is None:
            return None
        fill = self._fill
        if fill is not None and fill.offered is kernel:
            fill.stop_preload = True  # a step under way ends (a few hundred ms), and no other begins
            if not fill.preloading:
                fill.scope.cancel()
            with anyio.move_on_after(self.settings.startup_timeout_s):
                await fill.ended.wait()
        if kernel.alive and (fill is None or fill.ended.is_set()):
            try:
                await self._cell(kernel, SWAP_IN_CODE, "swap-in")
            except Exception as exc:
                log.warning("a standby kernel failed its swap-in (%s); starting one cold", exc)
            else:
                self.taken += 1
                kernel.started_at = time.monotonic()  # its uptime as the session's kernel
                return kernel
        self.failed += 1
        await kernel.shutdown()
        return None

    async def stop(self) -> bool:
        """Cancel a start under way and wait for it to end its sandbox; False if it would not, in time."""
        fill = self._fill
        if fill is None:
            return True
        fill.scope.cancel()
        with anyio.move_on_after(self.settings.interrupt_grace_s + 15.0):
            await fill.ended.wait()
        return fill.ended.is_set()

    async def close(self) -> bool:
        """No more standbys: stop a start under way and shut the ready one down. False: a start would
        not end (its sandbox may still use the session's dirs, which must then be left)."""
        self.closed = True
        with anyio.CancelScope(shield=True):
            stopped = await self.stop()
            kernel = self._let_go()
            if kernel is not None:
                await kernel.shutdown()
        return stopped

    def describe(self) -> dict[str, Any] | None:
        """For manage_sessions status: whether one is ready, and the memory it holds (beside the kernel's own)."""
        if not self.enabled:
            return None
        state = "ready" if self.kernel is not None else "starting" if self._fill is not None else "none"
        memory = memory_used_mb(self.kernel) if self.kernel is not None and self.kernel.alive else None
        described = {"state": state, "memory_mb": memory, "swapped_in": self.taken, "failed": self.failed}
        if self.settings.preload_imports:
            described["preloaded"] = self.kernel is not None and self._preloaded is self.kernel
        return described

    async def _cell(self, kernel: Kernel, code: str, what: str, timeout_s: float = CELL_TIMEOUT_S) -> None:
        """Run a silent cell of ours in `kernel`; raises RuntimeError unless it ran cleanly."""
        output = OutputCollector(limit_chars=self.settings.output_limit_chars, spill_limit_bytes=0, image_limit_bytes=0)
        try:
            outcome = await kernel.execute(
                code, output, timeout_s=timeout_s, interrupt_grace_s=self.settings.interrupt_grace_s, silent=True,
                keep_on_cancel=False,  # a standby whose start is stopped is discarded: no interrupt to wait for
            )  # fmt: skip
        finally:
            output.close()
        if outcome.status is not RunStatus.OK:
            raise RuntimeError(f"its {what} cell ended {outcome.status.value}")
