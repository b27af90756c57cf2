"""A server's background upkeep of its sessions: close the idle ones, save the keep_state ones that sat idle."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

import anyio

from coderunner.errors import SessionError

if TYPE_CHECKING:
    from coderunner.sessions.manager import SessionManager

log = logging.getLogger(__name__)


async def reap_idle(manager: SessionManager) -> None:
    """Close sessions nobody used for idle_timeout_s (their sandboxes hold memory and disk)."""
    limit = manager.settings.idle_timeout_s
    while True:
        await anyio.sleep(min(max(limit / 4, 0.5), 30.0))
        now = time.monotonic()
        for session in manager.list():
            if not session.busy and now - session.last_used > limit:
                log.info("closing session %s… after %.0fs idle", session.session_id[:6], now - session.last_used)
                with contextlib.suppress(SessionError):
                    await manager.close(session.session_id)


async def save_kept_states(manager: SessionManager) -> None:
    """Save keep_state sessions that ran something and then sat idle for keep_state_save_idle_s,
    one at a time: a crash, SIGKILL or reboot then loses at most the work since, not the session."""
    idle = manager.settings.keep_state_save_idle_s
    while True:
        await anyio.sleep(min(max(idle / 4, 0.25), 15.0))
        now = time.monotonic()
        for session in manager.list():
            ready = session.options.keep_state and session.kept.armed and not session.closed
            if not ready or session.busy or session.jobs.running() is not None:
                continue
            if session.kept.dirty(session.last_used) and now - session.last_used >= idle:
                note = await manager.snapshots.save_kept(session, wait_s=0.5)
                log.info("session %s…: %s", session.session_id[:6], note)
