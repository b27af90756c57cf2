"""The process that ends a server's bwrap sandboxes once that server is gone, by handles the sandbox cannot change.

Run as a script by bwrap_watch.py, one per server process, in a session of its own. Its stdin is one
end of a SOCK_SEQPACKET pair whose other end only the server holds. For every sandbox the server sends,
before the sandbox may start anything (a gate holds it):

    add ID [cgroup DIR]...   + fds: a pidfd of the process it spawned (the outer bwrap, pid kept
                               through its execs) and the read end of bwrap's --info-fd pipe
    init ID                  + fd:  a pidfd of the sandbox's pid 1 (bwrap's "child-pid"); the info
                               pipe is closed then
    drop ID                  the sandbox is dead and reaped: close its fds
    keep ID + RECORD         + fds: what keeps the sandbox alive and its session whole once the server is
                               gone (the gate's write end, locks), and a record of it (plain text, the
                               server's); sent again when the record changes (the fds then replace the last)
    handover GRACE + PATH    on the server's end, hand every kept sandbox to a successor (handover.py)

End of file means the server is gone, however it went. Then, for every sandbox still held: its cgroups
are frozen (v1 freezer) or killed whole (v2 cgroup.kill); its pid 1 gets SIGKILL through its pidfd,
which ends everything in its pid namespace whatever that init's argv or death signal says; the outer
bwrap is killed (without cgroups it is stopped first, and its children, a pid 1 the server had not been
told of yet, are killed by pidfd); what is left in the cgroups is killed, and they are thawed.
Nothing here reads a path or a command line the sandbox can write: a pidfd never names a reused pid,
and the cgroup dirs are the host's. It holds the info pipe's read end too, though bwrap no longer needs a
reader besides itself: its --info-fd is read-write (bwrap_fds.py), so a report nobody reads never kills
it with SIGPIPE, which left its child blocked for ever once this watcher was gone as well.

With `handover` said (a node agent: its sessions outlive it, for a successor to adopt), what was not kept is
ended at once, as above, and the kept ones wait: this process listens on PATH (a socket in a host-only dir)
for GRACE seconds. The first process of its own uid to connect is sent every kept sandbox (its fds and
record); once it answers "taken" they are its own and this process exits. With no successor in time (or
one that hung up before it answered) they are ended too.

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
#: Largest message and most fds the server sends in one (a hand-over sends an entry's pidfds and kept fds).
MESSAGE_BYTES = 65536
MAX_FDS = 8
#: Bound on a successor taking what it was sent ("taken"), once connected.
TAKEN_WAIT_S = 30.0
#: The answer a successor sends once what it was handed is its own.
TAKEN = b"taken"
#: The last message of a hand-over.
END = b"end"
#: A hand-over's listening socket: a path this long at most (sun_path less its NUL).
MAX_PATH_BYTES = 107
#: SOL_SOCKET / SCM_RIGHTS (the same on every Linux architecture).
SCM_RIGHTS = 1


class Held:
    """One sandbox's handles: pidfds (outer, init), other fds kept open while it starts, its cgroup dirs;
    and once kept, the fds that keep it whole without its server and its record."""

    def __init__(self) -> None:
        self.outer: int | None = None
        self.inits: list[int] = []
        self.kept: list[int] = []
        self.cgroups: list[str] = []
        self.record: str | None = None
        self.whole: list[int] = []

    def keep(self, record: str, fds: list[int]) -> None:
        for fd in self.whole:
            quietly(os.close, fd)
        self.record, self.whole = record, fds

    def close(self) -> None:
        for fd in [*([self.outer] if self.outer is not None else []), *self.inits, *self.kept, *self.whole]:
            quietly(os.close, fd)


class Handover:
    """Where and how long a server's kept sandboxes wait for a successor once it is gone (None: not at all)."""

    def __init__(self, grace_s: float, path: str) -> None:
        self.grace_s = grace_s
        self.path = path


def fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The fds an SCM_RIGHTS message carried (native-endian C ints)."""
    fds = []
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds += [int.from_bytes(data[at : at + 4], sys.byteorder, signed=True) for at in range(0, usable, 4)]
    return fds


def apply(held: dict[str, Held], text: str, fds: list[int], plan: list[Handover]) -> None:
    """One message from the server (see the module docstring); fds it does not expect are closed. A
    `handover` message puts its plan in `plan` (the last said counts)."""
    lines = text.split("\n")
    verb, _, name = lines[0].partition(" ")
    extra = list(fds)
    if verb == "keep" and name in held:
        held[name].keep(text.partition("\n")[2], fds)
        extra = []
    elif verb == "handover" and len(lines) == 2:
        grace_s = float(name) if name.replace(".", "", 1).isdigit() else -1.0
        if grace_s >= 0:
            plan[:] = [Handover(grace_s, lines[1])]
    elif verb == "add" and len(fds) >= 1:
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


def receive_until_end(sock: _socket.socket, plan: list[Handover]) -> dict[str, Held]:
    """Every message until the server's end closes; what is held then (and in `plan`, a hand-over's)."""
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
        apply(held, data.decode("utf-8", "replace"), fds, plan)


def quietly(call: Callable[..., object], *args: int | str) -> bool:
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


def hand_over(kept: dict[str, Held], plan: Handover) -> bool:
    """Wait up to the plan's grace for a successor on its socket and send it `kept`; True once it took them."""
    path = plan.path
    if not kept or len(path.encode()) > MAX_PATH_BYTES:
        return False
    listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    try:
        quietly(os.unlink, path)  # a socket left by a predecessor's watcher (the dir is the host's alone)
        listener.bind(path)
        listener.listen(1)
        deadline = time.monotonic() + plan.grace_s
        while (left := deadline - time.monotonic()) > 0:
            listener.settimeout(left)
            try:
                fd, _address = listener._accept()  # type: ignore[attr-defined]  # the builtin socket's: this file imports builtin modules only
            except OSError:  # TimeoutError included: no successor in time
                return False
            conn = _socket.socket(fileno=fd)
            try:
                if peer_uid(conn) == os.getuid() and send_kept(conn, kept):
                    return True
            finally:
                conn.close()
        return False
    except OSError:
        return False
    finally:
        listener.close()
        quietly(os.unlink, path)


def peer_uid(conn: _socket.socket) -> int | None:
    """The uid of the process at the other end (SO_PEERCRED: pid, uid, gid as native ints)."""
    try:
        cred = conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
    except OSError:
        return None
    return int.from_bytes(cred[4:8], sys.byteorder, signed=True)


def send_kept(conn: _socket.socket, kept: dict[str, Held]) -> bool:
    """Every kept sandbox (`entry ID INITS`, its cgroups, its record; fds outer, inits, kept fds), the end, then
    the successor's answer: True once it said it took them."""
    conn.settimeout(TAKEN_WAIT_S)
    try:
        for name, entry in kept.items():
            if entry.outer is None or entry.record is None:
                continue
            header = [f"entry {name} {len(entry.inits)}", *(f"cgroup {path}" for path in entry.cgroups), "record"]
            text = "\n".join(header) + "\n" + entry.record
            fds = [entry.outer, *entry.inits, *entry.whole]
            conn.sendmsg([text.encode()], [(_socket.SOL_SOCKET, SCM_RIGHTS, fd_bytes(fds))])
        conn.sendmsg([END])
        return conn.recv(len(TAKEN)) == TAKEN
    except OSError:
        return False


def fd_bytes(fds: list[int]) -> bytes:
    return b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in fds)


def finish(held: dict[str, Held], plan: list[Handover]) -> None:
    """The server is gone: end what it held, or (with a hand-over) what it did not keep at once and the kept
    ones unless a successor took them."""
    kept = {name: entry for name, entry in held.items() if entry.record is not None}
    if not plan or not kept:
        end_all(held)
        return
    end_all({name: entry for name, entry in held.items() if name not in kept})
    if not hand_over(kept, plan[0]):
        end_all(kept)


def main() -> int:
    for number in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(number, signal.SIG_IGN)  # a terminal's signals are the server's business
    sock = _socket.socket(fileno=0)
    plan: list[Handover] = []
    finish(receive_until_end(sock, plan), plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
