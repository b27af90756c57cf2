"""A dead server's sandboxes, handed to its successor: what the successor receives and how it holds them.

A node agent's sessions are separate processes (their sandboxes, their kernels), so the agent's death need
not end them: its watcher (pid_watcher.py, told `handover`) ends at once only what the agent did not keep,
and waits a grace period on a socket in a host-only dir for a successor. The successor connects (`receive`),
gets every kept sandbox (its pidfds, the fds that keep it whole, the record its session wrote) and holds each
as its own: its own watcher is told of it (`PidWatcher.adopt`) before it answers "taken", so no moment passes
in which nothing would end it should the successor die too. A sandbox nobody takes in time ends as before.

Trust: both ends check the other is of their own uid (SO_PEERCRED), and the socket's dir is the host's alone
(no sandbox sees RUNTIME). What a record says is the dead agent's, never the sandbox's: the successor reads
nothing the sandbox could have written to learn what it adopts. A sandbox is ended by the pidfds it came with,
never by a pid or a path.

One idea: the successor's end of a hand-over, and a sandbox process known by its pidfds alone.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import logging
import os
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path

from anyio.abc import TaskGroup

from coderunner.hostfs.private_dirs import ensure_private_dir
from coderunner.sandbox import pid_watcher
from coderunner.sandbox.base import PidfdProcess, SandboxProcess
from coderunner.sandbox.bwrap_watch import process_watch
from coderunner.sandbox.cgroups import SessionCgroup
from coderunner.sandbox.pid1 import Gate, SandboxHold

log = logging.getLogger(__name__)

#: The host-only dir under RUNTIME that holds hand-over sockets.
HANDOVER_DIR = "handover"
#: Bound on receiving everything a predecessor's watcher sends (it sends at once: milliseconds).
RECEIVE_S = 10.0
_CRED = struct.Struct("3i")


def handover_path(runtime_dir: Path, name: str) -> Path:
    """Where the watcher of the process named `name` (an agent's Ray name) waits for its successor: short, so it
    fits a unix socket's path whatever RUNTIME is."""
    folder = runtime_dir / HANDOVER_DIR
    ensure_private_dir(folder, 0o700)
    return folder / hashlib.sha256(name.encode()).hexdigest()[:16]


@dataclass
class Handed:
    """One sandbox a predecessor's watcher handed over: its fds (this process's now), cgroups and record."""

    name: str
    outer: int
    inits: list[int]
    cgroups: list[Path]
    record: str
    fds: list[int] = field(default_factory=list)

    def close(self) -> None:
        """Let go of every fd it came with (a sandbox nobody holds then ends: its gate's writer is gone)."""
        for fd in (self.outer, *self.inits, *self.fds):
            with contextlib.suppress(OSError):
                os.close(fd)


def receive(path: Path, timeout_s: float = RECEIVE_S) -> tuple[socket.socket, list[Handed]] | None:
    """Connect to a predecessor's watcher waiting at `path` and receive what it kept; None if none waits there.
    The caller holds each sandbox (`hold`), then answers `taken` on the socket and closes it. Blocking."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
        pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        if uid != os.getuid():
            raise OSError(f"the process at {path} (pid {pid}) runs as uid {uid}, not as this one")
        handed: list[Handed] = []
        try:
            while True:
                data, fds = _message(sock)
                if data == pid_watcher.END:
                    return sock, handed
                entry = _entry(data.decode("utf-8", "replace"), fds)
                if entry is not None:
                    handed.append(entry)
        except BaseException:
            for entry in handed:
                entry.close()
            raise
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except OSError as exc:
        sock.close()
        log.warning("no hand-over from %s: %s", path, exc)
        return None


def taken(sock: socket.socket) -> None:
    """Tell the predecessor's watcher that what it sent is held here now (it then exits), and hang up."""
    with contextlib.suppress(OSError):
        sock.send(pid_watcher.TAKEN)
    sock.close()


def _message(sock: socket.socket) -> tuple[bytes, list[int]]:
    space = socket.CMSG_SPACE(4 * pid_watcher.MAX_FDS)
    data, ancillary, _flags, _address = sock.recvmsg(pid_watcher.MESSAGE_BYTES, space)
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
            fds += list(received)
    if not data and not fds:
        raise ConnectionError("the predecessor's watcher hung up before its end")
    return data, fds


def _entry(text: str, fds: list[int]) -> Handed | None:
    """One `entry ID INITS` message (pid_watcher.send_kept); None (its fds closed) if it is not one."""
    head, _, record = text.partition("\nrecord\n")
    lines = head.split("\n")
    words = lines[0].split(" ")
    try:
        inits = int(words[2]) if len(words) == 3 and words[0] == "entry" else -1
    except ValueError:
        inits = -1
    if inits < 0 or len(fds) < 1 + inits:
        for fd in fds:
            os.close(fd)
        return None
    cgroups = [Path(line[len("cgroup ") :]) for line in lines[1:] if line.startswith("cgroup ")]
    return Handed(words[1], fds[0], fds[1 : 1 + inits], cgroups, record, fds[1 + inits :])


def hold(
    handed: Handed, task_group: TaskGroup, gate_fd: int, cgroup: SessionCgroup | None,
    program: tuple[int, int, int] | None = None,
) -> SandboxProcess:  # fmt: skip
    """`handed` as one of this process's sandboxes: told to this process's watcher, kept whole as it was, ended
    by its pidfds (and `gate_fd`, the gate's write end among its fds: its init's end of file). `program`: (pid,
    pidfd, output read end) of a kernel forked into it from a template (not the sandbox's own child), followed as
    at its start. The caller answers `taken` after this. Raises OSError if the sandbox ended already or this
    process's watcher cannot be told of it."""
    pid = pid_watcher.pid_of(handed.outer)
    if pid is None or not handed.inits or pid_watcher.pid_of(handed.inits[0]) is None:
        raise ProcessLookupError(f"the handed sandbox {handed.name} has ended")
    watcher = process_watch().watcher
    entry = watcher.adopt(handed.outer, handed.inits, handed.cgroups, handed.record, handed.fds)
    sandbox = SandboxProcess(PidfdProcess(handed.outer, pid), task_group, cgroup=cgroup)
    sandbox.hold = SandboxHold(watcher, entry, handed.outer, Gate(-1, gate_fd), handed.inits[0])
    if program is not None:
        from coderunner.sandbox.template_kernels import PipeReceiveStream, follow_program  # bwrap's: loaded when used

        program_pid, pidfd, output_fd = program
        follow_program(sandbox, task_group, program_pid, pidfd, PipeReceiveStream(output_fd), None)
    return sandbox
