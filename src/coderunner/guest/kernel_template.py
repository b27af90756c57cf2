"""The kernel template (issue 41): one warm process whose forks become kernels, each inside its own sandbox.

    python -P -m coderunner_guest.kernel_template SOCKET_FD SECCOMP_FD [--no-freeze] [--no-preload]
        [--child-code CODE]

It imports what a kernel and a first chart need (warm_imports.py's steps, ipykernel, and what a kernel's start
imports after ipykernel: KERNEL_START_IMPORTS, its debugger above all; with --no-preload, the server's
preload_imports off, not numpy, pandas and matplotlib), parses the kernel's command line and builds its shell
(kernel_ahead.py: each fork adopts them), freezes its GC (a child's collections then leave the template's objects,
and the pages they sit on, shared), and serves fork requests on SOCKET_FD, a socketpair whose other end only the
host holds. It reads nothing else (the host's one page plan is addresses it checks against its own mappings): no
sandbox ever writes to it, and it never runs user code. A request is fixed-size plain data (REQUEST) with fds beside
it: a pidfd of the target sandbox's pid 1, the fd the kernel's stdout and stderr go to, the read end of the host's
"go" pipe, the write end of the fork's report pipe, (with FLAG_STATUS_FD) a pipe the kernel's wait status is written
to once it is reaped (the host's only way to learn its exit code), then the sandbox's cgroup join files
(SessionCgroup.join_files). Each fork is made straight into that sandbox's pid namespace (the template points its
next child there, forks, and points it back at once) and answered at once with its pid and a pidfd: the template is
free for the next request. The fork joins the sandbox's cgroups, copies the pages its kernel will write to anyway
(page_plan.py: a list of the template's own pages the host sent once, KIND_PLAN), then waits for "go", which the
host sends once the sandbox is finished (its init said so; the fork is made while bwrap still builds it, so neither
waits for the other), enters the sandbox's other namespaces (sandbox_enter.py: join, confine), says so on its report
pipe (an errno if it could not: it exits) and then runs the kernel as kernel/process.py's argv does (kernel_boot,
the connection file the sandbox holds privately), or CODE where the host gave one (the bench's probe). Before "go"
it runs nothing but those few syscalls; the end of the go pipe (the host gone, a start abandoned) ends it, as does
the sandbox's end (it is in the sandbox's pid namespace).

One fork a kernel: it was two (a first child joined all the namespaces and forked again into the pid one), and a
fork of this process (about 110 MiB) and the end of the first child cost about 3 ms each. The kernels are the
template's own children, outside their sandboxes' init's reach; it reaps them as they exit.

SECCOMP_FD holds the program bwrap loads with --seccomp (read once). The template runs as the host's root
(with its capabilities, in a mount namespace of its own whose view is the sandbox's read-only part); it is
started by sandbox/bwrap_template.py, whose wire format (REQUEST, REPLY) must stay the same as this one's.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import os
import select
import signal
import socket
import struct
import sys
import threading
from typing import NoReturn

from . import page_plan
from .sandbox_enter import (
    Confinement,
    back_to_own_pid_namespace,
    close_fds_but,
    confine,
    into_pid_namespace,
    join,
    join_cgroups,
)

#: magic, kind, uid, gid, flags, memory bytes (0: none), nproc (0: none), environment ("\0"-joined KEY=VALUE).
REQUEST = struct.Struct("<4sIIIIQQ2048s")
#: magic, error (0 or an errno), pid (of the kernel, in the template's pid namespace), then two counters
#: (CPU µs of the template itself and of its reaped children) and the template's thread count; a fork's reply
#: carries a pidfd of the kernel beside it.
REPLY = struct.Struct("<4siiQQI")
MAGIC = b"KTR2"
KIND_FORK = 1
#: Asks only for the counters (a bench's CPU per start).
KIND_COUNTERS = 2
#: Hands the template the pages its forks copy ahead (page_plan.py): one fd beside it, a memfd of addresses; the
#: reply's pid field says how many pages it kept.
KIND_PLAN = 3
FLAG_MEMORY_SOFT_ONLY = 1
#: The request's fifth fd is the kernel's status pipe (the wait status, 4 bytes, once it is reaped).
FLAG_STATUS_FD = 2
#: What a fork says on its report pipe once it entered and confined itself: 0, or a negative errno (it exits).
REPORT = struct.Struct("<q")
#: A fork request's fds before the status pipe and the cgroups: the sandbox's pid 1, output, go, report.
FORK_FDS = 4
#: pidfd, the kernel's stdout and stderr, go, report, its status pipe, then at most this many cgroup join files.
MAX_CGROUP_FDS = 8
#: What the kernel runs as by default: today's argv (kernel/process.py) after its launcher (kernel_boot).
KERNEL_ARGS = (
    "-f", "/run/kernel/connection.json", "--HistoryManager.hist_file=:memory:",
    "--IPKernelApp.quiet=True", "--IPKernelApp.extensions=coderunner_guest", "--Kernel._execute_sleep=0",
)  # fmt: skip
#: Bound on a fork's wait for "go" (the host's own bound on a start is shorter: sandbox/bwrap_template.py).
GO_TIMEOUT_S = 60.0
#: The kernel's exit code when it could not enter or confine itself (nothing ran).
REFUSED = 126
#: The kernel's exit code when the template's imports are not what its own would find (nothing ran); before it
#: exits it writes STALE_PREFIX and why on its stderr, at most STALE_REASON_BYTES.
STALE = 123
STALE_PREFIX = "kernel template: imports not current: "
STALE_REASON_BYTES = 1024
PR_SET_NAME = 15
NAME = b"kernel-template"
_libc = ctypes.CDLL(None, use_errno=True)


#: What a kernel imports while it starts and runs its first cell, beyond ipykernel's modules: its debugger (debugpy
#: with pydevd, about 75 ms of CPU: most of a forked kernel's start, bench/start_breakdown.py), what its shell,
#: history and extensions load, the guest's extension (kernel_boot's IPKernelApp.extensions), and psutil, which
#: jupyter_client imports to list the machine's addresses (the list itself is the fork's: its own network), and the
#: kernel's launcher (kernel_boot: its main runs in the fork; only its import is ahead).
#: Imported once here, from the sandbox's read-only view; a module that fails is left for the kernel to import as a
#: cold one does.
#: Not tornado.platform.asyncio (the kernel's event loop's own module, a few ms): with it here, the interrupt of
#: tests/abuse/test_abuse.py's infinite loop was ignored in runs at load 15 (no cause found; it passed at load 10).
KERNEL_START_IMPORTS = (
    "faulthandler", "tornado.locks", "tornado.queues", "ipykernel.debugger",
    "IPython.core.debugger", "IPython.core.oinspect", "sqlite3", "IPython.core.completerlib",
    "IPython.extensions.storemagic", "IPython.core.magics.packaging", "IPython.core.logger",
    "coderunner_guest.figures", "coderunner_guest.installs", "coderunner_guest.output", "coderunner_guest.kernel_boot",
    "psutil", "jupyter_client.localinterfaces",
)  # fmt: skip


def warm(preload: bool = True) -> None:
    """What a kernel's start and a first chart cost, paid once: the caches, the common imports (unless not
    `preload`: the server's preload_imports), ipykernel, and what the kernel's start imports after it
    (KERNEL_START_IMPORTS)."""
    import importlib

    from .caches import seed
    from .warm_imports import run

    seed()
    if preload:
        run()
    import ipykernel.ipkernel
    import ipykernel.kernelapp  # noqa: F401 (imported for sys.modules: a fork finds them there)

    from . import kernel_ahead

    for name in KERNEL_START_IMPORTS:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    # Every fork's kernel has the same command line (KERNEL_ARGS): parsed here once, and the kernel's shell built
    # from it (kernel_ahead.py); a failure leaves each fork to do both itself, as a cold kernel does.
    with contextlib.suppress(Exception):
        kernel_ahead.prepare(list(KERNEL_ARGS))
    kernel_ahead.answer_abcs()
    kernel_ahead.note_modules()  # last: every module above is in it


def counters() -> tuple[int, int]:
    """CPU µs of this process, and of its reaped children (the forks and the kernels)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return int((own.ru_utime + own.ru_stime) * 1e6), int((children.ru_utime + children.ru_stime) * 1e6)


