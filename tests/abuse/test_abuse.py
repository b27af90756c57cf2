"""The abuse suite: every case names the boundary it probes, tries to cross it, asserts that it
could not, and then asserts that the server still answers a normal run_python and that a
bystander session (created before any attack) kept its state and files.

All cases run against one `coderunner serve` over stdio (the arena), each in a fresh session.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.types import CallToolResult

from ..conftest import REPO, SECRET_NAME, SECRET_VALUE, json_of, run, run_to_end, sandbox_processes_alive, text_of
from .conftest import BYSTANDER_VALUE, CANARY, Arena, HostTargets, ServerDirs, host_targets, open_arena

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


def verdict(result: CallToolResult) -> dict[str, Any]:
    """The JSON object a probe printed last."""
    for line in reversed(text_of(result).splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no verdict in: {text_of(result)[-2000:]}")


TRY = (
    """
import json, os, errno, socket
def attempt(fn):
    try:
        return ['OK', repr(fn())[:200]]
    except BaseException as exc:
        return [type(exc).__name__, str(exc)[:200]]
def _canary_from(s):
    with s:
        s.settimeout(3)
        got = s.recv(64)
    if CANARY.encode() not in got:
        raise ConnectionError(f'connected, but not to the host: it answered {got!r}')
    return got
def reach(host, port):
    return _canary_from(socket.create_connection((host, port), timeout=3))
def reach_abstract(name):
    s = socket.socket(socket.AF_UNIX)
    s.connect('\\0' + name)
    return _canary_from(s)
"""
    + f"CANARY = {CANARY!r}\n"
)


#: The network-internet cases need internet within the user's ceiling (off by default).
INTERNET_ALLOWED = {"CODERUNNER_MAX_NETWORK": "internet"}


@pytest.fixture(scope="module")
async def arena(abuse_dirs: ServerDirs, host_listeners: HostTargets) -> AsyncIterator[Arena]:
    """The abuse conftest's arena, where the user allows network 'internet'."""
    async with open_arena(abuse_dirs, host_listeners, **INTERNET_ALLOWED) as made:
        yield made


def no_ok(result: CallToolResult, arena: Arena) -> None:
    """Every attempt in the verdict failed, and the host's canary services saw no one."""
    outcome = verdict(result)
    crossed = {name: value for name, value in outcome.items() if value[0] == "OK"}
    assert not crossed, crossed
    assert not arena.host.reached, arena.host.reached


