"""The warm pool: sandboxes with a live kernel, started ahead with the default options.

A create takes one when its own options can be given to it as it is taken (lower limits, its allowlist,
its run limit: warm_take.py); the pool itself knows nothing of options.

A cold session pays for its workspace, its sandbox and ipykernel's start (about 300 ms); a pooled
one has paid already, so taking it costs a few attribute writes. The rules that keep it safe:
- a pooled sandbox belongs to nobody until it is taken: the manager binds the owner and the
  client (its export folder) at take, never at pre-start;
- it is taken once and never comes back: a closed session's sandbox is deleted, as ever, and
  the pool starts a brand-new one (fresh workspace, fresh kernel, its own host uid);
- the pool never makes a user's call fail or wait: it refills in the background, one start at
  a time (on a small machine, parallel starts only slow each other and the users), only into
  spare room the manager grants (`room`), within a memory budget measured on its own members
  (shared with other sandboxes kept idle, one-shot ones started ahead: `others_mb`, idle_room.py);
- `drain()` stops the refill (an in-flight start is cancelled and cleaned up by the start
  itself) and closes every member: after it nothing of the pool runs.
The pool knows nothing of sandboxes: the manager gives it `start` (build one), `discard` (close
one) and `measure_mb`; so its state machine runs in unit tests with stand-ins.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio

log = logging.getLogger(__name__)

#: Longest pause after failed starts (they back off 1, 2, 4 … s up to this).
MAX_BACKOFF_S = 30.0
#: Pause after a take before the refill starts a sandbox: a start is a burst of CPU (bwrap, the
#: interpreter, imports), and the taker's first calls should not share two cores with it.
REFILL_DELAY_S = 0.5

T = TypeVar("T")

#: How a cold session's status begins when the pool had nothing to give it (why_empty says the rest).
NONE_READY = "the warm pool had no sandbox ready"


@dataclass
class PoolStats:
    """What the pool did, for status and the bench."""

    ready: int
    starting: int
    taken: int
    started: int
    failed: int
    discarded: int
    member_mb: float | None


class WarmPool(Generic[T]):
    """Up to `size` ready members; `take()` hands one out, the refill loop replaces it."""

    def __init__(
        self,
        *,
        size: int,
        memory_budget_mb: float,
        start: Callable[[], Awaitable[T]],
        refill_delay_s: float = REFILL_DELAY_S,
        discard: Callable[[T], Coroutine[Any, Any, None]],
        alive: Callable[[T], bool],
        room: Callable[[], bool],
        measure_mb: Callable[[T], float | None] | None = None,
        others_mb: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.size = size
        self.memory_budget_mb = memory_budget_mb
        self._start = start
        self._refill_delay_s = refill_delay_s
        self._last_take = -refill_delay_s
        self._discard = discard
        self._alive = alive
        self._room = room
        self._measure_mb = measure_mb
        #: What other idle sandboxes (one-shot ones started ahead) hold of the same memory budget.
        self._others_mb = others_mb
        self._ready: deque[T] = deque()
        #: Members take() found dead: closed by the refill loop, never on a caller's path.
        self._dead: list[T] = []
        self._starting = 0
        self._changed = anyio.Event()
        self._closed = False
        self._loop_scope: anyio.CancelScope | None = None
        self._loop_done = anyio.Event()
        self._failures = 0
        #: When the refill may start again after failed starts (their back-off), and the last one's error.
        self._retry_at = 0.0
        self._last_failure: str | None = None
        #: The largest memory a member was measured to use (None until one was measured).
        self._member_mb: float | None = None
        self._taken = self._started = self._failed = self._discarded = 0

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def stats(self) -> PoolStats:
        return PoolStats(
            ready=len(self._ready),
            starting=self._starting,
            taken=self._taken,
            started=self._started,
            failed=self._failed,
            discarded=self._discarded,
            member_mb=self._member_mb,
        )

    @property
    def held(self) -> int:
        """Members ready or being started: what the pool holds of the server's sandbox room."""
        return len(self._ready) + self._starting

    @property
    def held_mb(self) -> float:
        """The memory its members hold of the budget, judged by the largest measured (none yet: 0)."""
        return self.held * (self._member_mb or 0.0)

    def notify(self) -> None:
        """Something changed that may let the pool refill (a session closed, a member was taken)."""
        self._changed.set()
        self._changed = anyio.Event()

    def _wants_one(self) -> bool:
        if self._closed or self.held >= self.size or not self._room():
            return False
        return self._within_budget(self.held + 1)

    def _within_budget(self, members: int) -> bool:
        """`members` fit the budget, judged by the largest member measured so far (none yet: one may
        start, and is measured before it is offered)."""
        budget = self.memory_budget_mb - self._others_mb()
        if self._member_mb is None:
            return budget > 0
        return members * self._member_mb <= budget

    async def run(self) -> None:
        """The refill loop (a task in the manager's task group) until drain()."""
        try:
            with anyio.CancelScope() as scope:
                self._loop_scope = scope
                if self._closed:
                    scope.cancel()
                while True:
                    if self._dead:
                        await self.reap_dead()
                        continue
                    if not self._wants_one():
                        await self._changed.wait()
                        continue
                    settle = self._last_take + self._refill_delay_s - anyio.current_time()
                    if settle > 0:
                        await anyio.sleep(settle)
                        continue
                    await self._start_one()
        finally:
            self._loop_done.set()

    async def _start_one(self) -> None:
        self._starting += 1
        try:
            member = await self._start()
        except Exception as exc:  # a failed start must not end the loop; the next one backs off
            self._failed += 1
            self._failures += 1
            pause = min(2.0 ** (self._failures - 1), MAX_BACKOFF_S)
            log.warning("warm pool: a sandbox failed to start (%s); next try in %.0fs", exc, pause)
            self._last_failure = str(exc) or type(exc).__name__
            self._retry_at = anyio.current_time() + pause
            self._starting -= 1
            self.notify()  # a caller waiting for this start goes cold instead
            await anyio.sleep(pause)
            return
        except BaseException:  # cancelled (drain): the start cleaned up after itself
            self._starting -= 1
            raise
        self._starting -= 1
        self._failures = 0
        self._started += 1
        try:
            offered = await self._check(member)
        except BaseException:  # cancelled while measuring: never leave a member nobody holds
            await self._close_member(member)
            raise
        if not offered:
            await self._close_member(member)
            return
        self._ready.append(member)
        self.notify()

    async def _check(self, member: T) -> bool:
        """Whether a fresh member may be offered: the pool still runs, has room, and it fits the budget."""
        if self._closed or not self._room():  # drained, or a user's session took the room meanwhile
            return False
        if self._measure_mb is not None:
            measure = self._measure_mb
            used = await anyio.to_thread.run_sync(lambda: measure(member))
            if used is not None:
                self._member_mb = max(self._member_mb or 0.0, used)
        return not self._closed and self._within_budget(self.held + 1)

    async def _close_member(self, member: T) -> None:
        self._discarded += 1
        with anyio.CancelScope(shield=True):
            await self._discard(member)

    def why_empty(self) -> str:
        """Why take() found no member, in words: a cold session's status says it (sessions/warm_take.py)."""
        if self._closed:
            why = "it is closed"
        elif self._starting:
            why = "one is starting"
        elif (wait := self._retry_at - anyio.current_time()) > 0:
            why = f"it starts again in {wait:.0f}s after a failed start"
        elif not self._room():
            why = "no room is left under max_sessions"
        elif not self._within_budget(self.held + 1):
            measured = f" ({self._member_mb:g} MiB measured)" if self._member_mb is not None else ""
            why = f"another member{measured} would not fit pool_memory_mb"
        else:
            why = "its next start is about to begin"
        if self._last_failure is not None:
            why += f"; its last failed start: {self._last_failure}"
        return f"{NONE_READY} ({why})"

    def take(self) -> T | None:
        """A ready member, now, or None (the caller starts one cold): never waits, never starts one."""
        while self._ready:
            member = self._ready.popleft()
            if self._alive(member):
                self._taken += 1
                self._last_take = anyio.current_time()
                self.notify()
                return member
            # Died while waiting (killed from outside, out of memory): never hand it out.
            self._discarded += 1
            self._dead.append(member)
            self.notify()
        return None

    async def take_or_wait(self, timeout_s: float) -> T | None:
        """take(), or, while a start is under way, wait for it (within `timeout_s`): for a caller
        that would otherwise start its own cold (coderunner run: the start it waits for is ahead)."""
        with anyio.move_on_after(timeout_s):
            while True:
                member = self.take()
                if member is not None or self._starting == 0 or self._closed:
                    return member
                await self._changed.wait()
        return None

    async def evict_one(self) -> bool:
        """Close one ready member to make room for a user's cold session; True if one was closed."""
        if not self._ready:
            return False
        await self._close_member(self._ready.pop())
        return True

    async def drain(self) -> None:
        """Stop refilling and close every member; a start under way is cancelled (it cleans up)."""
        self._closed = True
        if self._loop_scope is not None:
            self._loop_scope.cancel()
            await self._loop_done.wait()
        members = [*self._ready, *self._dead]
        self._ready.clear()
        self._dead.clear()
        self.notify()
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for member in members:
                    tg.start_soon(self._discard, member)

    async def reap_dead(self) -> None:
        """Close members found dead by take() (called from the refill side, off the caller's path)."""
        members = list(self._dead)
        self._dead.clear()
        for member in members:
            with anyio.CancelScope(shield=True):
                await self._discard(member)
