"""The channel relay's duties as the sandbox's init: adopt orphans, start the kernel, reap, forward signals.

Beside channel_relay.py, which loads it from its own folder (it runs with -I -S: stdlib only, no package).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

#: After a forwarded SIGTERM, how long the kernel has before SIGKILL.
TERM_GRACE_S = 10.0
PR_SET_CHILD_SUBREAPER = 36


def say(line: str) -> None:
    print(f"channel relay: {line}", file=sys.stderr, flush=True)


# --- init duties ---------------------------------------------------------------------------------


def become_subreaper() -> None:
    """Outside gVisor (tests, pid != 1) orphans would go past this process: adopt them instead."""
    if os.getpid() == 1:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # best effort: without it, only the kernel itself is reaped here


def spawn(argv: list[str], env: dict[str, str]) -> int:
    """The kernel in a session of its own, as jupyter_client starts one: an interrupt_request then
    reaches its whole process group (a running `!sleep`, pip). Signals ignored here (SIGPIPE and
    SIGXFSZ by Python, USR1/USR2 until handled) go back to the default for it."""
    stdin = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
    defaults = [signal.SIGPIPE, signal.SIGXFSZ, signal.SIGUSR1, signal.SIGUSR2]
    return os.posix_spawnp(argv[0], argv, env, file_actions=stdin, setsid=True, setsigdef=defaults)


class Init:
    """Reaps every child; resolves `ended` with the kernel's exit code."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.kernel = 0
        self.ended: asyncio.Future[int] = loop.create_future()

    def reap(self) -> None:
        """Every child that has ended: the kernel's orphans are re-parented here."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.kernel and not self.ended.done():
                code = os.waitstatus_to_exitcode(status)
                self.ended.set_result(128 - code if code < 0 else code)

    def started(self, pid: int) -> None:
        """Called right after the spawn; SIGCHLD's handler runs only from the loop, after this."""
        self.kernel = pid
        self.reap()

    def forward(self, signum: int) -> None:
        if self.kernel and not self.ended.done():
            try:
                os.kill(self.kernel, signum)
            except ProcessLookupError:
                return
            if signum == signal.SIGTERM:
                self.loop.call_later(TERM_GRACE_S, self.kill)

    def kill(self) -> None:
        if not self.ended.done():
            say(f"the kernel did not end within {TERM_GRACE_S:.0f} s of SIGTERM: killing it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.kernel, signal.SIGKILL)


def remove_private(directory: str) -> None:
    """The kernel's leftovers in the private dir (a tmpfs in the sandbox; this matters on a host)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
