"""A session's snapshot bookkeeping: where it came from, and (keep_state) whether its state needs saving.

Kept beside the session rather than in it: the kernel's lifecycle does not depend on it; the manager
and session_snapshots.py read and write it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class KeptState:
    #: keep_state: the kernel holds the session's state (loaded, or nothing was saved), so closing may
    #: save it; False until then, so a failed load never overwrites the saved state with an empty one.
    armed: bool = False
    #: The snapshot this session was restored or forked from, if any.
    restored_from: str | None = None
    #: The snapshots.Seed it started from (restore, fork, keep_state), with what the load reported.
    seeded: Any = None
    #: What closing did beyond stopping it (keep_state: whether the state was saved), for the reply.
    close_note: str | None = None
    #: keep_state: the session's `last_used` when the state was last saved or loaded (None: never).
    mark: float | None = None
    #: keep_state: what the last save or load did.
    note: str | None = None

    def dirty(self, last_used: float) -> bool:
        """keep_state: the kernel has run something since its state was last saved or loaded."""
        return self.mark is None or last_used != self.mark

    def mark_saved(self, last_used: float, note: str | None = None) -> None:
        """The kernel's state as of `last_used` is saved (or loaded, or was just tried)."""
        self.mark = last_used
        if note is not None:
            self.note = note
