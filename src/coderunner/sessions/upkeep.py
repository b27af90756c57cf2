"""A server's background upkeep of its sessions: close the idle ones, save the keep_state ones that sat idle.

Each loop is given what it works on (the sessions, how to close one, where a state is saved), not the
manager that starts it: the manager imports this module, and nothing here needs the rest of it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import anyio

from coderunner.errors import SessionError
from coderunner.sessions.session import Session
from coderunner.sessions.session_snapshots import SessionSnapshots

log = logging.getLogger(__name__)

#: The live sessions, as the manager lists them.
Sessions = Callable[[], list[Session]]


async def reap_idle(limit: float, sessions: Sessions, close: Callable[[str], Awaitable[object]]) -> None:
    """Close (by id, with `close`) sessions nobody used for `limit` seconds (their sandboxes hold memory
    and disk)."""
    while True:
        await anyio.sleep(min(max(limit / 4, 0.5), 30.0))
        now = time.monotonic()
        for session in sessions():
            if not session.busy and now - session.last_used > limit:
                log.info("closing session %s… after %.0fs idle", session.session_id[:6], now - session.last_used)
                with contextlib.suppress(SessionError):
                    await close(session.session_id)


async def save_kept_states(idle: float, sessions: Sessions, snapshots: SessionSnapshots) -> None:
    """Save keep_state sessions that ran something and then sat idle for `idle` seconds, one at a time:
    a crash, SIGKILL or reboot then loses at most the work since, not the session."""
    while True:
        await anyio.sleep(min(max(idle / 4, 0.25), 15.0))
        now = time.monotonic()
        for session in sessions():
            ready = session.options.keep_state and session.kept.armed and not session.closed
            if not ready or session.busy or session.jobs.running() is not None:
                continue
            if session.kept.dirty(session.last_used) and now - session.last_used >= idle:
                note = await snapshots.save_kept(session, wait_s=0.5)
                log.info("session %s…: %s", session.session_id[:6], note)