def test_the_probes_count_only_the_host_canary() -> None:
    """The control for every loopback case: run on the host itself, the probes reach the canary
    services (and those see them), while a port that accepts for someone else does not count."""
    with host_targets() as host, socket.socket() as stranger:
        stranger.bind(("127.0.0.1", 0))
        stranger.listen(1)
        code = TRY + (
            f"print(json.dumps({{'tcp': attempt(lambda: reach('127.0.0.1', {host.loopback_port})),"
            f" 'abstract': attempt(lambda: reach_abstract({host.abstract_socket!r})),"
            f" 'stranger': attempt(lambda: reach('127.0.0.1', {stranger.getsockname()[1]}))}}))"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        outcome = json.loads(done.stdout.strip().splitlines()[-1])
        assert outcome["tcp"][0] == "OK" and outcome["abstract"][0] == "OK", outcome
        assert outcome["stranger"][0] != "OK", outcome
        deadline = time.monotonic() + 5
        while len(host.reached) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(host.reached) == 2, host.reached


@dataclass
class Case:
    boundary: str
    name: str
    code: str | Callable[[Arena], str]
    check: Callable[[CallToolResult, Arena], None] = no_ok
    session: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 30

    def source(self, arena: Arena) -> str:
        return self.code(arena) if callable(self.code) else self.code


def expect_text(*needles: str, error: bool | None = None) -> Callable[[CallToolResult, Arena], None]:
    def check(result: CallToolResult, arena: Arena) -> None:
        text = text_of(result)
        for needle in needles:
            assert needle in text, f"{needle!r} not in {text[-1500:]!r}"
        if error is not None:
            assert result.is_error is error, text[-1500:]

    return check


def _clean_text(result: CallToolResult) -> None:
    """Garbage bytes arrive as text (replacement characters), without terminal escapes."""
    text = text_of(result)
    assert not result.is_error and "[ok in" in text
    assert "\x1b" not in text, "terminal escape sequences must be stripped"
    assert "done" in text or "characters omitted" in text


def _survived_or_replaced(result: CallToolResult) -> None:
    """Signals to the namespace's init from inside are ignored; if it did die, the kernel is replaced."""
    text = text_of(result)
    assert "survived" in text or "fresh kernel is ready" in text, text


CASES = [
    # --- the host's files -------------------------------------------------------------------------
    Case(
        "filesystem",
        "read /etc/shadow",
        TRY + "print(json.dumps({'shadow': attempt(lambda: open('/etc/shadow').read())}))",
    ),
    Case(
        "filesystem",
        "read the repository",
        lambda a: (
            TRY
            + f"print(json.dumps({{'repo': attempt(lambda: open({str(REPO / 'pyproject.toml')!r}).read()), 'list': attempt(lambda: os.listdir({str(REPO)!r}))}}))"
        ),
    ),
    Case(
        "filesystem",
        "read the server user's $HOME",
        lambda a: (
            TRY
            + f"print(json.dumps({{'home': attempt(lambda: os.listdir({os.environ.get('HOME', '/root')!r})), 'ssh': attempt(lambda: open({os.environ.get('HOME', '/root') + '/.ssh/id_rsa'!r}).read())}}))"
        ),
    ),
    Case(
        "filesystem",
        "read another session's workspace",
        lambda a: (
            TRY
            + f"print(json.dumps({{'file': attempt(lambda: open({str(a.bystander_workspace / 'bystander.txt')!r}).read()), 'dir': attempt(lambda: os.listdir({str(a.bystander_workspace)!r}))}}))"
        ),
    ),
    Case(
        "filesystem",
        "write outside the workspace",
        TRY
        + "print(json.dumps({p: attempt(lambda p=p: open(p, 'w').write('x')) for p in ['/usr/evil', '/etc/evil', '/evil', '/opt/coderunner/env/evil', '/opt/coderunner/lib/coderunner_guest/evil.py', '/proc/sys/kernel/hostname']}))",
    ),
    Case(
        "filesystem",
        "symlink and .. escapes",
        TRY
        + "os.symlink('/etc', 'etc-link'); os.symlink('../../../../../../root', 'root-link')\nprint(json.dumps({'dotdot': attempt(lambda: open('/workspace/../../../../root/.bashrc').read()), 'link_root': attempt(lambda: os.listdir('root-link')), 'link_shadow': attempt(lambda: open('etc-link/shadow').read())}))",
    ),
    Case(
        "filesystem",
        "host devices and /sys",
        TRY
        + "print(json.dumps({'devs': ['OK', sorted(os.listdir('/dev'))] if any(d in os.listdir('/dev') for d in ('sda', 'vda', 'mem', 'kmsg', 'loop0')) else ['none', ''], 'sys': attempt(lambda: os.listdir('/sys/fs/cgroup')), 'kmem': attempt(lambda: open('/dev/kmsg').read(1))}))",
    ),
    Case(
        "filesystem",
        "kernel sysctls (core_pattern is a host root escape)",
        TRY
        + "def write(p):\n    fd = os.open(p, os.O_WRONLY)\n    try:\n        return os.write(fd, b'|/workspace/x')\n    finally:\n        os.close(fd)\nprint(json.dumps({p: attempt(lambda p=p: write(p)) for p in ['/proc/sys/kernel/core_pattern', '/proc/sys/kernel/modprobe', '/proc/sys/kernel/hostname', '/proc/sys/vm/drop_caches', '/proc/sys/fs/inotify/max_user_instances']}))",
    ),
    # --- the host's environment -------------------------------------------------------------------
    Case(
        "environment",
        "host variables and /proc/*/environ",
        TRY
        + f"import glob\nleaks = [p for p in glob.glob('/proc/*/environ') if attempt(lambda p=p: open(p, 'rb').read())[0] == 'OK' and b'{SECRET_VALUE}' in open(p, 'rb').read()]\nprint(json.dumps({{'env': ['OK', 1] if '{SECRET_NAME}' in os.environ or any('{SECRET_VALUE}' in v for v in os.environ.values()) else ['absent', ''], 'proc': ['OK', leaks] if leaks else ['absent', '']}}))",
    ),
    # --- the network (mode none) ------------------------------------------------------------------
    Case(
        "network none",
        "TCP egress",
        TRY
        + "import socket\nprint(json.dumps({h: attempt(lambda h=h: socket.create_connection((h, 443), timeout=3)) for h in ['1.1.1.1', '8.8.8.8']}))",
    ),
    Case(
        "network none",
        "UDP egress",
        TRY
        + "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nprint(json.dumps({'udp': attempt(lambda: s.sendto(b'x' * 64, ('8.8.8.8', 53)))}))",
    ),
    Case(
        "network none",
        "DNS lookup",
        TRY + "import socket\nprint(json.dumps({'dns': attempt(lambda: socket.getaddrinfo('pypi.org', 443))}))",
    ),
    Case(
        "network none",
        "ICMP egress",
        TRY
        + "import socket\nprint(json.dumps({'raw_icmp': attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)), 'dgram_icmp': attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP).sendto(b'\\x08\\x00\\xf7\\xff\\x00\\x00\\x00\\x00', ('8.8.8.8', 0)))}))",
    ),
    Case(
        "network none",
        "the host's loopback services",
        lambda a: (
            TRY
            + f"print(json.dumps({{'tcp': attempt(lambda: reach('127.0.0.1', {a.loopback_port})), 'abstract': attempt(lambda: reach_abstract({a.abstract_socket!r}))}}))"
        ),
    ),
    Case(
        "network none",
        "raw and packet sockets",
        TRY
        + "import socket\nprint(json.dumps({'raw': attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)), 'packet': attempt(lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))}))",
    ),
    # --- the network (mode internet) --------------------------------------------------------------
    Case(
        "network internet",
        "the host's 127.0.0.1",
        lambda a: (
            TRY
            + f"print(json.dumps({{h: attempt(lambda h=h: reach(h, {a.loopback_port})) for h in ['127.0.0.1', '10.0.2.2']}}))"
        ),
        session={"network": "internet"},
    ),
    Case(
        "network internet",
        "abstract unix sockets of the host",
        lambda a: TRY + f"print(json.dumps({{'abstract': attempt(lambda: reach_abstract({a.abstract_socket!r}))}}))",
        session={"network": "internet"},
    ),
    Case(
        "network internet",
        "other sessions' kernel sockets",
        lambda a: (
            TRY
            + f"import glob\nprint(json.dumps({{p: attempt(lambda p=p: __import__('socket').socket(__import__('socket').AF_UNIX).connect(p)) for p in {sorted(str(p) for p in a.dirs.runtime.glob('*/run/k*-*'))!r}}}))"
        ),
        session={"network": "internet"},
    ),
    # --- resources --------------------------------------------------------------------------------
    Case(
        "processes",
        "fork bomb",
        "import os, time, json\nkids = []\nerr = None\nfor _ in range(5000):\n    try:\n        pid = os.fork()\n    except OSError as exc:\n        err = exc.errno; break\n    if pid == 0:\n        time.sleep(20); os._exit(0)\n    kids.append(pid)\nfor pid in kids: os.kill(pid, 9)\nfor pid in kids: os.waitpid(pid, 0)\nprint(json.dumps({'forks': ['stopped', len(kids)] if err else ['OK', len(kids)]}))",
    ),
    Case(
        "processes",
        "thread bomb",
        "import threading, time, json\nstop = threading.Event()\nthreads, err = [], None\nfor _ in range(5000):\n    try:\n        t = threading.Thread(target=stop.wait, daemon=True); t.start(); threads.append(t)\n    except RuntimeError as exc:\n        err = str(exc); break\nstop.set()\nprint(json.dumps({'threads': ['stopped', len(threads)] if err else ['OK', len(threads)]}))",
    ),
    Case("memory", "allocation bomb", "blob = bytearray(8 * 1024**3)", expect_text("MemoryError", error=True)),
    Case(
        "memory",
        "memory outside RLIMIT_AS (tmpfs pages)",
        "import numpy as np\nwith open('/tmp/fill', 'wb') as f:\n    for _ in range(500): f.write(b'x' * 2**20)\nkeep = [np.ones(2**17) for _ in range(400)]",
        expect_text("state lost", "fresh kernel is ready", error=True),
        session={"memory_mb": 600},
    ),
    Case(
        "disk",
        "/dev/shm fill",
        "import json, os\ntry:\n    with open('/dev/shm/fill', 'wb') as f:\n        for _ in range(1024): f.write(b'x' * 2**20)\n    r = ['OK', '']\nexcept OSError as exc:\n    r = [os.strerror(exc.errno), os.path.getsize('/dev/shm/fill') // 2**20]\nprint(json.dumps({'shm': r}))",
    ),
    Case(
        "disk",
        "/tmp fill",
        "import json, os\ntry:\n    with open('/tmp/fill', 'wb') as f:\n        for _ in range(4096): f.write(b'x' * 2**20)\n    r = ['OK', '']\nexcept OSError as exc:\n    r = [os.strerror(exc.errno), os.path.getsize('/tmp/fill') // 2**20]\nprint(json.dumps({'tmp': r}))",
    ),
    Case(
        "disk",
        "workspace fill",
        "import json, os\ntry:\n    with open('fill', 'wb') as f:\n        for _ in range(4096): f.write(b'x' * 2**20)\n    r = ['OK', '']\nexcept OSError as exc:\n    r = [os.strerror(exc.errno), os.path.getsize('fill') // 2**20]\nprint(json.dumps({'workspace': r}))",
    ),
    Case(
        "output",
        "one 100 MB line",
        "import sys\nsys.stdout.write('L' * 100_000_000 + '\\n')\nprint('after the line')",
        expect_text("characters omitted", "after the line", error=False),
    ),
    Case(
        "output",
        "a forged 100 MB message",
        "import sys\ntype(sys.stdout).write(sys.stdout, 'F' * 100_000_000)\nsys.stdout.flush()\nstill = 'here'",
        expect_text("output was lost", error=False),
    ),
    Case(
        "output",
        "binary garbage on stdout",
        "import os, time\nos.write(1, bytes(range(256)) * 4096 + b'\\x1b[2J\\x1b]0;pwn\\x07')\ntime.sleep(0.5)\nprint('done')",
        lambda result, arena: _clean_text(result),
    ),
    Case(
        "time",
        "infinite loop",
        "while True:\n    pass",
        expect_text("interrupted", "state are kept", error=True),
        timeout_s=2,
    ),
    Case(
        "time",
        "SIGINT ignored in a C-level sleep",
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(3600)",
        expect_text("restarted", "state lost", error=True),
        timeout_s=2,
    ),
    Case(
        "kernel",
        "os.kill of the kernel",
        "import os\nos.kill(os.getpid(), 9)",
        expect_text("kernel died", "fresh kernel is ready", error=True),
    ),
    Case(
        "kernel",
        "killing the sandbox's pid 1",
        "import os, signal, time\nfor sig in (signal.SIGKILL, signal.SIGTERM):\n    try:\n        os.kill(1, sig)\n    except OSError as exc:\n        print('refused', exc)\ntime.sleep(1)\nprint('survived')",
        lambda result, arena: _survived_or_replaced(result),
    ),
    # --- privileges and syscalls ------------------------------------------------------------------
    Case(
        "syscalls",
        "ptrace",
        TRY
        + "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\ndef trace():\n    if libc.ptrace(16, 1, 0, 0) != 0: raise OSError(ctypes.get_errno(), 'ptrace')\n    return 'attached'\nprint(json.dumps({'ptrace_attach': attempt(trace)}))",
    ),
    Case(
        "syscalls",
        "mount",
        TRY
        + "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\ndef mnt():\n    if libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) != 0: raise OSError(ctypes.get_errno(), 'mount')\n    return 'mounted'\nprint(json.dumps({'mount': attempt(mnt)}))",
    ),
    Case(
        "syscalls",
        "unshare a new user namespace",
        TRY
        + "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\ndef new_ns(flag):\n    if libc.unshare(flag) != 0: raise OSError(ctypes.get_errno(), 'unshare')\n    return 'unshared'\nprint(json.dumps({'user': attempt(lambda: new_ns(0x10000000)), 'net': attempt(lambda: new_ns(0x40000000)), 'mnt': attempt(lambda: new_ns(0x00020000))}))",
    ),
    Case(
        "syscalls",
        "clone and clone3 into a new user namespace",
        TRY + "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
        "class Args(ctypes.Structure):\n    _fields_ = [(n, ctypes.c_uint64) for n in ('flags', 'pidfd', 'child_tid', 'parent_tid', 'exit_signal', 'stack', 'stack_size', 'tls')]\n"
        "def spawn(nr, *args):\n    pid = libc.syscall(ctypes.c_long(nr), *args)\n    if pid == 0:\n        os._exit(0)\n    if pid < 0:\n        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))\n    os.waitpid(pid, 0)\n    return 'child in a new namespace'\n"
        "NEWUSER, SIGCHLD = 0x10000000, 17\n"
        "print(json.dumps({'clone_user': attempt(lambda: spawn(56, ctypes.c_ulong(NEWUSER | SIGCHLD), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))),"
        " 'clone_net': attempt(lambda: spawn(56, ctypes.c_ulong(0x40000000 | SIGCHLD), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))),"
        " 'clone3_user': attempt(lambda: spawn(435, ctypes.byref(Args(flags=NEWUSER, exit_signal=SIGCHLD)), ctypes.c_ulong(ctypes.sizeof(Args))))}))",
    ),
    Case(
        "syscalls",
        "AF_VSOCK and other unneeded socket families",
        TRY + "import ctypes, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def raw_socket(family):\n    fd = libc.syscall(ctypes.c_long(41), ctypes.c_ulong(family), ctypes.c_ulong(1), ctypes.c_ulong(0))\n    if fd < 0:\n        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))\n    os.close(fd)\n    return 'created'\n"
        "print(json.dumps({'vsock': attempt(lambda: socket.socket(40, socket.SOCK_STREAM)),"
        " 'vsock_high_bits': attempt(lambda: raw_socket((1 << 32) | 40)),"
        " 'vsock_pair': attempt(lambda: socket.socketpair(40, socket.SOCK_STREAM)),"
        " 'appletalk': attempt(lambda: raw_socket(5)), 'bluetooth': attempt(lambda: raw_socket(31)), 'can': attempt(lambda: raw_socket(29))}))",
        lambda result, arena: _refused_as_unsupported(result),
    ),
    Case(
        "syscalls",
        "setuid and setgid bits (a program left in a writable mount would run as its host owner)",
        TRY + "open('/workspace/tool', 'w').write('#!/bin/sh\\n')\n"
        "def created(mode):\n    fd = os.open('/workspace/made', os.O_CREAT | os.O_WRONLY, mode)\n    os.close(fd)\n"
        "    if os.stat('/workspace/made').st_mode & 0o6000 == 0: raise PermissionError('bits dropped')\n    return oct(mode)\n"
        "def changed(mode):\n    os.chmod('/workspace/tool', mode)\n    return oct(os.stat('/workspace/tool').st_mode)\n"
        "print(json.dumps({'chmod_suid': attempt(lambda: changed(0o4755)), 'chmod_sgid': attempt(lambda: changed(0o2755)),"
        " 'fchmod_suid': attempt(lambda: os.fchmod(os.open('/workspace/tool', os.O_RDONLY), 0o4755)),"
        " 'create_suid': attempt(lambda: created(0o4755)), 'create_sgid': attempt(lambda: created(0o2777))}))",
    ),
    Case(
        "filesystem",
        "kernel symbols, kernel log and /sys",
        TRY
        + "def listing(p):\n    names = os.listdir(p)\n    if not names: raise FileNotFoundError('empty')\n    return names\n"
        "def content(p):\n    data = open(p, 'rb').read(4096)\n    if not data: raise FileNotFoundError('empty')\n    return data\n"
        "print(json.dumps({'sys': attempt(lambda: listing('/sys')), 'kallsyms': attempt(lambda: content('/proc/kallsyms')),"
        " 'kmsg': attempt(lambda: content('/proc/kmsg')), 'kcore': attempt(lambda: content('/proc/kcore'))}))",
    ),
    Case(
        "syscalls",
        "kernel keyring",
        TRY
        + "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\ndef add_key():\n    if libc.syscall(248, b'user', b'k', b'v', 1, -4) < 0: raise OSError(ctypes.get_errno(), 'add_key')\n    return 'added'\ndef keyctl():\n    if libc.syscall(250, 0, -4, 0) < 0: raise OSError(ctypes.get_errno(), 'keyctl')\n    return 'ok'\nprint(json.dumps({'add_key': attempt(add_key), 'keyctl': attempt(keyctl)}))",
    ),
    Case(
        "syscalls",
        "bpf, perf_event_open, userfaultfd",
        TRY
        + "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\ndef call(nr, *args):\n    if libc.syscall(nr, *args) < 0: raise OSError(ctypes.get_errno(), str(nr))\n    return 'ok'\nprint(json.dumps({'bpf': attempt(lambda: call(321, 0, 0, 0)), 'perf': attempt(lambda: call(298, 0, 0, -1, -1, 0)), 'userfaultfd': attempt(lambda: call(323, 0))}))",
    ),
    Case(
        "privileges",
        "setuid binaries",
        TRY
        + "import subprocess, stat\nsuid = [os.path.join(d, f) for d in ('/usr/bin', '/usr/sbin') for f in os.listdir(d) if os.lstat(os.path.join(d, f)).st_mode & stat.S_ISUID]\nroot = []\nfor b in suid:\n    try:\n        out = subprocess.run([b, '--help'], capture_output=True, timeout=5)\n    except Exception:\n        continue\nid_out = subprocess.run(['id', '-u'], capture_output=True, text=True).stdout.strip()\nstatus = open('/proc/self/status').read()\nprint(json.dumps({'uid': ['OK', id_out] if id_out == '0' else ['not root', id_out], 'nnp': ['OK', ''] if 'NoNewPrivs:\\t1' not in status else ['no_new_privs', len(suid)]}))",
    ),
    Case(
        "privileges",
        "capabilities",
        TRY
        + "print(json.dumps({'caps': ['OK', l] if (l := [x for x in open('/proc/self/status').read().splitlines() if x.startswith('CapEff')][0]) != 'CapEff:\\t0000000000000000' else ['none', l]}))",
    ),
    Case(
        "memory",
        "raising RLIMIT_AS, then allocating past the limit",
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_AS)\n"
        "try:\n"
        "    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))\n"
        "except ValueError:\n"
        "    print('hard limit holds')\n"
        "import numpy as np\n"
        "blocks = [np.ones(2**27) for _ in range(12)]  # 12 GiB, touched",
        lambda result, arena: _memory_bounded(result),
        session={"memory_mb": 1024},
    ),
]