def reply(sock: socket.socket, error: int = 0, pid: int = 0, pidfd: int | None = None) -> None:
    """One reply; a fork's carries a pidfd of its kernel (opened before the template could reap it: no reuse)."""
    own, children = counters()
    data = REPLY.pack(MAGIC, error, pid, own, children, threading.active_count())
    socket.send_fds(sock, [data], [pidfd] if pidfd is not None else [])


def parse_environment(blob: bytes) -> dict[str, str]:
    pairs = [item.decode() for item in blob.rstrip(b"\0").split(b"\0") if item]
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair)


def reap(statuses: dict[int, int]) -> None:
    """Every exited child (the kernels, and forks that refused), without waiting; a kernel's wait status goes
    to its status pipe (`statuses`: kernel pid -> the pipe's write end, closed once written)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        said = statuses.pop(pid, None)
        if said is not None:
            with contextlib.suppress(OSError):
                os.write(said, struct.pack("<i", status))
            os.close(said)


def fork_kernel(request: tuple, fds: list[int], seccomp: bytes, code: str | None, own_pidfd: int) -> tuple[int, int]:
    """Fork into the sandbox's pid namespace; the fork waits for "go", then enters the rest and confines itself.
    (0, kernel pid) or (errno, 0). Should the template's own pid namespace not come back, it exits: no later fork
    may go astray."""
    _, _, uid, gid, flags, memory, nproc, blob = request
    confinement = Confinement(
        uid=uid, gid=gid, seccomp=seccomp, environment=parse_environment(blob),
        memory_bytes=memory or None, memory_soft_only=bool(flags & FLAG_MEMORY_SOFT_ONLY), nproc=nproc or None,
    )  # fmt: skip
    pidfd, output, go, report = fds[:FORK_FDS]
    cgroups = tuple(fds[FORK_FDS + 1 :] if flags & FLAG_STATUS_FD else fds[FORK_FDS:])
    try:
        into_pid_namespace(pidfd)
    except OSError as exc:
        return (exc.errno or errno.EIO, 0)
    try:
        kernel = os.fork()
    except OSError as exc:
        kernel = -(exc.errno or errno.EIO)
    if kernel == 0:
        _kernel(pidfd, output, go, cgroups, report, confinement, code)
    try:
        back_to_own_pid_namespace(own_pidfd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.write(2, f"kernel template: {exc}: exiting\n".encode())
        os._exit(1)
    return (-kernel, 0) if kernel < 0 else (0, kernel)


def refuse(output: int, report: int, what: str, exc: OSError) -> NoReturn:
    """Say why on the kernel's stderr and to the host (a negative errno), and exit: nothing ran."""
    with contextlib.suppress(OSError):
        os.write(output, f"kernel template: a fork {what}: {exc}\n".encode())
        os.write(report, REPORT.pack(-(exc.errno or errno.EIO)))
    os._exit(REFUSED)


