"""The process that ends a server's bwrap sandboxes once that server is gone, by handles the sandbox cannot change.

Run as a script by bwrap_watch.py, one per server process, in a session of its own. Its stdin is one
end of a SOCK_SEQPACKET pair whose other end only the server holds. For every sandbox the server sends,
before the sandbox may start anything (a gate holds it):

    add ID [cgroup DIR]...   + fds: a pidfd of the process it spawned (the outer bwrap, pid kept
                               through its execs) and the read end of bwrap's --info-fd pipe
    init ID                  + fd:  a pidfd of the sandbox's pid 1 (bwrap's "child-pid"); the info
                               pipe is closed then
    drop ID                  the sandbox is dead and reaped: close its fds

End of file means the server is gone, however it went. Then, for every sandbox still held: its cgroups
are frozen (v1 freezer) or killed whole (v2 cgroup.kill); its pid 1 gets SIGKILL through its pidfd,
which ends everything in its pid namespace whatever that init's argv or death signal says; the outer
bwrap is killed (without cgroups it is stopped first, and its children, a pid 1 the server had not been
told of yet, are killed by pidfd); what is left in the cgroups is killed, and they are thawed.
Nothing here reads a path or a command line the sandbox can write: a pidfd never names a reused pid,
and the cgroup dirs are the host's. It holds the info pipe's read end too, though bwrap no longer needs a
reader besides itself: its --info-fd is read-write (bwrap_fds.py), so a report nobody reads never kills
it with SIGPIPE, which left its child blocked for ever once this watcher was gone as well.

It imports builtin modules only, so that waiting costs little memory: the server starts one per process.
"""

from __future__ import annotations

import _socket
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

#: Bound on an outer bwrap stopping after SIGSTOP (then its children are read).
STOP_WAIT_S = 2.0
#: Bound on a cgroup v1 freezer reaching FROZEN.
FREEZE_WAIT_S = 2.0
#: Kill rounds over what is left in a cgroup, a pause apart.
CGROUP_ROUNDS = 5
ROUND_PAUSE_S = 0.05
#: Largest message and most fds the server sends in one.
MESSAGE_BYTES = 65536
MAX_FDS = 4
#: SOL_SOCKET / SCM_RIGHTS (the same on every Linux architecture).
SCM_RIGHTS = 1


class Held:
    """One sandbox's handles: pidfds (outer, init), other fds kept open, its cgroup dirs."""

    def __init__(self) -> None:
        self.outer: int | None = None
        self.inits: list[int] = []
        self.kept: list[int] = []
        self.cgroups: list[str] = []

    def close(self) -> None:
        for fd in [*([self.outer] if self.outer is not None else []), *self.inits, *self.kept]:
            quietly(os.close, fd)


def fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The fds an SCM_RIGHTS message carried (native-endian C ints)."""
    fds = []
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds += [int.from_bytes(data[at : at + 4], sys.byteorder, signed=True) for at in range(0, usable, 4)]
    return fds


def apply(held: dict[str, Held], text: str, fds: list[int]) -> None:
    """One message from the server (see the module docstring); fds it does not expect are closed."""
    lines = text.split("\n")
    verb, _, name = lines[0].partition(" ")
    extra = list(fds)
    if verb == "add" and len(fds) >= 1:
        entry = held.setdefault(name, Held())
        entry.outer, entry.kept = fds[0], [*entry.kept, *fds[1:]]
        entry.cgroups += [line[len("cgroup ") :] for line in lines[1:] if line.startswith("cgroup ")]
        extra = []
    elif verb == "init" and len(fds) == 1:
        entry = held.setdefault(name, Held())
        entry.inits.append(fds[0])
        for fd in entry.kept:  # bwrap has written its --info-fd: its read end need not be held any more
            os.close(fd)
        entry.kept, extra = [], []
    elif verb == "drop":
        entry_gone = held.pop(name, None)
        if entry_gone is not None:
            entry_gone.close()
    for fd in extra:
        os.close(fd)


def receive_until_end(sock: _socket.socket) -> dict[str, Held]:
    """Every message until the server's end closes; what is held then."""
    held: dict[str, Held] = {}
    space = _socket.CMSG_SPACE(4 * MAX_FDS)
    while True:
        try:
            data, ancillary, _flags, _address = sock.recvmsg(MESSAGE_BYTES, space)
        except InterruptedError:
            continue
        except OSError:
            return held
        fds = fds_of(ancillary)
        if not data and not fds:
            return held
        apply(held, data.decode("utf-8", "replace"), fds)


