"""The pid 1 of a bwrap sandbox (bwrap --as-pid-1): the process that holds its pid namespace together.

    python -I -S sandbox_init.py GATE_FD -- ARGV...
    python -I -S sandbox_init.py GATE_FD --hold

(The host runs it as `python -I -S -c SANDBOX_INIT_BOOT GATE_FD ...`, sandbox/common.py: the same main, imported
from its compiled bytecode rather than compiled from source at every start.)

Why it exists: bwrap's own pid 1 runs as the sandbox's uid and is dumpable, so code in the sandbox
could open /proc/1/mem for writing and rewrite it (clear its parent-death signal, then loop forever),
keeping the namespace alive past everything the host did to bwrap. This init first makes itself
non-dumpable: /proc/1/mem, /proc/1/syscall and ptrace then need CAP_SYS_PTRACE, which nothing in the
sandbox has. Its command line names nothing of the host's watcher (the host keeps pidfds, not marks).

GATE_FD is a pipe whose only writer is the host (the server process). The init waits for one byte on
it before it starts ARGV: the host sends it once it holds a pidfd of this process (and its watcher
does too). End of file, before or after, means the host is gone: the init exits, and with it everything
in the namespace. It also exits as soon as ARGV's process does, with its status (128+signal if a
signal ended it), as bwrap's own init did; it reaps every orphan meanwhile.

With --hold it starts nothing: once the gate says go it writes READY on its stdout (bwrap built all of the
sandbox before it started this) and holds the sandbox, reaping, until the host goes away or kills it. A
kernel template's fork enters such a sandbox (sandbox/bwrap_template.py); what stood in its place before,
a shell saying ready and a sleep, cost three execs (about 2.3 CPU-ms and 200 page faults) a start.

Stdlib only (it runs with -I -S before anything else); one thread; every wait is on the gate or a child.
It is on the path of every sandbox start, so it imports the builtin halves (_signal, _ctypes) rather
than signal (which imports enum) and ctypes: about 8 ms less of a cold start.
"""

from __future__ import annotations

import _ctypes
import _signal as signal  # type: ignore[import-not-found]  # the C half of signal: no stubs
import os
import select
import sys

PR_SET_PDEATHSIG = 1
PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
#: Its name in /proc/1/comm and ps: what it is, not "python".
NAME = b"sandbox-init"
#: What the init exits with when it refuses to start ARGV (the host reads the reason on stderr).
REFUSED = 125
#: What it exits with when the host went away (the gate's end of file).
HOST_GONE = 137
#: What --hold writes on its stdout once the sandbox is finished.
READY = b"ready\n"


def say(line: str) -> None:
    os.write(2, f"sandbox init: {line}\n".encode())


class _Int(_ctypes._SimpleCData):
    _type_ = "i"


class _LibcCall(_ctypes.CFuncPtr):
    _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
    _restype_ = _Int


def seal() -> None:
    """Non-dumpable (nothing in the sandbox may write this process), and killed with bwrap's outer process."""
    this_program = _ctypes.dlopen(None, os.RTLD_NOW)  # type: ignore[arg-type]  # None: dlopen(NULL), libc included
    prctl = _LibcCall(_ctypes.dlsym(this_program, "prctl"))
    if prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
        say(f"cannot make pid 1 non-dumpable (errno {_ctypes.get_errno()}): not starting")
        sys.exit(REFUSED)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    prctl(PR_SET_NAME, NAME, 0, 0, 0)


def await_gate(gate: int) -> None:
    """Block until the host says go; exit if it went away first."""
    if os.read(gate, 1) != b"1":
        os._exit(HOST_GONE)


def start(argv: list[str], gate: int) -> int:
    """Fork ARGV with every signal at its default (what Python changed, and whatever the host's side left
    ignored: a server started under nohup, or by a harness that ignores SIGQUIT), and without the gate."""
    pid = os.fork()
    if pid == 0:
        try:
            os.close(gate)
            for number in signal.valid_signals():
                if number not in (signal.SIGKILL, signal.SIGSTOP):
                    signal.signal(number, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            os.execv(argv[0], argv)
        except OSError as exc:
            say(f"cannot start {argv[0]}: {exc}")
        os._exit(127)
    return pid


def status_of(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve(first: int | None, gate: int, wakeup: int) -> int:
    """Reap every child until `first` has exited (its status), or until the host went away (None: only that).

    poll, not select: the gate keeps the number it had in the server, which holds more than 1,024 fds
    with about a hundred sessions open (select then refused it, and the sandbox failed to start)."""
    waiting = select.poll()
    for fd in (gate, wakeup):
        waiting.register(fd, select.POLLIN)  # end of file (POLLHUP) is always reported too
    while True:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                if first is None:
                    break  # holding: no orphan to reap now
                return REFUSED  # cannot happen while `first` lives: it is our child
            if pid == 0:
                break
            if pid == first:
                return status_of(status)
        ready = {fd for fd, _ in waiting.poll()}
        if gate in ready and not os.read(gate, 1):
            return HOST_GONE
        if wakeup in ready:
            os.read(wakeup, 4096)


def main(args: list[str]) -> int:
    hold = args[1:] == ["--hold"]
    if not args or not args[0].isdigit() or not (hold or (len(args) >= 3 and args[1] == "--")):
        say("usage: sandbox_init.py GATE_FD (-- ARGV... | --hold)")
        return REFUSED
    gate, argv = int(args[0]), args[2:]
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)  # pid 1: ignored from inside, so code here cannot stop it
    seal()
    await_gate(gate)
    wakeup, notify = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(notify)
    signal.signal(signal.SIGCHLD, lambda number, frame: None)
    if hold:  # stdin and stdout stay open: the host reads READY, and an end of file would say it had exited
        os.write(1, READY)
        return serve(None, gate, wakeup)
    first = start(argv, gate)
    for fd in (0, 1):  # the program's stdin and stdout are its own: a pipe's end is not held open here
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, fd)
        os.close(null)
    return serve(first, gate, wakeup)


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))  # no interpreter teardown: nothing here to flush, and a start is on the clock
