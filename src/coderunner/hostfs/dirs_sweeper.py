"""A process that removes a server's session dirs, workspace mounts included, once that server is gone.

A server that dies by SIGKILL, OOM or a crash cannot remove its sessions' dirs: before this, they stayed
until some server's next start swept them, and each capped workspace kept its loop device attached and
its image mounted meanwhile (a machine here had gathered 61). The backend's watcher ends the sandboxes;
this process then runs the same sweep a next start runs (session_dirs.sweep_stale_dirs), which removes a
dir only once it has taken that dir's lock, so a live server's dirs (several servers share RUNTIME) are
never touched, and an unmount of a workspace still held by a dying sandbox is lazy.

One per SessionManager, in a session of its own (a signal to the server's process group does not reach
it). Its stdin is the read end of a pipe whose only writer is the manager (close-on-exec: no sandbox
holds it); end of file means the manager is gone, closed or killed. It waits with the bare interpreter
(WAIT_THEN_SWEEP, about 4 MiB) and imports this package only then, from the server's own sys.path (argv).
Its whole input is that pipe: the two host-only base dirs the manager made, written first, then its end
(its command line names no dir, so it is no sandbox's process to anyone looking for those).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: The backend's watcher ends the sandboxes as this process wakes: it sweeps after each of these pauses
#: until no dead dir is left (a sandbox still dying may keep a dir from going whole, or a live server's
#: start-up sweep may hold a dir's lock for a moment); what is left after the last is the next start's.
SWEEP_PAUSES_S = (0.5, 2.0, 10.0)
#: Bound on what the manager writes (two paths, as JSON; CLOSED once it removed all it made) before the end.
PLAN_BYTES = 16384
#: The line a manager that closed in order writes last: nothing of it is left, and the sweeper exits at once.
CLOSED = b"closed"
#: What the process runs: ignore a terminal's signals, read stdin to its end with nothing imported (what
#: it says: RUNTIME and WORKSPACES as JSON), then sweep (argv: the server's sys.path as JSON).
WAIT_THEN_SWEEP = (
    "import os, signal, sys\n"
    "for number in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):\n"
    "    signal.signal(number, signal.SIG_IGN)\n"
    "plan = b''\n"
    "while chunk := os.read(0, 4096):\n"
    f"    plan = (plan + chunk)[:{PLAN_BYTES}]\n"
    f"if plan.endswith(b'\\n' + {CLOSED!r}):\n"
    "    sys.exit(0)\n"
    "import json\n"
    "sys.path[:0] = json.loads(sys.argv[1])\n"
    "from coderunner.hostfs.dirs_sweeper import main\n"
    "sys.exit(main(json.loads(plan.partition(b'\\n')[0] or b'[]')))\n"
)


class DirsSweeper:
    """The manager's end: the pipe's write end. `close` (or the manager's death) sets the sweep off."""

    def __init__(self, runtime_base: Path, workspaces_base: Path) -> None:
        read_end, self._write_end = os.pipe()  # both close-on-exec: only this process holds the write end
        try:
            os.write(self._write_end, json.dumps([str(runtime_base), str(workspaces_base)]).encode()[:PLAN_BYTES])
            self.process: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", WAIT_THEN_SWEEP, json.dumps([entry for entry in sys.path if entry])],
                stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )  # fmt: skip
        except OSError as exc:
            log.warning("no sweeper for a killed server's dirs (%s): the next start removes them", exc)
            self.process = None
        finally:
            os.close(read_end)

    def close(self, *, in_order: bool) -> None:
        """End the pipe: `in_order` (the manager removed all it made), the sweeper exits at once; else it
        sweeps, as when the manager's process died. Never waits for it."""
        if self._write_end >= 0:
            if in_order:
                with contextlib.suppress(OSError):
                    os.write(self._write_end, b"\n" + CLOSED)
            os.close(self._write_end)
            self._write_end = -1
        if self.process is not None:
            self.process.poll()  # reaped here if it already exited; else it exits on its own, an orphan


def main(plan: list[str]) -> int:
    """Sweep the dead dirs under the two bases (RUNTIME, WORKSPACES), after each of SWEEP_PAUSES_S."""
    from coderunner.hostfs.session_dirs import sweep_stale_dirs

    if len(plan) != 2:
        return 2
    runtime_base, workspaces_base = (Path(base) for base in plan)
    for pause in SWEEP_PAUSES_S:
        time.sleep(pause)
        try:
            if not sweep_stale_dirs(runtime_base, workspaces_base, lambda name: None).left:
                return 0
        except OSError:
            return 1  # its base dirs are gone: nothing to sweep
    return 0
