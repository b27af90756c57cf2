"""Issue 38: sandboxed code takes over its sandbox's pid 1 and outlives its session, a reset, its server.

The attack, exactly: code sent to run_python opens /proc/1/mem read-write (pid 1 was bwrap's own init,
of the sandbox's uid and dumpable; the seccomp filter denies ptrace and process_vm_writev, not this),
blanks the watcher's mark in pid 1's argv, writes machine code where pid 1 waits in wait4 (prctl
PR_SET_PDEATHSIG 0, then pause for ever), and kills pid 2 so that pid 1 wakes into it. It also leaves a
survivor (a sleeping process) in the namespace. Then the session is closed, the kernel reset, or the
server SIGKILLed: within SURVIVAL_S nothing may be left in that pid namespace (the host's /proc is
scanned for any process whose pid namespace is the sandbox's), a bystander session keeps its state,
and the server (or, for the SIGKILL, the bystander's server) still serves. With and without cgroups:
without them nothing but the host's handle on pid 1 ends the namespace. A SIGKILLed server must leave
nothing of ANY of its sandboxes either (its standby, its pool's, one half-way through its start), not
only of the attacked one: every process that names the server's dirs in its command line or its mounts.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
from mcp.types import CallToolResult

from coderunner.sandbox.common import ENV_MOUNT

from ..conftest import ServerDirs, fresh_dirs, json_of, raw_stdio_server, run, server_env, text_of, wait_until
from .conftest import BYSTANDER_VALUE, Arena, HostTargets, open_arena

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: How long anything of an ended sandbox may live on.
SURVIVAL_S = 10.0
#: A second look after a scan found nothing left of a server's sandboxes (nothing_left_of).
RESCAN_S = 1.0
#: prctl(PR_SET_PDEATHSIG, 0), then pause() for ever: 23 bytes of x86-64.
X86_64 = "bf01000000 31f6 b89d000000 0f05 b822000000 0f05 ebf7"
#: The same on arm64 (no pause there: ppoll(NULL, 0, NULL, NULL) for ever).
AARCH64 = (
    "200080d2 010080d2 e81480d2 010000d4 "  # x0=1 x1=0 x8=167 (prctl) svc
    "000080d2 010080d2 020080d2 030080d2 280980d2 010000d4 faffff17"  # x0..x3=0 x8=73 (ppoll) svc; b back
)
PAYLOADS = {"x86_64": X86_64, "aarch64": AARCH64}

ATTACK = """
import json, os, re, subprocess
PAYLOAD = bytes.fromhex({payload!r})
report = {{"pidns": os.readlink("/proc/self/ns/pid"),
          "cmdline": open("/proc/1/cmdline", "rb").read().decode("latin-1")}}
