"""The seccomp filter every sandbox runs under, compiled with libseccomp (through pyseccomp).

An allow-list would break the long tail of what Python packages do; instead we deny what a
Python kernel never needs and what kernel exploits and sandbox escapes lean on: tracing other
processes, kernel keyrings, BPF, perf, userfaultfd, io_uring, new namespaces, mounts, module
loading, reboot, swap and the like. They fail with EPERM, so code gets a plain PermissionError.
Syscalls of a foreign architecture (i386 on x86-64) kill the process (libseccomp's default).
"""

from __future__ import annotations

import copy
import errno
import functools
import tempfile
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
    with tempfile.TemporaryFile() as handle:
        rules.export_bpf(handle)
        handle.seek(0)
        return handle.read()


def tightened_profile(engine_default: dict[str, Any]) -> dict[str, Any]:
    """An engine's seccomp profile (OCI JSON, e.g. containers-common's) with DENIED_SYSCALLS refused.

    Engines allow some of them (ptrace, keyctl, personality ...) or gate them on capabilities;
    the container backends then refuse the same calls as bwrap, each with EPERM. The engine's own
    rules for everything else (clone namespace flags without CAP_SYS_ADMIN, foreign arches) stay.
    """
    denied = set(DENIED_SYSCALLS)
    profile = copy.deepcopy(engine_default)
    rules = []
    for rule in profile.get("syscalls") or []:
        names = [name for name in rule.get("names", []) if name not in denied]
        if names:
            rules.append({**rule, "names": names})
    rules.append({"names": sorted(denied), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM})
    profile["syscalls"] = rules
    return profile
