"""A process's bwrap sandboxes end with it, however it ends: its watcher holds a pidfd of each.

The host ends a sandbox by handles the sandbox cannot change: a pidfd of the process it spawned (the
outer bwrap) and one of the sandbox's pid 1, and its cgroups. While the server lives, it kills them
itself (SandboxProcess.kill). Should it die (SIGKILL, OOM, a crash), its watcher (pid_watcher.py, one
process per server process, in a session of its own) finds the end of its socket and kills what it
holds. The server hands each handle over before the sandbox may go on (a gate holds it), so even a
server killed half-way through a start leaves nothing running. No mark in a command line: the sandbox
could rewrite its pid 1's (issue 38). slirp4netns gets `--exit-fd` on `lifeline`, a pipe whose only
writer is this process. One watcher per process, not per backend: a process may make many backends
(the tests do), and their sandboxes all die with it.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from coderunner.sandbox import pid_watcher

log = logging.getLogger(__name__)

#: The watcher's whole environment (it runs nothing but the interpreter and reads /proc).
WATCHER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
#: Bound on handing the watcher one message (it reads them as they come: milliseconds).
SEND_TIMEOUT_S = 5.0


class WatchUnavailable(OSError):
    """The watcher could not be told of a sandbox: the sandbox must not start."""


@dataclass
class _Entry:
    """What the watcher was told of one sandbox, kept to tell a restarted watcher again. The pidfds are the
    caller's (SandboxHold's): open until it calls forget, which is before it closes them. What `keep` sent
    (its record and the dups of its fds) is this entry's own, closed when it is forgotten or kept anew."""

    fds: list[int]
    cgroups: list[str]
    inits: list[int] = field(default_factory=list)
    record: str | None = None
    whole: list[int] = field(default_factory=list)

    def close_whole(self) -> None:
        for fd in self.whole:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.whole = []


class PidWatcher:
    """The server's end of its watcher: starts it, restarts it (telling it everything again), talks to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._entries: dict[str, _Entry] = {}
        #: (grace, socket path) once hand_over_on_exit was asked: said again to a restarted watcher.
        self._handover: tuple[float, Path] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def hand_over_on_exit(self, path: Path, grace_s: float) -> None:
        """Should this process end, hand the sandboxes it kept (`keep`) to the first process of its uid that
        connects to `path` within `grace_s` (handover.py); what it did not keep still ends at once."""
        with self._lock:
            self._handover = (grace_s, path)
            self._ensure_running()
            self._send(f"handover {grace_s:g}\n{path}", [])

    def keep(self, name: str, record: str, fds: list[int]) -> None:
        """Keep sandbox `name` whole should this process end: the watcher holds `fds` (dups: the caller keeps its
        own) and `record` for a successor (hand_over_on_exit). Sent again, they replace the last."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return  # forgotten meanwhile: its sandbox is gone
            whole = [os.dup(fd) for fd in fds]
            entry.close_whole()
            entry.record, entry.whole = record, whole
            self._ensure_running()
            self._send_keep(name, entry)

    def adopt(self, outer_pidfd: int, inits: list[int], cgroups: list[Path], record: str, fds: list[int]) -> str:
        """Hold a sandbox handed over by a dead predecessor's watcher as one of this process's, kept as it was
        (its pidfds and `fds` stay the caller's); its id."""
        name = self.add(outer_pidfd, [], cgroups)
        for init in inits:
            self.add_init(name, init)
        self.keep(name, record, fds)
        return name

    def add(self, outer_pidfd: int, kept: list[int], cgroups: list[Path]) -> str:
        """Tell the watcher of a sandbox just spawned (its outer pidfd, fds for it to keep open until the
        sandbox's pid 1 is known, its cgroup dirs); its id. The caller keeps `outer_pidfd` open until
        `forget`. `kept` is sent once, not again to a restarted watcher (it matters only while bwrap starts)."""
        name = secrets.token_hex(8)
        entry = _Entry([outer_pidfd], [str(path) for path in cgroups])
        with self._lock:
            self._ensure_running()
            self._send_entry(name, entry, kept)
            self._entries[name] = entry  # only once told: the caller closes its fds if this raised
        return name

    def add_init(self, name: str, init_pidfd: int) -> None:
        """Tell the watcher of the sandbox's pid 1."""
        with self._lock:
            entry = self._entries[name]
            entry.inits.append(init_pidfd)
            self._ensure_running()
            self._send(f"init {name}", [init_pidfd])

    def forget(self, name: str) -> None:
        """The sandbox is dead and reaped: the watcher and this process close its fds."""
        with self._lock:
            entry = self._entries.pop(name, None)
            if entry is None:
                return
            entry.close_whole()
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._send(f"drop {name}", [])

    def _send_entry(self, name: str, entry: _Entry, kept: list[int] | None = None) -> None:
        lines = [f"add {name}", *(f"cgroup {path}" for path in entry.cgroups)]
        self._send("\n".join(lines), [*entry.fds, *(kept or [])])
        for init in entry.inits:
            self._send(f"init {name}", [init])
        if entry.record is not None:
            self._send_keep(name, entry)

    def _send_keep(self, name: str, entry: _Entry) -> None:
        assert entry.record is not None
        self._send(f"keep {name}\n{entry.record}", entry.whole)

    def _send(self, text: str, fds: list[int]) -> None:
        assert self._sock is not None
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            self._sock.sendmsg([text.encode()], ancillary)
        except OSError as exc:
            raise WatchUnavailable(f"could not hand the sandbox to its watcher: {exc}") from exc

    def _ensure_running(self) -> None:
        """Start the watcher if it is not running (first sandbox, or it died: then it is told everything)."""
        if self._process is not None and self._process.poll() is None:
            return
        if self._process is not None:
            log.warning("the sandbox watcher exited (code %s); starting another", self._process.returncode)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # both close-on-exec
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", pid_watcher.__file__],
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                # Not the server's stderr: a client that waits for its end would wait for the watcher.
                stderr=subprocess.DEVNULL,
                env=WATCHER_ENV,
                cwd="/",
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.settimeout(SEND_TIMEOUT_S)
        self._sock = mine
        if self._handover is not None:
            self._send(f"handover {self._handover[0]:g}\n{self._handover[1]}", [])
        for name, entry in self._entries.items():
            self._send_entry(name, entry)


@dataclass(frozen=True)
class ProcessWatch:
    """This process's watcher, and the read end of its lifeline (slirp4netns --exit-fd)."""

    pid: int
    watcher: PidWatcher
    lifeline: int


_lock = threading.Lock()
_current: ProcessWatch | None = None


def process_watch() -> ProcessWatch:
    """This process's, made on first use (a forked child makes its own)."""
    global _current
    with _lock:
        if _current is None or _current.pid != os.getpid():
            # Close-on-exec both: no child holds the write end, which is never closed (EOF = we are gone).
            lifeline, _writer = os.pipe()
            _current = ProcessWatch(os.getpid(), PidWatcher(), lifeline)
        return _current
