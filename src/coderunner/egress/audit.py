"""A record of every egress decision: a bounded per-session log and an append-only JSONL file.

The per-session log answers `session_status` (recent entries, totals) and lets a `run_python` reply
name the hosts denied during that call (mark / denied_since). The file keeps everything, across
sessions, rotated by size; writing it never blocks the event loop and never grows a queue unbounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MiB = 1024 * 1024


@dataclass(frozen=True)
class Decision:
    """One decision: allowed connections are recorded when they close (with bytes), denials at once."""

    at: float
    host: str
    port: int
    allowed: bool
    reason: str
    sent: int = 0
    received: int = 0


class AuditFile:
    """Append-only JSONL at path (in a host-only dir), rotated to path.1 .. path.keep past max_bytes.

    Lines are queued (bounded) and written by one worker thread; when the queue is full a line is
    dropped and counted, and a `{"dropped": N}` line is written once there is room. The file is opened
    with O_NOFOLLOW|O_APPEND|O_CREAT and mode 0600: a link planted at the path is refused.
    """

    def __init__(self, path: Path, max_bytes: int = 8 * MiB, keep: int = 3, queue_lines: int = 10_000) -> None:
        raise NotImplementedError

    def write(self, session_id: str, decision: Decision) -> None:
        """Queue one line; never blocks (drops and counts when the queue is full)."""
        raise NotImplementedError

    @property
    def dropped(self) -> int:
        """Lines dropped so far because the queue was full (or the file could not be written)."""
        raise NotImplementedError

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait (blocking, bounded) until every queued line is written; True if it got there."""
        raise NotImplementedError

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (bounded wait), stop the worker and close the file."""
        raise NotImplementedError


class DecisionLog:
    """One session's decisions: a bounded ring of recent entries, running totals, marks for denials."""

    def __init__(self, session_id: str, *, capacity: int = 200, sink: AuditFile | None = None) -> None:
        raise NotImplementedError

    def record(self, decision: Decision) -> None:
        """Add one decision (ring, totals, the audit file if any). Cheap; safe on the event loop."""
        raise NotImplementedError

    def recent(self, n: int = 10) -> list[Decision]:
        """The last n decisions, oldest first."""
        raise NotImplementedError

    def totals(self) -> dict[str, int]:
        """Counts over the whole session: allowed, denied, sent, received (bytes)."""
        raise NotImplementedError

    def mark(self) -> int:
        """A position to ask denied_since about later (e.g. at the start of a run_python call)."""
        raise NotImplementedError

    def denied_since(self, mark: int) -> list[str]:
        """Distinct "host:port" denied since mark, in first-seen order (bounded)."""
        raise NotImplementedError
