"""How many one-shot sandboxes run at once: a global number of slots, and each client's share of them.

A client's runs wait first for its own share, then for a global slot, so that one client cannot
keep the others waiting; a run the server makes itself (the versions probe) takes no share.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from coderunner.oneshot.program import OneShotError


@dataclass
class OneShotSlots:
    """The slots of one server's one-shot runs."""

    #: One-shot sandboxes at once; more wait (within their own timeout) for a slot.
    max_concurrent: int = 4
    #: Of those, how many one caller may hold.
    max_per_caller: int = 2
    _limiter: anyio.CapacityLimiter | None = None
    #: Per-caller limiters, kept only while that caller has a run waiting or going.
    _callers: dict[str, tuple[anyio.CapacityLimiter, int]] = field(default_factory=dict)

    @contextlib.asynccontextmanager
    async def slot(self, wait_s: float, caller: str | None) -> AsyncIterator[None]:
        """The caller's own share first, then a global slot, both within `wait_s`.

        `caller` None is a run of the server's own (the versions probe): it takes no share.
        """
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.max_concurrent)
        share: anyio.CapacityLimiter | None = None
        waiting_for = "share"
        with anyio.move_on_after(wait_s) as waited:
            share = await self._take_share(caller)
            waiting_for = "global"
            try:
                await self._limiter.acquire()
            except BaseException:
                self._give_share(caller, share)
                share = None
                raise
        if waited.cancelled_caught:
            if caller is not None and waiting_for == "share":
                raise OneShotError(
                    f"this client already has {self.max_per_caller} one-shot runs in progress (its share of the "
                    f"server's {self.max_concurrent}); try again when one finishes"
                )
            raise OneShotError(f"{self.max_concurrent} one-shot runs are in progress; try again when one finishes")
        try:
            yield
        finally:
            self._limiter.release()
            self._give_share(caller, share)

    async def _take_share(self, caller: str | None) -> anyio.CapacityLimiter | None:
        if caller is None:
            return None
        limiter, users = self._callers.get(caller) or (anyio.CapacityLimiter(self.max_per_caller), 0)
        self._callers[caller] = (limiter, users + 1)
        try:
            await limiter.acquire()
        except BaseException:
            self._give_share(caller, None)
            raise
        return limiter

    def _give_share(self, caller: str | None, limiter: anyio.CapacityLimiter | None) -> None:
        """Release a share taken (or only waited for: `limiter` None); forget callers with nothing left."""
        if caller is None:
            return
        if limiter is not None:
            limiter.release()
        held, users = self._callers[caller]
        if users <= 1:
            del self._callers[caller]
        else:
            self._callers[caller] = (held, users - 1)
