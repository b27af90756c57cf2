"""Entering a bwrap sandbox that bwrap already built: how a fork of the kernel template becomes a process of
that one sandbox and of nothing else (issue 41, route A: "fork, then enter").

Runs in the template's forked children (guest/kernel_template.py), so stdlib and ctypes only. Two halves:

- `into_pid_namespace` (in the template, just before its fork): setns on a pid namespace moves only the caller's
  children, so the template points its next fork into the sandbox's, forks, and points its own back at once
  (`back_to_own_pid_namespace`); one fork, the kernel, is made straight into the sandbox's pid namespace.
- `join_cgroups` (in that fork, still the template's root user on the host, while bwrap may still build the
  sandbox): no supplementary groups, into the sandbox's cgroups.
- `join` (in that fork, once the host said the sandbox is finished): setns on a pidfd of the sandbox's pid 1 with
  all seven namespaces at once. The kernel
  installs the user namespace first (the innermost one: bwrap's --disable-userns nests a second) and checks the
  others against the caller's rights from before, so a pid 1 that died meanwhile fails the call (ESRCH) rather
  than naming some other process.
- `confine` (in that fork, now inside the sandbox's namespaces): what bwrap does to its own child after it built the
  mounts, in its order: a new session, the sandbox's uid and gid, no capability in any set (bounding and ambient
  included), the rlimits prlimit would set, the sandbox's environment, its working directory, no_new_privs, and
  the very seccomp program bwrap loads with --seccomp (it denies setns, unshare, mount and ptrace: it goes
  last but one). Last, dumpable again, as any exec'd process of the sandbox's user is.

Every failure raises OSError: the caller exits without running anything.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
from dataclasses import dataclass

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
#: Every namespace bwrap --unshare-all --unshare-user gives a sandbox.
SANDBOX_NAMESPACES = (
    CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP | CLONE_NEWPID
)

PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
PR_SET_SECCOMP = 22
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECCOMP_MODE_FILTER = 2
LINUX_CAPABILITY_VERSION_3 = 0x20080522
#: One classic BPF instruction (struct sock_filter).
BPF_INSTRUCTION_BYTES = 8
#: What the sandbox's pid 1 calls itself once it runs (guest/sandbox_init.py's NAME).
INIT_NAME = b"sandbox-init"

_libc = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _check(result: int, what: str) -> int:
    if result == -1:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")
    return result


def _prctl(option: int, arg: int = 0, what: str = "prctl") -> int:
    return _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), what)


@dataclass(frozen=True)
class Confinement:
    """What the sandbox's own processes have and the entered one must have too (bwrap_argv.py's flags)."""

    uid: int
    gid: int
    #: The seccomp program bwrap loads (--seccomp): classic BPF, 8 bytes an instruction.
    seccomp: bytes
    environment: dict[str, str]
    workdir: str = "/workspace"
    #: RLIMIT_AS in bytes (None: none); `memory_soft_only` as prlimit --as=N:unlimited (a memory cgroup bounds it).
    memory_bytes: int | None = None
    memory_soft_only: bool = False
    #: RLIMIT_NPROC (None: none).
    nproc: int | None = None
    #: Its name in /proc/PID/comm (the template's name is not the kernel's).
    name: bytes = b"python"


def into_pid_namespace(pidfd: int) -> None:
    """The caller's next children are made in the pid namespace of `pidfd`'s process (the caller stays in its own)."""
    _check(_libc.setns(pidfd, CLONE_NEWPID), "setns into the sandbox's pid namespace, for the fork")


def back_to_own_pid_namespace(own_pidfd: int) -> None:
    """The caller's next children are made in its own pid namespace again (`own_pidfd`: a pidfd of itself)."""
    _check(_libc.setns(own_pidfd, CLONE_NEWPID), "setns back into the template's own pid namespace")