def await_go(go: int) -> None:
    """Until the host says "go" (one byte); its end of file or GO_TIMEOUT_S first: exit, nothing ran."""
    waiting = select.poll()
    waiting.register(go, select.POLLIN)
    if not waiting.poll(GO_TIMEOUT_S * 1000) or os.read(go, 1) != b"1":
        os._exit(REFUSED)
    os.close(go)


def _kernel(
    pidfd: int, output: int, go: int, cgroups: tuple[int, ...], report: int, confinement: Confinement,
    code: str | None,
) -> NoReturn:  # fmt: skip
    """Made in the sandbox's pid namespace: join its cgroups, wait for "go", join the rest of the sandbox,
    confine, say so, then run the kernel (or `code`); never returns."""
    try:
        close_fds_but((pidfd, output, go, report, *cgroups))
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the template's; the rest are any interpreter's own
        join_cgroups(cgroups)
        close_fds_but((pidfd, output, go, report))
        page_plan.prefault()  # the pages its kernel will copy anyway, charged to its sandbox, while bwrap builds it
        await_go(go)
        join(pidfd)
        close_fds_but((output, report))
        confine(confinement)
        # Only now, as the sandbox's user, a path of the sandbox's is opened (its /dev/null; never waits).
        null = os.open("/dev/null", os.O_RDONLY | os.O_NONBLOCK)
        os.set_blocking(null, True)  # as an exec'd kernel's stdin
        for fd, source in ((0, null), (1, output), (2, output)):
            os.dup2(source, fd)
        for fd in {output, null} - {0, 1, 2}:
            os.close(fd)
        _reseed()
    except OSError as exc:
        refuse(output if output > 2 else 2, report, "could not enter or confine itself", exc)
    os.write(report, REPORT.pack(0))
    os.close(report)
    # The template is free from here. Nothing it imported may be handed over as the user's imports unless it is
    # what they would find: if not, say why and exit; the host starts the kernel cold (kernel/incarnation.py).
    if code is None and (stale := stale_imports()) is not None:
        with contextlib.suppress(OSError):
            os.write(2, f"{STALE_PREFIX}{stale}\n".encode(errors="replace")[:STALE_REASON_BYTES])
        os._exit(STALE)
    try:
        _run(code)
    except BaseException:  # never back into the template's own code (its serve loop), whatever ended the kernel
        with contextlib.suppress(BaseException):
            import traceback

            traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _run(code: str | None) -> None:
    """The kernel, or `code` (tests'), in a fork that entered and confined itself."""
    if code is not None:
        exec(compile(code, "<kernel-template child>", "exec"), {"__name__": "__main__"})
        return
    # What `python -P -m coderunner_guest.kernel_boot ARGS` does (kernel/process.py's argv, KERNEL_LAUNCHER):
    # -P kept '' off sys.path here too.
    sys.argv = ["kernel_boot", *KERNEL_ARGS]
    from . import kernel_boot

    kernel_boot.main()