# A survivor in the namespace, whatever becomes of the kernel.
subprocess.Popen(["/bin/sh", "-c", "sleep 900; true", {token!r}], start_new_session=True,
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    mem = os.open("/proc/1/mem", os.O_RDWR)
except OSError as exc:
    report["mem"] = "refused: " + exc.strerror
else:
    fields = open("/proc/1/stat").read().rpartition(")")[2].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: pid 1's argv in its memory
    for found in re.finditer(rb"CODERUNNER_[A-Za-z0-9_]+", os.pread(mem, end - start, start)):
        os.pwrite(mem, b"X" * len(found.group()), start + found.start())
    pc = int(open("/proc/1/syscall").read().split()[-1], 16)  # where pid 1 returns from wait4
    os.pwrite(mem, PAYLOAD, pc)
    os.close(mem)
    report["mem"] = "written"
    # pid 2 (this kernel) dies once this reply is out; pid 1 wakes into the payload.
    subprocess.Popen(["/bin/sh", "-c", "sleep 1; kill -9 2"], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(json.dumps(report))
"""


def payload() -> str:
    machine = platform.machine()
    if machine not in PAYLOADS:
        pytest.skip(f"the attack's machine code is written for x86-64 and arm64, not {machine}")
    return PAYLOADS[machine]


#: fds of the pid namespaces a test looks at, held until it ends (pin_namespace).
_pinned: list[int] = []


@pytest.fixture(autouse=True)
def _unpin() -> Iterator[None]:
    yield
    while _pinned:
        os.close(_pinned.pop())


def pin_namespace(pid: int) -> str:
    """The pid namespace of `pid` ("pid:[inode]"), held open until the test ends: an ended namespace's
    number goes to the next one made (often another sandbox's, a moment later), which in_namespace
    would then find alive."""
    fd = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY)
    _pinned.append(fd)
    return os.readlink(f"/proc/self/fd/{fd}")


def in_namespace(pidns: str) -> list[int]:
    """Host pids of every process whose pid namespace is `pidns` ("pid:[inode]")."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "pid") == pidns:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def with_token(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def report_of(result: CallToolResult) -> dict[str, str]:
    for line in reversed(text_of(result).splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no report in: {text_of(result)[-2000:]}")


async def nothing_left(pidns: str) -> None:
    assert pidns.startswith("pid:["), pidns
    assert await wait_until(lambda: not in_namespace(pidns), SURVIVAL_S), [
        (pid, Path(f"/proc/{pid}/cmdline").read_bytes()[:80]) for pid in in_namespace(pidns)
    ]


def of_server(dirs: ServerDirs) -> list[int]:
    """Host pids of every process left of the sandboxes of the server that had `dirs`: the dirs' unique
    name is in its command line (a bwrap or a start prelude, however far the start went), or among the
    mounts of a sandbox (anything inside one once bwrap made its root, whatever it exec'd since). A
    sandbox's mounts are told by its workspace at /workspace: the host's own mount table, and a copy of
    it in a bwrap that has not made its root yet, may name the dirs too (a workspace mounted there)."""
    mark = dirs.root.name.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark in (entry / "cmdline").read_bytes() or in_sandbox_mounts(mark, entry):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def in_sandbox_mounts(mark: bytes, process: Path) -> bool:
    mounts = (process / "mountinfo").read_bytes()
    return mark in mounts and b" /workspace " in mounts


def described(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes()[:60]
    except OSError:
        return f"{pid}: gone"
    name, nspid, parent = fields["Name"].strip(), fields["NSpid"].split(), fields["PPid"].strip()
    return f"{pid}: {name} NSpid {nspid} PPid {parent} waits in {wchan} {command!r}"


async def nothing_left_of(dirs: ServerDirs) -> None:
    """Nothing of any sandbox of that server's within SURVIVAL_S, and still nothing a moment later: one
    scan lists /proc once, and misses a child made after that by a process that ends before it is read
    (a bwrap that dies right after its clone)."""
    deadline = time.monotonic() + SURVIVAL_S
    while True:
        left = of_server(dirs)
        if not left:
            await anyio.sleep(RESCAN_S)
            left = of_server(dirs)
            if not left:
                return
        assert time.monotonic() < deadline, [described(pid) for pid in left]
        await anyio.sleep(0.1)


async def bystander_unharmed(arena: Arena) -> None:
    kept = await run(arena.client, "guarded", session_id=arena.bystander)
    assert not kept.is_error and BYSTANDER_VALUE in text_of(kept), text_of(kept)
    served = await run(arena.client, "6 * 7")
    assert not served.is_error and text_of(served).splitlines()[0] == "42", text_of(served)


#: The servers each case runs against: with and without cgroups (without them nothing but the host's handle on
#: pid 1 ends a namespace), and with the Python init where the compiled one (guest/sandbox_init.c) is the default.
ARENAS = {
    "cgroups": {"CODERUNNER_CGROUPS": "true"},
    "no-cgroups": {"CODERUNNER_CGROUPS": "false"},
    "python-init": {"CODERUNNER_CGROUPS": "true", "CODERUNNER_COMPILED_INIT": "false"},
}


def arena_settings(request: pytest.FixtureRequest) -> dict[str, str]:
    return ARENAS[request.node.callspec.params["pid1_arena"]]


@pytest.fixture(scope="module", params=list(ARENAS))
async def pid1_arena(request: pytest.FixtureRequest, host_listeners: HostTargets) -> AsyncIterator[Arena]:
    """A server as ARENAS says, and its bystander session."""
    with fresh_dirs("crp-") as dirs:
        async with open_arena(dirs, host_listeners, **ARENAS[request.param]) as made:
            yield made


async def attack(arena: Arena, session_id: str) -> dict[str, str]:
    token = f"survivor-{secrets.token_hex(6)}"
    result = await run(arena.client, ATTACK.format(payload=payload(), token=token), session_id=session_id)
    report = report_of(result)
    assert await wait_until(lambda: len(with_token(token)) >= 1, 10), "the survivor did not start"
    assert pin_namespace(with_token(token)[0]) == report["pidns"], report
    if report["mem"] == "written":
        await anyio.sleep(2)  # pid 2 is killed a second after the reply: pid 1 now runs the payload
    return report


async def new_session(arena: Arena) -> str:
    return str(json_of(await arena.client.call_tool("create_session", {}))["session_id"])


async def test_pid_1_cannot_be_written_and_names_no_watcher(pid1_arena: Arena, request: pytest.FixtureRequest) -> None:
    """Nothing in the sandbox can write its pid 1: /proc/1/mem and /proc/1/syscall are refused, and
    signals from inside do not reach it; its command line carries no mark of the host's watcher. pid 1 is the
    compiled init (`coderunner setup` built it: install.sh installs a C compiler) unless the server said Python."""
    code = """
import json, os, signal, time
def attempt(fn):
    try:
        return ["OK", repr(fn())[:100]]
    except OSError as exc:
        return [type(exc).__name__, exc.strerror]
def kill_one():
    os.kill(1, signal.SIGKILL); time.sleep(0.2); return open("/proc/1/cmdline", "rb").read()[:40]
print(json.dumps({
    "mem": attempt(lambda: os.close(os.open("/proc/1/mem", os.O_RDWR))),
    "syscall": attempt(lambda: open("/proc/1/syscall").read()),
    "kill": attempt(kill_one),
    "cmdline": open("/proc/1/cmdline", "rb").read().decode("latin-1"),
}))
"""
    session = await new_session(pid1_arena)
    found = report_of(await run(pid1_arena.client, code, session_id=session))
    assert found["mem"][0] == "PermissionError", found
    assert found["syscall"][0] == "PermissionError", found
    assert found["kill"][0] == "OK", found  # the signal is ignored: pid 1 is still there
    assert "CODERUNNER_SANDBOX_OF" not in found["cmdline"] and "unsetenv" not in found["cmdline"], found
    if arena_settings(request).get("CODERUNNER_COMPILED_INIT") == "false":
        assert "coderunner_guest.sandbox_init" in found["cmdline"], found
    else:
        assert found["cmdline"].startswith(f"{ENV_MOUNT}/libexec/sandbox-init-"), f"not the compiled init: {found}"
    again = await run(pid1_arena.client, "1 + 1", session_id=session)
    assert text_of(again).splitlines()[0] == "2", text_of(again)
    await bystander_unharmed(pid1_arena)


async def test_a_taken_over_pid_1_dies_when_its_session_is_closed(pid1_arena: Arena) -> None:
    session = await new_session(pid1_arena)
    report = await attack(pid1_arena, session)
    closed = await pid1_arena.client.call_tool("manage_sessions", {"action": "close", "session_id": session})
    assert not closed.is_error, text_of(closed)
    await nothing_left(report["pidns"])
    await bystander_unharmed(pid1_arena)


async def test_a_taken_over_pid_1_dies_when_its_kernel_is_reset(pid1_arena: Arena) -> None:
    session = await new_session(pid1_arena)
    report = await attack(pid1_arena, session)
    reset = await pid1_arena.client.call_tool("kernel_reset", {"session_id": session})
    assert not reset.is_error, text_of(reset)
    await nothing_left(report["pidns"])
    after = await run(pid1_arena.client, "1 + 1", session_id=session)
    assert not after.is_error and text_of(after).splitlines()[0] == "2", text_of(after)
    await bystander_unharmed(pid1_arena)


async def test_a_taken_over_pid_1_dies_with_its_sigkilled_server(
    pid1_arena: Arena, request: pytest.FixtureRequest
) -> None:
    """The doomed server is a second one (cgroups as the arena's), driven by hand; the arena's server is
    the bystander's."""
    token = f"survivor-{secrets.token_hex(6)}"
    with fresh_dirs("crk-") as dirs:
        env = server_env(dirs, **arena_settings(request))
        calls: list[tuple[str, dict[str, object]]] = [
            ("run_python", {"code": ATTACK.format(payload=payload(), token=token)})
        ]
        with raw_stdio_server(env, calls) as doomed:
            assert await wait_until(lambda: len(with_token(token)) >= 1, 30), "the survivor did not start"
            pidns = pin_namespace(with_token(token)[0])  # (its sh may be forking sleep: two)
            await anyio.sleep(2)  # the payload's kill of pid 2, where the write went through
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(timeout=10)
            await nothing_left(pidns)
            await nothing_left_of(dirs)
        await bystander_unharmed(pid1_arena)


async def test_a_sigkilled_server_whose_watcher_died_first_still_leaves_nothing(
    pid1_arena: Arena, request: pytest.FixtureRequest
) -> None:
    """Each sandbox's init ends with its gate, whose only writer was the server: the watcher is not the
    only thing between a dead server and its sandboxes."""
    token = f"survivor-{secrets.token_hex(6)}"
    with fresh_dirs("crw-") as dirs:
        env = server_env(dirs, **arena_settings(request))
        calls: list[tuple[str, dict[str, object]]] = [
            ("run_python", {"code": ATTACK.format(payload=payload(), token=token)})
        ]
        with raw_stdio_server(env, calls) as doomed:
            assert await wait_until(lambda: len(with_token(token)) >= 1, 30), "the survivor did not start"
            pidns = pin_namespace(with_token(token)[0])
            (watcher,) = [pid for pid in with_token("pid_watcher.py") if parent_of(pid) == doomed.pid]
            os.kill(watcher, signal.SIGKILL)
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(timeout=10)
            await nothing_left(pidns)
            await nothing_left_of(dirs)  # its other sandboxes too: the session's standby, say
        await bystander_unharmed(pid1_arena)


#: A stand-in bwrap that waits before it becomes the real one: a start held where the server has said
#: "go" (the prelude's gate) and bwrap has not yet reported its child on --info-fd.
SLOW_BWRAP = '#!/bin/sh\nsleep {delay}\nexec {real} "$@"\n'
#: How long each start of the doomed server waits there.
SLOW_START_S = 2.0


def held_starts(stand_in: Path, server: int) -> list[int]:
    """The server's starts held in the stand-in (its own script, not a start prelude naming it)."""
    held = []
    for pid in with_token(str(stand_in)):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:2] == [str(stand_in).encode()] and parent_of(pid) == server:
            held.append(pid)
    return held


def slow_bwrap(dirs: ServerDirs) -> Path:
    """The stand-in, in a folder of its own under `dirs` (passable: a root server's sandboxes run as others)."""
    real = shutil.which("bwrap")
    assert real is not None, "bubblewrap is not installed"
    folder = dirs.root / "bin"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    stand_in = folder / "bwrap"
    stand_in.write_text(SLOW_BWRAP.format(delay=SLOW_START_S, real=real))
    stand_in.chmod(0o755)
    return stand_in


async def test_a_sigkilled_server_whose_watcher_died_first_leaves_nothing_of_a_start_under_way(
    pid1_arena: Arena, request: pytest.FixtureRequest
) -> None:
    """The kill lands while one of the server's sandboxes (a session's kernel, its standby, the pool's) is
    starting: the server has let bwrap go and waits for its report, then it and its watcher are gone. bwrap still
    reports its child and lets it go, and the child, the namespace's pid 1, still ends with its gate:
    nothing of any sandbox of that server is left. (bwrap 0.8 writes the report before its child may go
    on; with nobody left to read it, it died of SIGPIPE, and its child waited for ever, pid 1 of a
    namespace no handle reached.)"""
    with fresh_dirs("crs-") as dirs:
        stand_in = slow_bwrap(dirs)
        env = server_env(dirs, **arena_settings(request), CODERUNNER_POOL_SIZE="1")
        env["PATH"] = f"{stand_in.parent}:{env['PATH']}"
        with raw_stdio_server(env, [("run_python", {"code": "1 + 1"})]) as doomed:
            # A start that nothing cancels (the session's standby may be one too): a second session's kernel,
            # or the pool's next one if that session takes the pool's. Its reply is never read.
            assert doomed.stdin is not None
            params = {"name": "create_session", "arguments": {}}
            create = {"jsonrpc": "2.0", "id": 99, "method": "tools/call", "params": params}
            doomed.stdin.write(json.dumps(create).encode() + b"\n")
            doomed.stdin.flush()
            assert await wait_until(lambda: bool(held_starts(stand_in, doomed.pid)), 60), "no start came"
            (watcher,) = [pid for pid in with_token("pid_watcher.py") if parent_of(pid) == doomed.pid]
            os.kill(watcher, signal.SIGKILL)
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(timeout=10)
            await nothing_left_of(dirs)
        await bystander_unharmed(pid1_arena)


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None
