"""The seccomp filter every sandbox runs under, compiled with libseccomp (through pyseccomp).

An allow-list would break the long tail of what Python packages do; instead we deny what a
Python kernel never needs and what kernel exploits and sandbox escapes lean on: tracing other
processes, kernel keyrings, BPF, perf, userfaultfd, io_uring, new namespaces, mounts, module
loading, reboot, swap and the like. They fail with EPERM, so code gets a plain PermissionError.
Socket families the sandbox does not need fail with EAFNOSUPPORT. Syscalls of a foreign
architecture (i386 on x86-64) kill the process (libseccomp's default).

The same policy is written twice: as a libseccomp filter for bwrap (compiled_filter) and as an
OCI profile for podman/docker (tightened_profile); both are built from the tables below.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import tempfile
from dataclasses import dataclass
from typing import Any

#: Denied outright, each with EPERM.
DENIED_SYSCALLS = (
    # other processes' memory and execution
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # kernel keyrings
    "keyctl", "add_key", "request_key",
    # kernel attack surface with a history
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "lookup_dcookie", "fanotify_init", "open_by_handle_at", "name_to_handle_at",
    # namespaces and mounts
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree",
    "fsopen", "fsmount", "fsconfig", "fspick", "mount_setattr",
    # the machine itself
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct", "quotactl", "syslog", "iopl", "ioperm", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "vhangup", "uselib", "personality",
)  # fmt: skip

#: clone() flags that would create namespaces; clone with any of them fails with EPERM.
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
CLONE_NAMESPACE_MASK = sum(CLONE_NAMESPACE_FLAGS.values())

#: The socket families sandboxed code may create: unix (kernel channels, Chromium's IPC),
#: IPv4/IPv6 (internet mode, and loopback) and netlink (glibc and Chromium read interfaces and
#: routes through it). Every other family fails with EAFNOSUPPORT, as if the kernel lacked it;
#: above all AF_VSOCK, which no namespace confines (it reaches the hypervisor of a host that is a VM).
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16}
#: socket() and socketpair() take the family first.
SOCKET_SYSCALLS = ("socket", "socketpair")

#: Set-user-ID and set-group-ID mode bits. Sandboxed code may never set them: a file it writes
#: in a writable mount is the host folder owner's (id-mapped), and a setuid program left there
#: would run as that owner for any host user who can reach it.
SETID_BITS = (0o4000, 0o2000)
#: Flags of open()/openat() that create a file with the given mode (O_CREAT, __O_TMPFILE).
CREATING_FLAGS = (0o100, 0o20000000)


@dataclass(frozen=True)
class ModeCall:
    """A syscall that sets a file mode: where its mode is, and where its creating flags are (if any)."""

    name: str
    mode: int
    flags: int | None = None


MODE_CALLS = (
    ModeCall("chmod", 1), ModeCall("fchmod", 1), ModeCall("fchmodat", 2), ModeCall("fchmodat2", 2),
    ModeCall("creat", 1), ModeCall("mknod", 1), ModeCall("mknodat", 2),
    ModeCall("open", 2, flags=1), ModeCall("openat", 3, flags=2),
)  # fmt: skip
#: openat2 carries its mode in memory seccomp cannot read: ENOSYS, so libc falls back to openat.
OPAQUE_MODE_CALLS = ("openat2",)


@dataclass(frozen=True)
class ArgTest:
    """One comparison of a syscall argument, in the terms both libseccomp and OCI profiles use."""

    op: str  # "EQ" or "GT" (unsigned, all 64 bits)
    value: int


def refused_families() -> list[ArgTest]:
    """Tests that together match every family argument outside SOCKET_FAMILIES.

    The family is a C int, but seccomp compares all 64 bits of the register while the kernel reads
    only the low 32: "anything above the highest allowed value" (a 64-bit comparison) also catches
    a value with high bits set whose low half names an allowed family, so nothing can pass the
    filter as one family and reach the kernel as another.
    """
    highest = max(SOCKET_FAMILIES.values())
    allowed = set(SOCKET_FAMILIES.values())
    return [ArgTest("GT", highest), *(ArgTest("EQ", value) for value in range(highest) if value not in allowed)]


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its Python binding) is missing; the message says how to install it."""