def quietly(call: Callable[..., object], *args: int) -> bool:
    """`call(*args)`; False if it raised OSError (a process gone already, an fd closed). No contextlib:
    this file imports builtin modules only."""
    try:
        call(*args)
    except OSError:
        return False
    return True


def signal_fd(pidfd: int, number: int) -> None:
    quietly(signal.pidfd_send_signal, pidfd, number)


def pid_of(pidfd: int) -> int | None:
    """The pid a pidfd names, from its fdinfo; None once the process has exited."""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}") as handle:
            for line in handle:
                if line.startswith("Pid:"):
                    pid = int(line.split()[1])
                    return pid if pid > 0 else None
    except (OSError, ValueError, IndexError):
        pass
    return None


def stat_of(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of `pid`, or None."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rpartition(")")[2].split()
        return fields[0], int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


def kill_children(parent: int) -> None:
    """SIGKILL every child of `parent` (stopped: it makes no more), each by a pidfd opened before its
    parent is read, so a pid reused meanwhile is never hit."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            pidfd = os.pidfd_open(int(name))
        except OSError:
            continue
        try:
            found = stat_of(int(name))
            if found is not None and found[1] == parent:
                signal_fd(pidfd, signal.SIGKILL)
        finally:
            os.close(pidfd)


def end_outer(pidfd: int) -> None:
    """Stop the outer bwrap, kill its children (a pid 1 not reported yet), then it."""
    pid = pid_of(pidfd)
    if pid is not None:
        signal_fd(pidfd, signal.SIGSTOP)
        deadline = time.monotonic() + STOP_WAIT_S
        while (found := stat_of(pid)) is not None and found[0] not in "TtZX" and time.monotonic() < deadline:
            time.sleep(0.005)
        kill_children(pid)
    signal_fd(pidfd, signal.SIGKILL)


def write_quietly(path: str, value: str) -> bool:
    try:
        with open(path, "w") as handle:
            handle.write(value)
        return True
    except OSError:
        return False


def freeze(dirs: list[str]) -> None:
    """Stop everything in the sandbox's cgroups from forking: v2 kills at once, v1 freezes."""
    for path in dirs:
        if write_quietly(f"{path}/cgroup.kill", "1"):
            continue
        if write_quietly(f"{path}/freezer.state", "FROZEN"):
            deadline = time.monotonic() + FREEZE_WAIT_S
            while time.monotonic() < deadline:
                try:
                    with open(f"{path}/freezer.state") as handle:
                        if handle.read().strip() == "FROZEN":
                            break
                except OSError:
                    break
                time.sleep(0.005)


def kill_listed(dirs: list[str]) -> None:
    """SIGKILL every task left in the cgroups (v1 has no cgroup.kill), then thaw the freezer."""
    for _ in range(CGROUP_ROUNDS):
        found = False
        for path in dirs:
            try:
                with open(f"{path}/cgroup.procs") as handle:
                    pids = [int(word) for word in handle.read().split()]
            except (OSError, ValueError):
                continue
            for pid in pids:
                found = True
                quietly(os.kill, pid, signal.SIGKILL)
        for path in dirs:
            write_quietly(f"{path}/freezer.state", "THAWED")
        if not found:
            return
        time.sleep(ROUND_PAUSE_S)


def end_all(held: dict[str, Held]) -> None:
    dirs = [path for entry in held.values() for path in entry.cgroups]
    freeze(dirs)
    for entry in held.values():
        for pidfd in entry.inits:
            signal_fd(pidfd, signal.SIGKILL)
    for entry in held.values():
        if entry.outer is not None and entry.cgroups:
            signal_fd(entry.outer, signal.SIGKILL)  # what it made is in its cgroups (frozen: it would not stop)
        elif entry.outer is not None:
            end_outer(entry.outer)
    kill_listed(dirs)


def main() -> int:
    for number in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(number, signal.SIG_IGN)  # a terminal's signals are the server's business
    sock = _socket.socket(fileno=0)
    end_all(receive_until_end(sock))
    return 0


if __name__ == "__main__":
    sys.exit(main())
