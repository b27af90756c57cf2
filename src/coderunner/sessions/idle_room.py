"""The room the sessions share with sandboxes kept idle by a layer above (one-shot sandboxes started ahead).

max_sessions and pool_memory_mb bound every sandbox the server keeps, a user's session or one kept idle for
later. The SessionManager counts the idle ones of another layer through this interface, takes room back from
them first when a user's session needs it, and drains them on shutdown; oneshot/ready.py's ReadySandboxes
implement it (oneshot/local.py hands them over), and a manager with none counts NO_IDLE.
"""

from __future__ import annotations

from typing import Protocol


class IdleSandboxes(Protocol):
    """Sandboxes kept idle beside the sessions, as the SessionManager counts and reclaims them."""

    @property
    def held(self) -> int:
        """How many there are (starting or ready): each holds a session's room."""
        ...

    @property
    def held_mb(self) -> float:
        """The memory they hold together, as measured (the warm pool's budget counts it)."""
        ...

    async def evict_one(self) -> bool:
        """Drop one to give its room back; False when none was left to drop."""
        ...

    async def drain(self) -> None:
        """Drop them all, and keep none from now on (the server is stopping)."""
        ...


class NoIdleSandboxes:
    """None kept: a manager whose sandboxes no other layer shares."""

    held = 0
    held_mb = 0.0

    async def evict_one(self) -> bool:
        return False

    async def drain(self) -> None:
        return None


NO_IDLE: IdleSandboxes = NoIdleSandboxes()