def _refused_as_unsupported(result: CallToolResult) -> None:
    """Each family fails as if the kernel lacked it (EAFNOSUPPORT), not with an error that would hint at a filter."""
    outcome = verdict(result)
    for name, (kind, message) in outcome.items():
        assert kind == "OSError" and "Address family not supported" in message, (name, kind, message)


def _memory_bounded(result: CallToolResult) -> None:
    """Either the hard RLIMIT_AS held (MemoryError) or the memory cgroup killed the kernel."""
    text = text_of(result)
    assert result.is_error, text
    assert "MemoryError" in text or "exceeding its memory limit of 1024 MiB" in text, text


async def attack(arena: Arena, case: Case) -> CallToolResult:
    source = case.source(arena)  # before the attacking session exists: its own sockets are no target
    created = await arena.client.call_tool("create_session", case.session)
    assert not created.is_error, text_of(created)
    session_id = json.loads(text_of(created))["session_id"]
    try:
        with anyio.fail_after(case.timeout_s + 60):
            return await run(arena.client, source, session_id=session_id, timeout_s=case.timeout_s)
    finally:
        await arena.client.call_tool("manage_sessions", {"action": "close", "session_id": session_id})


async def assert_still_serving(arena: Arena) -> None:
    normal = await run(arena.client, "sum(range(10))")
    assert not normal.is_error and text_of(normal).splitlines()[0] == "45", text_of(normal)
    bystander = await run(arena.client, "guarded, open('bystander.txt').read()", session_id=arena.bystander)
    assert f"('{BYSTANDER_VALUE}', 'mine')" in text_of(bystander), text_of(bystander)


