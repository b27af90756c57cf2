"""The seccomp policy itself: the OCI profile's rules evaluated as runc/libseccomp would, and the
bwrap filter loaded for real into a child process.

Where the two meet: both refuse new namespaces (clone flags EPERM, clone3 ENOSYS, unshare) and
every socket family but unix, inet, inet6 and netlink (EAFNOSUPPORT), including values whose
high 32 bits are set (the kernel reads the family as an int: only the low half counts).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

from coderunner.sandbox.seccomp import (
    CLONE_NAMESPACE_FLAGS,
    DENIED_SYSCALLS,
    SOCKET_FAMILIES,
    compiled_filter,
    tightened_profile,
)

#: containers-common's shape where it matters: clone, clone3, unshare and socketpair allowed
#: outright, socket allowed by capability-gated rules, a default of ENOSYS.
ENGINE = {
    "defaultAction": "SCMP_ACT_ERRNO",
    "defaultErrnoRet": 38,
    "syscalls": [
        {"names": ["clone", "clone3", "read", "socketpair", "unshare"], "action": "SCMP_ACT_ALLOW", "args": []},
        {"names": ["socket"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 2, "value": 9, "op": "SCMP_CMP_NE"}],
         "excludes": {"caps": ["CAP_AUDIT_WRITE"]}},
        {"names": ["socket"], "action": "SCMP_ACT_ALLOW", "args": None, "includes": {"caps": ["CAP_AUDIT_WRITE"]}},
    ],
}  # fmt: skip
VSOCK = 40
HIGH = 1 << 32
FAMILY_PROBES = [*range(0, 64), 0xFFFF, HIGH | 1, HIGH | 2, HIGH | VSOCK, (1 << 63) | 1, 2**64 - 1]
ALL_NAMESPACES = sum(CLONE_NAMESPACE_FLAGS.values())


def _matches(rule: dict[str, Any], name: str, args: list[int], arch: str) -> bool:
    """Does one OCI rule apply to this call (the comparisons runc passes to libseccomp)?"""
    if name not in rule["names"]:
        return False
    if arch in rule.get("excludes", {}).get("arches", []):
        return False
    if rule.get("includes", {}).get("arches") and arch not in rule["includes"]["arches"]:
        return False
    for test in rule.get("args") or []:
        value = args[test["index"]]
        op, datum, two = test["op"], test["value"], test.get("valueTwo", 0)
        ok = {
            "SCMP_CMP_EQ": value == datum,
            "SCMP_CMP_NE": value != datum,
            "SCMP_CMP_GT": value > datum,
            "SCMP_CMP_MASKED_EQ": value & datum == two,
        }[op]
        if not ok:
            return False
    return True


def _outcome(profile: dict[str, Any], name: str, args: list[int], arch: str = "amd64") -> str:
    """The action for a call with no capabilities. Rules that apply must agree (no overlap)."""
    found = {
        ("ALLOW" if rule["action"] == "SCMP_ACT_ALLOW" else errno.errorcode[rule["errnoRet"]])
        for rule in profile["syscalls"]
        if not rule.get("includes", {}).get("caps") and _matches(rule, name, args, arch)
    }
    assert len(found) <= 1, f"{name}{args}: overlapping rules disagree: {found}"
    return found.pop() if found else errno.errorcode[profile["defaultErrnoRet"]]


def test_profile_allows_exactly_the_four_socket_families_whatever_the_high_bits() -> None:
    profile = tightened_profile(ENGINE)
    for name in ("socket", "socketpair"):
        for family in FAMILY_PROBES:
            expected = "ALLOW" if family in SOCKET_FAMILIES.values() else "EAFNOSUPPORT"
            assert _outcome(profile, name, [family, 1, 0]) == expected, (name, hex(family))


def test_profile_refuses_namespaces_like_bwrap() -> None:
    profile = tightened_profile(ENGINE)
    sigchld = 17
    assert _outcome(profile, "clone", [sigchld, 0]) == "ALLOW"  # fork
    assert _outcome(profile, "clone", [0x003D0F00, 0]) == "ALLOW"  # a thread (CLONE_VM|CLONE_THREAD|...)
    for flag in CLONE_NAMESPACE_FLAGS.values():
        assert _outcome(profile, "clone", [flag | sigchld, 0]) == "EPERM", hex(flag)
        assert _outcome(profile, "clone", [HIGH | flag, 0]) == "EPERM", hex(flag)
        assert _outcome(profile, "clone", [0, flag | sigchld], arch="s390x") == "EPERM", hex(flag)
    assert _outcome(profile, "clone", [0, sigchld], arch="s390x") == "ALLOW"
    assert _outcome(profile, "clone", [ALL_NAMESPACES, 0]) == "EPERM"
    assert _outcome(profile, "clone3", [0, 88]) == "ENOSYS"
    for name in ("unshare", "setns", "mount", "ptrace", "keyctl", "bpf"):
        assert _outcome(profile, name, [0x10000000, 0]) == "EPERM", name
    assert _outcome(profile, "read", [0, 0]) == "ALLOW"


def test_profile_is_accepted_by_the_engines_json_shape() -> None:
    """Every rule runc reads: names, an action, errnoRet with ERRNO, one comparison per argument."""
    profile = json.loads(json.dumps(tightened_profile(ENGINE)))
    for rule in profile["syscalls"]:
        assert rule["names"] and rule["action"] in ("SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"), rule
        assert (rule["action"] == "SCMP_ACT_ERRNO") == ("errnoRet" in rule), rule
        indexes = [test["index"] for test in rule.get("args") or []]
        assert len(indexes) == len(set(indexes)), rule
    assert set(DENIED_SYSCALLS) <= {name for rule in profile["syscalls"] for name in rule["names"]}


def test_installed_engine_profile_is_tightened_the_same_way() -> None:
    """The real containers-common profile on this machine, where there is one."""
    source = next((p for p in (Path("/etc/containers/seccomp.json"), Path("/usr/share/containers/seccomp.json"))
                   if p.is_file()), None)  # fmt: skip
    if source is None:
        pytest.fail("no containers-common seccomp.json here: install podman (./install.sh does)")
    profile = tightened_profile(json.loads(source.read_text()))
    assert _outcome(profile, "clone3", [0, 88]) == "ENOSYS"
    assert _outcome(profile, "unshare", [0x10000000]) == "EPERM"
    assert _outcome(profile, "clone", [0x10000000 | 17, 0]) == "EPERM"
    assert _outcome(profile, "socket", [VSOCK, 1, 0]) == "EAFNOSUPPORT"
    assert _outcome(profile, "socket", [HIGH | VSOCK, 1, 0]) == "EAFNOSUPPORT"
    assert _outcome(profile, "socket", [SOCKET_FAMILIES["AF_INET"], 1, 0]) == "ALLOW"


# --- the bwrap filter, loaded for real -----------------------------------------------------------


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SYS_SOCKET = 41
SYS_UNSHARE = 272
SYS_CLONE3 = 435


def _under_filter(calls: list[tuple[int, list[int]]]) -> list[int]:
    """Each syscall's errno (0 on success) in a forked child that runs under compiled_filter()."""
    if os.uname().machine != "x86_64":
        pytest.fail("these syscall numbers are x86-64's: add this machine's")
    bpf = compiled_filter()
    buffer = ctypes.create_string_buffer(bpf, len(bpf))
    program = _Program(len(bpf) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.close(read_fd)
            if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or libc.prctl(
                PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0
            ):
                os._exit(3)
            results = []
            for number, args in calls:
                ctypes.set_errno(0)
                done = libc.syscall(ctypes.c_long(number), *(ctypes.c_ulong(arg) for arg in args))
                results.append(0 if done >= 0 else ctypes.get_errno())
                if done > 0 and number == SYS_SOCKET:
                    os.close(done)
            os.write(write_fd, json.dumps(results).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as reader:
        data = reader.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the child could not load the filter"
    return json.loads(data)


def test_bwrap_filter_allows_exactly_the_four_socket_families_whatever_the_high_bits() -> None:
    sock_dgram = 2
    probes = [family for family in FAMILY_PROBES if family != SOCKET_FAMILIES["AF_NETLINK"]]
    results = _under_filter([(SYS_SOCKET, [family, sock_dgram, 0]) for family in probes])
    for family, result in zip(probes, results, strict=True):
        if family in SOCKET_FAMILIES.values():
            assert result == 0, (hex(family), errno.errorcode.get(result))
        else:
            assert result == errno.EAFNOSUPPORT, (hex(family), errno.errorcode.get(result))
    [netlink] = _under_filter([(SYS_SOCKET, [SOCKET_FAMILIES["AF_NETLINK"], sock_dgram, 0])])
    assert netlink == 0


def test_bwrap_filter_refuses_new_namespaces() -> None:
    unshare_user, clone3 = _under_filter([(SYS_UNSHARE, [0x10000000]), (SYS_CLONE3, [0, 88])])
    assert (unshare_user, clone3) == (errno.EPERM, errno.ENOSYS)


SETID_PROBES = [0o4755, 0o2755, 0o6755, (1 << 32) | 0o4755]


def test_profile_refuses_setuid_and_setgid_modes_and_nothing_else() -> None:
    profile = tightened_profile(ENGINE)
    creat, tmpfile = 0o100, 0o20000000
    for mode in (0o755, 0o644, 0o1777, 0o777):
        assert _outcome(profile, "chmod", [0, mode]) == "ALLOW", oct(mode)
        assert _outcome(profile, "fchmodat", [0, 0, mode, 0]) == "ALLOW", oct(mode)
        assert _outcome(profile, "openat", [0, 0, creat, mode]) == "ALLOW", oct(mode)
    for mode in SETID_PROBES:
        assert _outcome(profile, "chmod", [0, mode]) == "EPERM", oct(mode)
        assert _outcome(profile, "fchmod", [0, mode]) == "EPERM", oct(mode)
        assert _outcome(profile, "fchmodat2", [0, 0, mode, 0]) == "EPERM", oct(mode)
        assert _outcome(profile, "openat", [0, 0, creat | 2, mode]) == "EPERM", oct(mode)
        assert _outcome(profile, "openat", [0, 0, tmpfile | 2, mode]) == "EPERM", oct(mode)
        assert _outcome(profile, "open", [0, creat, mode]) == "EPERM", oct(mode)
        assert _outcome(profile, "mknodat", [0, 0, mode | 0o100000, 0]) == "EPERM", oct(mode)
        # Without a creating flag the mode argument is not a mode: any value is fine.
        assert _outcome(profile, "openat", [0, 0, 2, mode]) == "ALLOW", oct(mode)
    assert _outcome(profile, "openat2", [0, 0, 0, 24]) == "ENOSYS"


SYS_OPEN, SYS_CHMOD, SYS_OPENAT, SYS_FCHMODAT, SYS_FCHMODAT2, SYS_OPENAT2 = 2, 90, 257, 268, 452, 437
AT_FDCWD = 2**64 - 100


def test_bwrap_filter_refuses_setuid_and_setgid_modes(tmp_path: Path) -> None:
    """A setuid file left in a writable mount would run as the folder's owner on the host."""
    target = tmp_path / "tool"
    target.write_text("#!/bin/sh\n")
    path = ctypes.create_string_buffer(str(target).encode())
    fresh = ctypes.create_string_buffer(str(tmp_path / "fresh").encode())
    address, fresh_address = ctypes.addressof(path), ctypes.addressof(fresh)
    calls = [(SYS_CHMOD, [address, 0o755]), (SYS_FCHMODAT, [AT_FDCWD, address, 0o700, 0])]
    calls += [(SYS_CHMOD, [address, mode]) for mode in SETID_PROBES]
    calls += [(SYS_FCHMODAT, [AT_FDCWD, address, 0o4755, 0]), (SYS_FCHMODAT2, [AT_FDCWD, address, 0o2755, 0])]
    calls += [
        (SYS_OPENAT, [AT_FDCWD, fresh_address, 0o100 | 1, 0o4755]),
        (SYS_OPEN, [fresh_address, 0o100 | 1, 0o6777]),
    ]
    calls += [(SYS_OPENAT, [AT_FDCWD, fresh_address, 0o100 | 1, 0o644]), (SYS_OPENAT2, [AT_FDCWD, address, 0, 24])]
    results = _under_filter(calls)
    assert results[:2] == [0, 0]
    assert results[2:-2] == [errno.EPERM] * (len(results) - 4), [errno.errorcode.get(r) for r in results]
    assert results[-2] == 0 and results[-1] == errno.ENOSYS
    assert not os.stat(target).st_mode & 0o6000 and not os.stat(tmp_path / "fresh").st_mode & 0o6000