@functools.lru_cache(maxsize=1)
def compiled_filter() -> bytes:
    """The BPF program for bwrap's --seccomp, built once per process."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as exc:
        raise SeccompUnavailable(
            f"libseccomp is not usable ({exc}): sudo apt-get install libseccomp2, then ./install.sh"
        ) from None
    rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):
            continue  # a syscall this kernel/libseccomp does not know cannot be called either
    for flag in CLONE_NAMESPACE_FLAGS.values():
        # (flags & flag) == flag: one rule per flag, so that any one of them is refused.
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory seccomp cannot read: make libc fall back to clone().
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for call in MODE_CALLS:
        for bit in SETID_BITS:
            creating_flags: tuple[int | None, ...] = CREATING_FLAGS if call.flags is not None else (None,)
            for creating in creating_flags:
                args = [seccomp.Arg(call.mode, seccomp.MASKED_EQ, bit, bit)]
                if creating is not None and call.flags is not None:
                    args.append(seccomp.Arg(call.flags, seccomp.MASKED_EQ, creating, creating))
                with contextlib.suppress(ValueError, RuntimeError, OSError):  # absent on this arch
                    rules.add_rule(seccomp.ERRNO(errno.EPERM), call.name, *args)
    for name in OPAQUE_MODE_CALLS:
        with contextlib.suppress(ValueError, RuntimeError, OSError):
            rules.add_rule(seccomp.ERRNO(errno.ENOSYS), name)
    ops = {"EQ": seccomp.EQ, "GT": seccomp.GT}
    for name in SOCKET_SYSCALLS:
        for test in refused_families():
            rules.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), name, seccomp.Arg(0, ops[test.op], test.value))
    with tempfile.TemporaryFile() as handle:
        rules.export_bpf(handle)
        handle.seek(0)
        return handle.read()


#: s390 passes clone's flags second; every other architecture first.
CLONE_FLAGS_SECOND = ["s390", "s390x"]


def tightened_profile(engine_default: dict[str, Any]) -> dict[str, Any]:
    """An engine's seccomp profile (OCI JSON, e.g. containers-common's) refusing what bwrap refuses.

    Engines allow some of DENIED_SYSCALLS (ptrace, keyctl, personality ...) or gate them on
    capabilities, and containers-common allows clone, clone3, unshare and socket outright (with
    clone3 a process makes a user namespace holding every capability). runc hands the rules to
    libseccomp, where an unconditional allow of a syscall wins over conditional rules for it, so
    those syscalls are taken out of every engine rule and ruled here alone: DENIED_SYSCALLS with
    EPERM, clone with a namespace flag EPERM (and allowed without one), clone3 ENOSYS so that
    libc falls back to clone, and socket/socketpair allowed for SOCKET_FAMILIES only, every
    other family EAFNOSUPPORT. The engine's rules for everything else (foreign arches, the
    default action) stay. Its NETLINK_AUDIT refusal goes with its socket rules; sending audit
    records needs CAP_AUDIT_WRITE, which the container does not have.
    """
    denied = set(DENIED_SYSCALLS)
    ruled_here = denied | {"clone", "clone3", *SOCKET_SYSCALLS, *(call.name for call in MODE_CALLS),
                           *OPAQUE_MODE_CALLS}  # fmt: skip
    profile = copy.deepcopy(engine_default)
    rules = []
    for rule in profile.get("syscalls") or []:
        names = [name for name in rule.get("names", []) if name not in ruled_here]
        if names:
            rules.append({**rule, "names": names})
    rules.append({"names": sorted(denied), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM})
    rules += _clone_rules()
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS})
    rules += _socket_rules()
    rules += _mode_rules()
    rules.append({"names": list(OPAQUE_MODE_CALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS})
    profile["syscalls"] = rules
    return profile


def _arg(index: int, op: str, value: int, value_two: int = 0) -> dict[str, Any]:
    return {"index": index, "value": value, "valueTwo": value_two, "op": f"SCMP_CMP_{op}"}


def _clone_rules() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for index, arches in (
        (0, {"excludes": {"arches": CLONE_FLAGS_SECOND}}),
        (1, {"includes": {"arches": CLONE_FLAGS_SECOND}}),
    ):
        # (flags & mask) == 0: no namespace flag at all.
        rules.append({"names": ["clone"], "action": "SCMP_ACT_ALLOW",
                      "args": [_arg(index, "MASKED_EQ", CLONE_NAMESPACE_MASK, 0)], **arches})  # fmt: skip
        for flag in CLONE_NAMESPACE_FLAGS.values():
            rules.append({"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
                          "args": [_arg(index, "MASKED_EQ", flag, flag)], **arches})  # fmt: skip
    return rules


def _socket_rules() -> list[dict[str, Any]]:
    names = list(SOCKET_SYSCALLS)
    rules: list[dict[str, Any]] = [
        {"names": names, "action": "SCMP_ACT_ALLOW", "args": [_arg(0, "EQ", family)]}
        for family in sorted(SOCKET_FAMILIES.values())
    ]
    for test in refused_families():
        rules.append({"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EAFNOSUPPORT,
                      "args": [_arg(0, test.op, test.value)]})  # fmt: skip
    return rules


def _mode_rules() -> list[dict[str, Any]]:
    """Mode-setting calls allowed unless they set a setuid/setgid bit (then EPERM).

    The allows cover exactly the complement of the refusals (no creating flag, or no such bit),
    because an engine default of allow-all for these names would win over conditional refusals.
    """
    setid = sum(SETID_BITS)
    rules: list[dict[str, Any]] = []
    for call in MODE_CALLS:
        rules.append(
            {"names": [call.name], "action": "SCMP_ACT_ALLOW", "args": [_arg(call.mode, "MASKED_EQ", setid, 0)]}
        )
        if call.flags is not None:
            creating = sum(CREATING_FLAGS)
            rules.append({"names": [call.name], "action": "SCMP_ACT_ALLOW",
                          "args": [_arg(call.flags, "MASKED_EQ", creating, 0)]})  # fmt: skip
        for bit in SETID_BITS:
            for flag in CREATING_FLAGS if call.flags is not None else (None,):
                args = [_arg(call.mode, "MASKED_EQ", bit, bit)]
                if flag is not None and call.flags is not None:
                    args.append(_arg(call.flags, "MASKED_EQ", flag, flag))
                rules.append({"names": [call.name], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM, "args": args})
    return rules