@pytest.mark.parametrize("case", CASES, ids=[f"{case.boundary}: {case.name}" for case in CASES])
async def test_boundary_holds(arena: Arena, case: Case) -> None:
    result = await attack(arena, case)
    case.check(result, arena)
    await assert_still_serving(arena)


async def test_daemon_does_not_outlive_its_kernel(arena: Arena) -> None:
    """boundary: processes. A double-forked daemon is killed with its kernel at a reset."""
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        while True:\n"
        "            with open('/workspace/heartbeat', 'a') as f: f.write('.')\n"
        "            time.sleep(0.1)\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
        "len(open('/workspace/heartbeat').read()) > 0"
    )
    assert "True" in text_of(await run(arena.client, code))
    # The session's standby kernel (started ahead for the reset; none on some backends) is up, so that
    # `before` counts it too.
    with anyio.fail_after(60):
        while (
            json.loads(text_of(await arena.client.call_tool("manage_sessions", {"action": "status"}))).get("standby")
            or {}
        ).get("state", "ready") != "ready":
            await anyio.sleep(0.1)
    before = len(sandbox_processes_alive(arena.dirs))
    reset = await arena.client.call_tool("kernel_reset", {})
    assert not reset.is_error
    size = len(text_of(await run(arena.client, "open('heartbeat').read()")))
    await anyio.sleep(1.0)
    later = len(text_of(await run(arena.client, "open('heartbeat').read()")))
    assert later == size, "the daemon kept writing after the kernel reset"
    assert len(sandbox_processes_alive(arena.dirs)) <= before
    await assert_still_serving(arena)