def stale_imports() -> str | None:
    """Why what the template imported ahead is not what this kernel's own imports would find now (a module of
    that name in its workspace or its session's packages, another matplotlibrc), or None. Run as the sandbox's
    user with its environment and working directory, on the import path the kernel's extension gives user code
    (user_paths): it looks (a path finder's search, a stat), it runs nothing of the sandbox's."""
    import importlib

    from . import user_paths
    from .warm_imports import still_current

    try:
        importlib.invalidate_caches()
        user_paths()
        still_current()
    except Exception as exc:  # any failure of the check means: do not hand these modules over
        return f"{type(exc).__name__}: {exc}"
    return None


def _reseed() -> None:
    """What a fork shares with its template and must not with its siblings: random generators' states.
    (random reseeds itself at a fork; secrets and os.urandom draw from the kernel.)"""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def serve(sock: socket.socket, seccomp: bytes, code: str | None) -> None:
    """Answer requests until the host closes its end; reap kernels meanwhile."""
    statuses: dict[int, int] = {}
    own_pidfd = os.pidfd_open(os.getpid())  # what each fork's pid namespace is pointed back to
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda number, frame: None)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(wake_read, select.POLLIN)
    while True:
        ready = {fd for fd, _ in poller.poll()}
        if wake_read in ready:
            while True:
                try:
                    if not os.read(wake_read, 4096):
                        break
                except BlockingIOError:
                    break
            reap(statuses)
        if sock.fileno() not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(sock, REQUEST.size, FORK_FDS + 1 + MAX_CGROUP_FDS)
        if not message:
            return
        try:
            if len(message) != REQUEST.size or message[:4] != MAGIC:
                reply(sock, errno.EPROTO)
                continue
            request = REQUEST.unpack(message)
            if request[1] == KIND_COUNTERS:
                reply(sock)
            elif request[1] == KIND_PLAN and len(fds) == 1:
                try:
                    reply(sock, 0, page_plan.take(fds[0]))
                except (OSError, ValueError):
                    reply(sock, errno.EINVAL)
            elif request[1] == KIND_FORK and len(fds) >= FORK_FDS + (1 if request[4] & FLAG_STATUS_FD else 0):
                error, pid = fork_kernel(request, fds, seccomp, code, own_pidfd)
                kernel = os.pidfd_open(pid) if pid else None  # its child, not reaped before this loop's next turn
                if pid and request[4] & FLAG_STATUS_FD:
                    statuses[pid] = os.dup(fds[FORK_FDS])  # kept (the request's fds are closed below) until reaped
                try:
                    reply(sock, error, pid, kernel)
                finally:
                    if kernel is not None:
                        os.close(kernel)
            else:
                reply(sock, errno.EINVAL)
        finally:
            for fd in fds:
                os.close(fd)


def main(args: list[str]) -> int:
    if len(args) < 2 or not args[0].isdigit() or not args[1].isdigit():
        usage = "SOCKET_FD SECCOMP_FD [--no-freeze] [--no-preload] [--child-code CODE]"
        print(f"usage: kernel_template.py {usage}", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=int(args[0]))
    with os.fdopen(int(args[1]), "rb") as handle:
        seccomp = handle.read()
    code = args[args.index("--child-code") + 1] if "--child-code" in args else None
    _libc.prctl(PR_SET_NAME, NAME, 0, 0, 0)
    warm(preload="--no-preload" not in args)
    gc.collect()
    if "--no-freeze" not in args:
        gc.freeze()
    try:
        reply(sock, 0, os.getpid())  # ready
        serve(sock, seccomp, code)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the host went away (a server that closed while this warmed up): there is no one left to answer
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