def join_cgroups(cgroup_joins: tuple[int, ...]) -> None:
    """Into the sandbox's cgroups (`cgroup_joins`: its join files, which move the writing thread; a fresh fork is
    single-threaded), with the host's supplementary groups dropped first (an unprivileged sandbox's user namespace
    denies setgroups later)."""
    os.setgroups([])
    for fd in cgroup_joins:
        os.write(fd, b"0")  # "0": the writer itself, into that controller's group of the sandbox


def join(pidfd: int) -> None:
    """Into the namespaces of the sandbox whose pid 1 `pidfd` holds (the pid one, the caller was made in already).
    The sandbox must be finished (confine checks it): the caller waits for the host's word first."""
    _check(_libc.setns(pidfd, SANDBOX_NAMESPACES), "setns into the sandbox")


def confine(confinement: Confinement) -> None:
    """In the fork, after `join`: become exactly what bwrap makes of its own child, then load its filter."""
    os.setsid()
    check_finished(confinement.workdir)
    _drop_bounding_set()
    os.setresgid(confinement.gid, confinement.gid, confinement.gid)
    os.setresuid(confinement.uid, confinement.uid, confinement.uid)
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, "clear the ambient capabilities")
    _clear_capabilities()
    _check(_libc.prctl(PR_SET_NAME, confinement.name, 0, 0, 0), "set the name")
    _set_limits(confinement)
    os.chdir(confinement.workdir)
    os.environ.clear()
    os.environ.update(confinement.environment)
    os.environ["PWD"] = confinement.workdir  # as bwrap --chdir sets it
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "no_new_privs")
    load_seccomp(confinement.seccomp)
    # Joining the user namespace and the change of uid made it non-dumpable (nothing in the sandbox could open
    # its memory while it was still privileged); an exec'd kernel is dumpable (its /proc files its user's).
    _prctl(PR_SET_DUMPABLE, 1, "dumpable")


def check_finished(workdir: str) -> None:
    """Refuse a sandbox that bwrap has not finished: its mount namespace exists from bwrap's clone on, and
    until bwrap's child has pivoted into the new root and made it read-only (its last steps before the
    init's exec) its root shows bwrap's scaffolding, the host's old root included. A finished one has a
    read-only root, the workspace, and the sandbox's init (named by itself once it runs) as pid 1."""
    try:
        finished = bool(os.statvfs("/").f_flag & os.ST_RDONLY) and os.path.isdir(workdir)
        with open("/proc/1/comm", "rb") as handle:
            finished = finished and handle.read().strip() == INIT_NAME
    except OSError:
        finished = False
    if not finished:
        raise OSError(errno.EAGAIN, "the sandbox is not finished (its root is not yet the sandbox's)")


def _drop_bounding_set() -> None:
    """Every capability out of the bounding set (up to the last this kernel knows: PR_CAPBSET_READ says EINVAL)."""
    number = 0
    while _libc.prctl(PR_CAPBSET_READ, ctypes.c_ulong(number), 0, 0, 0) >= 0:
        _prctl(PR_CAPBSET_DROP, number, f"drop capability {number} from the bounding set")
        number += 1


def _clear_capabilities() -> None:
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "clear the capabilities")


def _set_limits(confinement: Confinement) -> None:
    if confinement.memory_bytes is not None:
        hard = resource.RLIM_INFINITY if confinement.memory_soft_only else confinement.memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (confinement.memory_bytes, hard))
    if confinement.nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (confinement.nproc, confinement.nproc))


def load_seccomp(program: bytes) -> None:
    """Load a classic BPF seccomp program (as bwrap --seccomp does); no_new_privs must be set."""
    if not program or len(program) % BPF_INSTRUCTION_BYTES:
        raise OSError(0, f"not a seccomp program: {len(program)} bytes")
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // BPF_INSTRUCTION_BYTES, ctypes.addressof(buffer))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "load the seccomp filter")


def close_fds_but(keep: tuple[int, ...]) -> None:
    """Close every fd of this process but `keep` (and 0-2): nothing of the template's crosses into the sandbox."""
    kept = sorted({0, 1, 2, *keep})
    low = 0
    for fd in [*kept, 2**20]:
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