async def test_one_gigabyte_printed_keeps_the_server_bounded(arena: Arena) -> None:
    """boundary: output. 1 GB through stdout: every reply is bounded and so is the server's memory. The
    kernel needs about 11 CPU-s for it, and sessions get only idle CPU: on a loaded machine the run goes on
    as a job (as it would for a user: detach_after_s), read to its end."""
    server_pid = _server_pid(arena)
    began = time.monotonic()
    replies = await run_to_end(
        arena.client,
        "import sys\nchunk = 'G' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)\nprint('end')",
        timeout_s=1200,  # the most run_to_end waits for (JOB_WAITS x JOB_WAIT_S)
        detach_after_s=40,
    )
    elapsed = time.monotonic() - began
    texts = [text_of(reply) for reply in replies]
    assert all(len(text) < 30_000 for text in texts), [len(text) for text in texts]
    assert "end" in texts[-1] and not replies[-1].is_error, texts[-1][-2000:]
    assert any("characters omitted" in text or "characters not shown here" in text for text in texts)
    peak_mb = _peak_rss_mb(server_pid)
    print(f"\n[abuse] 1 GiB printed in {elapsed:.1f}s ({len(replies)} replies); server peak RSS {peak_mb:.0f} MiB")
    assert peak_mb < 1024, "the server must not hold the flood in memory"
    await assert_still_serving(arena)


