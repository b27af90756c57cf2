"""Changes: versioned keyed values, and one bounded wait for the first of them to change.

Readers on another process (a cluster front door) follow what changes in many things here (each of a
node agent's sessions: its jobs' progress, the hosts its proxy asks about) with one call instead of a
polling loop per thing and kind: they send the versions they have seen, `changes_since` answers at once
with whatever differs, else waits (bounded) for the first publish of one of their keys. A key nobody
publishes to costs a waiting reader one version compare, nothing per publish elsewhere.

Values are snapshots of plain data (they cross a process boundary as they are), never deltas: a
reader that missed versions gets the latest value only, so a value must say all the reader needs
(counters to compare, not output to consume). Versions are compared for difference, not order, and
start at a random number: a reader of a publisher that restarted under the same name (a new agent)
gets every value again instead of taking an old version for a new one. A key asked about that is
not held (dropped, or never published) comes back as gone, at once.

Ray Serve's long poll host (python/ray/serve/_private/long_poll.py) works this way; this one adds
bounds (keys held, keys per wait, waits at once) and a wake by name, so a reader whose set of keys
grew can end its own wait instead of waiting it out.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import anyio

from coderunner.errors import SessionError

#: Keys held at once (a node agent: one per open session).
MAX_KEYS = 4096
#: Keys one wait may ask about.
MAX_ASKED = 4096
#: Waits under way at once (a front door keeps one per agent).
MAX_WAITERS = 256
#: Bound on one wait, whatever the reader asked.
MAX_WAIT_S = 60.0
#: Wakes remembered for a waiter not waiting yet (its wake overtook it); the oldest go first.
MAX_EARLY_WAKES = 64


class ChangesFull(SessionError):
    """A bound of Changes was reached: too many keys held, asked about at once, or waits at once."""


@dataclass
class Changed:
    """What one `changes_since` found: each key that differs, with its (version, value); keys not held."""

    values: dict[str, tuple[int, Any]] = field(default_factory=dict)
    gone: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.values or self.gone)


class Changes:
    """Versioned keyed values. One event loop: publish, drop and wait from its tasks only."""

    def __init__(self, max_keys: int = MAX_KEYS, max_waiters: int = MAX_WAITERS) -> None:
        self.max_keys = max_keys
        self.max_waiters = max_waiters
        self._held: dict[str, tuple[int, Any]] = {}
        #: One counter for all keys, from a random start (see the module docstring).
        self._last = secrets.randbits(48)
        #: The waits each key would end, and the waits by the name a reader may wake them by.
        self._waits: dict[str, set[anyio.Event]] = {}
        self._named: dict[str, anyio.Event] = {}
        self._waiting = 0
        self._early: dict[str, None] = {}

    def publish(self, key: str, value: Any) -> int:
        """Hold `value` as `key`'s newest, under a new version (returned); ends the waits asking about it."""
        if key not in self._held and len(self._held) >= self.max_keys:
            raise ChangesFull(f"{self.max_keys} keys are held here already: no more can be followed")
        self._last += 1
        self._held[key] = (self._last, value)
        self._wake_key(key)
        return self._last

    def drop(self, key: str) -> None:
        """Forget `key`: a wait asking about it ends, and hears it is gone."""
        if self._held.pop(key, None) is not None:
            self._wake_key(key)

    def version(self, key: str) -> int | None:
        held = self._held.get(key)
        return None if held is None else held[0]

    def __len__(self) -> int:
        return len(self._held)

    def differing(self, versions: dict[str, int | None]) -> Changed:
        """The keys whose version here is not the one given (None: never seen), and those not held."""
        found = Changed()
        for key, seen in versions.items():
            held = self._held.get(key)
            if held is None:
                found.gone.append(key)
            elif held[0] != seen:
                found.values[key] = held
        return found

    async def changes_since(
        self, versions: dict[str, int | None], timeout_s: float, waiter: str | None = None
    ) -> Changed:
        """What differs from `versions` now; if nothing, the first change within `timeout_s` (at most
        MAX_WAIT_S), else nothing. `waiter`: a name `wake` can end this wait by."""
        if len(versions) > MAX_ASKED:
            raise ChangesFull(f"one wait may follow {MAX_ASKED} keys at most; it asked about {len(versions)}")
        found = self.differing(versions)
        woken_early = waiter is not None and self._early.pop(waiter, "absent") is None
        if found or timeout_s <= 0 or woken_early:
            return found
        if self._waiting >= self.max_waiters:
            raise ChangesFull(f"{self.max_waiters} waits are under way here already: try again later")
        event = anyio.Event()
        for key in versions:
            self._waits.setdefault(key, set()).add(event)
        if waiter is not None:
            self._named[waiter] = event
        self._waiting += 1
        try:
            with anyio.move_on_after(min(timeout_s, MAX_WAIT_S)):
                await event.wait()
        finally:
            self._waiting -= 1
            if waiter is not None and self._named.get(waiter) is event:
                del self._named[waiter]
            for key in versions:
                waits = self._waits.get(key)
                if waits is not None:
                    waits.discard(event)
                    if not waits:
                        del self._waits[key]
        return self.differing(versions)

    def wake(self, waiter: str) -> None:
        """End the wait named `waiter` now (it answers with whatever differs, perhaps nothing); a wake that
        comes before its wait is kept for it, so that the wait returns at once."""
        event = self._named.get(waiter)
        if event is not None:
            event.set()
            return
        self._early[waiter] = None
        while len(self._early) > MAX_EARLY_WAKES:
            del self._early[next(iter(self._early))]

    def _wake_key(self, key: str) -> None:
        for event in self._waits.pop(key, ()):
            event.set()
