"""The host's hold on a bwrap sandbox: pidfds of its outer bwrap and of its pid 1, its start gate, its watcher entry.

Why: killing a pid namespace's init ends everything inside it, whatever that init's argv or parent-death
signal says (the kernel delivers SIGKILL from an ancestor namespace to it), and a pidfd names that one
process for as long as the host holds it, never a pid reused since. bwrap reports its child's host pid
on --info-fd; the host opens a pidfd of it and checks, after opening, that it is bwrap's child.

The gate is a pipe whose only writer is this process: the start prelude (`gated_command`) waits for
"go" on it before it execs bwrap, and the sandbox's init (guest/sandbox_init.py) for one more byte
before it starts anything. The host writes each only once the watcher holds what it needs to end the
sandbox without this process. Its end of file (this process gone, or the sandbox killed) ends the init.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from coderunner.sandbox.bwrap_watch import PidWatcher
from coderunner.sandbox.cgroups import JOIN_SCRIPT, SessionCgroup, join_arguments


class NotOurChild(OSError):
    """A pid is not (or no longer) the child it should be: bwrap's pid 1, or the process this one spawned."""


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def open_child(parent: int, child: int) -> int:
    """A pidfd of `child`, if it is `parent`'s child (read after opening, so the pidfd is of that child)."""
    pidfd = os.pidfd_open(child)
    if parent_of(child) != parent:
        os.close(pidfd)
        raise NotOurChild(f"process {child} is no longer a child of process {parent}")
    return pidfd


def gated_command(gate: int, argv: list[str], cgroup: SessionCgroup | None = None) -> list[str]:
    """`argv` behind a /bin/sh that waits for "go" on fd `gate` and exits on anything else (its writer's
    end of file included), then moves itself into `cgroup` (if any), then execs `argv`. Its pid is what becomes
    the outer bwrap's. One shell for both: each exec before bwrap costs a start about 0.7 CPU-ms."""
    # dash redirects fds 0-9 only: the gate (any number) is opened anew by its /proc name.
    script = 'IFS= read -r go < "/proc/self/fd/$1" && [ "$go" = go ] || exit 97; shift; ' + JOIN_SCRIPT + 'exec "$@"'
    return ["/bin/sh", "-c", script, "coderunner-start", str(gate), *join_arguments(cgroup), *argv]


@dataclass
class Gate:
    """The pipe the start prelude and the sandbox's init wait on. Each end is closed once (then -1): an
    fd number closed twice may by then name another file of this process."""

    read: int
    write: int

    @classmethod
    def open(cls) -> Gate:
        read, write = os.pipe()
        return cls(read, write)

    def open_prelude(self) -> None:
        os.write(self.write, b"go\n")

    def open_init(self) -> None:
        os.write(self.write, b"1")

    def close_child_end(self) -> None:
        self.read = _close(self.read)

    def close(self) -> None:
        """The init's end of file: it exits, and its namespace with it."""
        self.close_child_end()
        self.write = _close(self.write)


def _close(fd: int) -> int:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
    return -1


@dataclass
class SandboxHold:
    """What ends one bwrap sandbox: SandboxProcess.kill calls `kill` first and `release` once it is reaped."""

    watcher: PidWatcher
    entry: str
    outer: int
    gate: Gate
    init: int | None = None
    released: bool = False

    def kill(self) -> None:
        """SIGKILL its pid 1 (the whole namespace goes), and close the gate (its init's end of file).
        Once released, nothing: its fds are closed (and their numbers may name other files by now)."""
        if self.released:
            return
        if self.init is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.init, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.outer, signal.SIGKILL)
        self.gate.close()

    def release(self) -> None:
        """Its processes are gone: close the pidfds, and the watcher forgets it (once)."""
        if self.released:
            return
        self.released = True
        self.gate.close()
        self.watcher.forget(self.entry)
        for fd in (self.outer, self.init):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