def _server_pid(arena: Arena) -> int:
    """The coderunner serve process whose runtime dir is the arena's."""
    needle = str(arena.dirs.runtime).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in environ and b"serve" in cmdline and b"bwrap" not in cmdline:
            return int(entry)
    raise AssertionError("server process not found")


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


async def test_root_server_sandboxes_are_not_root_on_the_host(arena: Arena) -> None:
    """boundary: host identity. Under a root server the sandbox's uid maps to an unprivileged host user."""
    await run(arena.client, "import time\ntime.sleep(0.1)")
    pids = sandbox_processes_alive(arena.dirs)
    assert pids
    host_uids = set()
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                host_uids.update(int(value) for value in line.split()[1:])
    if os.getuid() == 0:
        assert 0 not in host_uids, f"sandbox processes run as host root: {host_uids}"
    else:
        assert host_uids == {os.getuid()}
    assert Path("/proc/sys/kernel/core_pattern").read_text().strip() != "|/workspace/x"
    await assert_still_serving(arena)


async def test_one_shot_sandboxes_hold_the_same_boundaries(arena: Arena) -> None:
    """boundary: execute_code. A throwaway sandbox tries the host's files, loopback, sockets, env and root."""
    probe = TRY + (
        "def tcp():\n    return reach('127.0.0.1', PORT)\n"
        "def abstract():\n    return reach_abstract(NAME)\n"
        "print(json.dumps({\n"
        "  'bystander': attempt(lambda: open(BYSTANDER + '/bystander.txt').read()),\n"
        "  'host_root': attempt(lambda: os.listdir('/root')),\n"
        "  'shadow': attempt(lambda: open('/etc/shadow').read()),\n"
        "  'write_usr': attempt(lambda: open('/usr/pwned', 'w')),\n"
        "  'loopback': attempt(tcp),\n"
        "  'abstract': attempt(abstract),\n"
        "  'secret': attempt(lambda: os.environ[SECRET] if SECRET in os.environ else 1 / 0),\n"
        "  'setuid_root': attempt(lambda: os.setuid(0)),\n"
        "}))"
    )
    result = await arena.client.call_tool(
        "execute_code",
        {
            "language": "python",
            "code": probe,
            "variables": json.dumps(
                {
                    "PORT": arena.loopback_port,
                    "NAME": arena.abstract_socket,
                    "BYSTANDER": str(arena.bystander_workspace),
                    "SECRET": SECRET_NAME,
                }
            ),
        },
    )
    stdout = json_of(result)["stdout"]
    outcome = json.loads(stdout.strip().splitlines()[-1])
    crossed = {name: value for name, value in outcome.items() if value[0] == "OK"}
    assert not crossed, crossed
    assert not arena.host.reached, arena.host.reached
    assert SECRET_VALUE not in stdout
    await assert_still_serving(arena)
