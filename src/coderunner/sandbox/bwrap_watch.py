"""A process's bwrap sandboxes end with it, including the ones bwrap's --die-with-parent misses.

--die-with-parent is PR_SET_PDEATHSIG, which bwrap sets itself, without looking whether its parent is
still there: in its outer process only once it has cloned the sandbox, and in the sandbox's pid 1 only
once the sandbox is set up. A server SIGKILLed before the first leaves the whole sandbox to init;
between the two, the sandbox's pid 1. Both windows are milliseconds long on a loaded machine, and a
server starts sandboxes often (a pool's refill, the standby after each run, a node's pooled actors).
slirp4netns (network 'internet') has no parent death signal at all.

So every bwrap this process starts carries its mark (a no-op `--unsetenv MARK`, first in bwrap's
argv), and a watcher (watcher.py, kind "bwrap") SIGKILLs every process carrying it once this process
is gone, however it went; slirp4netns gets `--exit-fd` on a pipe whose only writer is this process.
One of each per process, not per backend: a process may make many backends (the tests do), and
their sandboxes all die with it.
"""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass

from coderunner.sandbox.watcher import Watcher, WatchPlan

#: The watcher's whole environment (it runs nothing but the interpreter and reads /proc).
WATCHER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class ProcessWatch:
    """This process's mark, its watcher, and the read end of its lifeline (slirp4netns --exit-fd)."""

    pid: int
    mark: str
    watcher: Watcher
    lifeline: int


_lock = threading.Lock()
_current: ProcessWatch | None = None


def process_watch() -> ProcessWatch:
    """This process's, made on first use (a forked child makes its own), its watcher (re)started."""
    global _current
    with _lock:
        if _current is None or _current.pid != os.getpid():
            mark = f"CODERUNNER_SANDBOX_OF_{secrets.token_hex(8)}"
            # Close-on-exec both: no child holds the write end, which is never closed (EOF = we are gone).
            lifeline, _writer = os.pipe()
            _current = ProcessWatch(os.getpid(), mark, Watcher(WatchPlan([], "bwrap", mark), WATCHER_ENV), lifeline)
        _current.watcher.ensure_running()
        return _current
