"""Issue 41's invariants for kernels forked from the template (route A: sandbox/bwrap_template.py), first ones.

Real sandboxes of the bwrap backend, each entered by a fork of one real template, whose forks run a probe from
their own workspace (the template is started with a child program that runs it, in place of the kernel):
- a child is confined exactly as the process bwrap started in the same sandbox (ids, capabilities, no_new_privs,
  seccomp, namespaces, cgroups, rlimits);
- no fd and no thread of the template survives into a child;
- two children draw different `random`, `numpy.random` and `secrets` values;
- a child cannot signal, ptrace or open the memory of the template, another child or the host's process by
  their host pids, nor see them in its /proc; a `kill(-1, SIGKILL)` from it leaves the template serving and
  its sibling answering;
- handed anything but a finished sandbox (a root not read-only, a pid 1 not its init), a fork refuses;
- the host's page plan makes a fork copy only the template's own pages, and nothing else.
Root only (the template joins user namespaces), bwrap only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup

from coderunner.config import load_settings
from coderunner.hostfs.private_dirs import ensure_private_dir
from coderunner.hostfs.session_dirs import SandboxDirs
from coderunner.sandbox import make_backend
from coderunner.sandbox.base import SandboxProcess
from coderunner.sandbox.bwrap import BwrapBackend
from coderunner.sandbox.bwrap_template import (
    KIND_FORK,
    PLACEHOLDER,
    REPORT,
    KernelTemplate,
    TemplateUnavailable,
    encode_request,
)
from coderunner.sandbox.pid1 import SandboxHold as BwrapHold
from coderunner.sandbox.template_kernels import STATUS, exit_code
from coderunner.sandbox.template_pages import EXCLUSIVE, MAX_PAGES, PAGE, PRESENT, writable_private_mappings
from coderunner.sessions.leases import SandboxLeases, sandbox_spec
from coderunner.sessions.sandbox_options import SandboxOptions, sandbox_options

from ..conftest import fresh_dirs

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: What every fork of the test's template runs once confined: the probe its workspace holds.
CHILD = "exec(open('/workspace/probe.py').read())"
PROBE = r"""
import ctypes, json, os, random, secrets, signal, socket
import numpy
params = json.load(open("/workspace/params.json"))
report = {
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "fd_targets": [os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)],
    "threads": len(os.listdir("/proc/self/task")),
    "random": random.random(), "numpy": float(numpy.random.random()), "secrets": secrets.token_hex(16),
    "procs": sorted(int(pid) for pid in os.listdir("/proc") if pid.isdigit()), "pid": os.getpid(),
    "blas": float((numpy.ones((300, 300)) @ numpy.ones((300, 300)))[0, 0]),  # BLAS's threads after the fork
}
if params["attack"]:
    libc = ctypes.CDLL(None, use_errno=True)
    found = {}
    for pid in params["host_pids"]:
        try:
            os.kill(pid, signal.SIGKILL)
            found[f"kill {pid}"] = "sent"
        except OSError as exc:
            found[f"kill {pid}"] = exc.errno
        try:
            open(f"/proc/{pid}/mem", "rb").close()
            found[f"mem {pid}"] = "opened"
        except OSError as exc:
            found[f"mem {pid}"] = exc.errno
    for pid in sorted(set(report["procs"]) | set(params["host_pids"])):
        if pid != os.getpid():
            found[f"ptrace {pid}"] = ctypes.get_errno() if libc.ptrace(16, pid, 0, 0) == -1 else "attached"
    report["attack"] = found
sock = socket.socket(socket.AF_UNIX)
sock.connect("/workspace/answer.sock")
sock.sendall(json.dumps(report).encode() + b"\n")
if params.get("fail"):
    raise RuntimeError("the kernel ended by an exception")
if params["attack"]:
    try:  # everything it may signal: its own namespace's processes but pid 1 and itself
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:  # there are none: the init holds the sandbox, no program beside this one
        pass
if sock.recv(1):
    sock.sendall(b"alive")
os._exit(0)
"""


@dataclass
class World:
    backend: BwrapBackend
    leases: SandboxLeases
    options: SandboxOptions
    ceiling: str
    template: KernelTemplate
    task_group: TaskGroup


@dataclass
class Child:
    sandbox: SandboxProcess
    dirs: SandboxDirs
    conn: socket.socket
    host_pid: int
    report: dict[str, Any]


@contextlib.asynccontextmanager
async def template_world() -> AsyncIterator[World]:
    if os.getuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the kernel template needs root and bwrap")
    with fresh_dirs("ctt-") as made:  # nothing of its sandboxes may stay mounted, whatever a test did
        settings = load_settings(
            Path(os.devnull), runtime_dir=made.runtime, workspaces_dir=made.workspaces, backend="bwrap"
        )
        backend = make_backend(settings)
        assert isinstance(backend, BwrapBackend)
        ensure_private_dir(settings.runtime_dir, backend.dir_mode)
        ensure_private_dir(settings.workspaces_dir, backend.dir_mode)
        leases = SandboxLeases(settings, backend, None)
        options = sandbox_options(settings, backend, [])
        template = await KernelTemplate.start(backend.command, backend.seccomp_filter, child_code=CHILD)
        try:
            async with anyio.create_task_group() as tg:
                yield World(backend, leases, options, settings.network_ceiling, template, tg)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await template.close()
            backend.close_starts()  # as a manager does as it ends


async def start_child(world: World, output_fd: int = 2, status_fd: int | None = None, **params: Any) -> Child:
    """A sandbox entered by a fork of the template, once it has sent its report (its stdout and stderr
    `output_fd`; `status_fd`: its wait status, once the template reaped it)."""
    dirs = await world.leases.open_dirs(world.options, throwaway=True)
    spec = sandbox_spec(world.options, dirs, (), world.ceiling)
    workspace = dirs.workspace.path
    (workspace / "probe.py").write_text(PROBE)
    (workspace / "params.json").write_text(json.dumps({"attack": False, "host_pids": [], **params}))
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(str(workspace / "answer.sock"))
        os.chmod(workspace / "answer.sock", 0o666)
        listener.listen(1)
        listener.setblocking(False)
        sandbox, answer = await world.template.spawn_entered(
            world.backend, spec, world.task_group, output_fd, status_fd=status_fd
        )
        if answer.pidfd is not None:
            os.close(answer.pidfd)
        with anyio.fail_after(60):
            await anyio.wait_readable(listener)
        conn, _ = listener.accept()
    finally:
        listener.close()
    conn.setblocking(True)
    pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    data = b""
    while not data.endswith(b"\n") and (chunk := await anyio.to_thread.run_sync(conn.recv, 65536)):
        data += chunk
    return Child(sandbox, dirs, conn, pid, json.loads(data))


async def end_child(world: World, child: Child) -> None:
    child.conn.close()
    await child.sandbox.kill()
    await world.leases.close_dirs(child.dirs)


async def still_answers(child: Child) -> bool:
    child.conn.send(b"x")
    with anyio.fail_after(10):
        return await anyio.to_thread.run_sync(child.conn.recv, 16) == b"alive"


#: What /proc/PID/status says of a process's confinement.
CONFINEMENT_FIELDS = (
    "Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp",
    "Seccomp_filters",
)  # fmt: skip


def status_of(pid: int) -> dict[str, str]:
    fields = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def host_pid_of(pidfd: int) -> int:
    with open(f"/proc/self/fdinfo/{pidfd}") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("Pid:"))


def init_of(sandbox: SandboxProcess) -> int:
    """The host pid of a sandbox's init (its pid 1: the process bwrap itself confined and exec'd)."""
    hold = sandbox.hold
    assert isinstance(hold, BwrapHold) and hold.init is not None
    return host_pid_of(hold.init)


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if status_of(int(entry)).get("PPid") == str(pid):
                    found.append(int(entry))
    return found


@contextlib.asynccontextmanager
async def cold_program(world: World) -> AsyncIterator[int]:
    """The host pid of a program bwrap (and its prlimit) started in a sandbox of the same options, as a cold
    start's kernel is: what a template's child must be confined as."""
    dirs = await world.leases.open_dirs(world.options, throwaway=True)
    spec = sandbox_spec(world.options, dirs, (), world.ceiling)
    sandbox = await world.backend.spawn(spec, PLACEHOLDER, world.task_group, pipes=True)
    try:
        with anyio.fail_after(60):
            assert (await sandbox.streams[1].receive()).startswith(b"ready")
        (program,) = children_of(init_of(sandbox))
        yield program
    finally:
        await sandbox.kill()
        await world.leases.close_dirs(dirs)


async def test_a_child_is_confined_as_the_process_bwrap_started_in_its_sandbox() -> None:
    """Ids, groups, every capability set, no_new_privs, the seccomp filter and the rlimits of a child are those
    of a program bwrap (and its prlimit) started cold from the same options; its namespaces and cgroups are those
    of its own sandbox's init, the process bwrap confined there (a template's sandbox runs no program: HOLD)."""
    async with template_world() as world, cold_program(world) as cold:
        child = await start_child(world)
        try:
            init = init_of(child.sandbox)
            ours, colds = status_of(child.host_pid), status_of(cold)
            assert {key: ours[key] for key in CONFINEMENT_FIELDS} == {key: colds[key] for key in CONFINEMENT_FIELDS}
            assert {key: ours[key] for key in CONFINEMENT_FIELDS} == {
                key: status_of(init)[key] for key in CONFINEMENT_FIELDS
            }
            assert ours["CapEff"] == ours["CapBnd"] == "0" * 16 and ours["Seccomp"] == "2"
            # Dumpable as an exec'd process: its /proc entries are its user's (a non-dumpable one's are root's).
            assert os.stat(f"/proc/{child.host_pid}/mem").st_uid == os.stat(f"/proc/{cold}/mem").st_uid != 0
            for name in ("user", "mnt", "net", "ipc", "uts", "cgroup", "pid"):
                assert os.readlink(f"/proc/{child.host_pid}/ns/{name}") == os.readlink(f"/proc/{init}/ns/{name}")
            assert Path(f"/proc/{child.host_pid}/cgroup").read_text() == Path(f"/proc/{init}/cgroup").read_text()
            assert Path(f"/proc/{child.host_pid}/limits").read_text() == Path(f"/proc/{cold}/limits").read_text()
            assert os.readlink(f"/proc/{child.host_pid}/ns/pid") != os.readlink(f"/proc/{world.template.pid}/ns/pid")
            assert children_of(init) == []  # no program beside the child: the init holds the sandbox
        finally:
            await end_child(world, child)


async def test_no_fd_or_thread_of_the_template_reaches_a_child() -> None:
    async with template_world() as world:
        child = await start_child(world)
        try:
            # 0-2 and the fd listdir read /proc/self/fd through; nothing else (the template's socket, its pipes).
            assert len(child.report["fds"]) == 4 and child.report["fds"][:3] == [0, 1, 2]
            assert child.report["fd_targets"][0] == "/dev/null"
            assert child.report["threads"] == 1
            assert child.report["blas"] == 300.0
            assert world.template.ready.threads == 1  # a fork takes only its own thread; the template had one
        finally:
            await end_child(world, child)


async def test_two_children_draw_different_values() -> None:
    async with template_world() as world:
        first = await start_child(world)
        try:
            second = await start_child(world)
            try:
                for name in ("random", "numpy", "secrets"):
                    assert first.report[name] != second.report[name], name
            finally:
                await end_child(world, second)
        finally:
            await end_child(world, first)


async def test_a_child_cannot_reach_the_template_or_a_sibling() -> None:
    async with template_world() as world:
        sibling = await start_child(world)
        try:
            targets = [world.template.pid, sibling.host_pid, os.getpid()]
            attacker = await start_child(world, attack=True, host_pids=targets)
            try:
                found = attacker.report["attack"]
                for pid in targets:
                    assert pid not in attacker.report["procs"]
                    assert found[f"kill {pid}"] == errno.ESRCH  # no such process in its pid namespace
                    assert found[f"mem {pid}"] == errno.ENOENT  # nor in its /proc
                assert {key: value for key, value in found.items() if key.startswith("ptrace")}
                assert all(value == errno.EPERM for key, value in found.items() if key.startswith("ptrace"))
                # Its kill(-1, SIGKILL) (sent before it answers) reached nothing: not even its sandbox's init, pid 1,
                # which holds the sandbox (HOLD: no program beside the child to kill), nor itself.
                assert await still_answers(attacker)
                assert status_of(init_of(attacker.sandbox))["State"].startswith("S")
                os.kill(world.template.pid, 0)
                assert (await world.template.counters()).error == 0
                assert await still_answers(sibling)
            finally:
                await end_child(world, attacker)
        finally:
            await end_child(world, sibling)


async def test_a_kernel_ended_by_an_exception_exits_in_its_fork_never_back_in_the_templates_code() -> None:
    """An exception that ends a fork's kernel (its code raises once it answered) is printed and the fork exits with
    1 there: it never unwinds into the template's own code (its serve loop) in the fork."""
    read_output, write_output = os.pipe()
    read_status, write_status = os.pipe()
    try:
        async with template_world() as world:
            child = await start_child(world, output_fd=write_output, status_fd=write_status, fail=True)
            try:
                for fd in (write_output, write_status):
                    os.close(fd)
                write_output = write_status = -1
                with anyio.fail_after(30):
                    await anyio.wait_readable(read_status)
                assert exit_code(STATUS.unpack(os.read(read_status, 64))[0]) == 1
                said = b""
                while chunk := os.read(read_output, 65536):  # every writer gone: the fork exited
                    said += chunk
                text = said.decode(errors="replace")
                assert "RuntimeError: the kernel ended by an exception" in text, text
                assert "in serve" not in text and "in fork_kernel" not in text, text
                assert (await world.template.counters()).error == 0
            finally:
                await end_child(world, child)
    finally:
        for fd in (read_output, write_output, read_status, write_status):
            if fd >= 0:
                os.close(fd)


@contextlib.asynccontextmanager
async def stranger_pidfd() -> AsyncIterator[int]:
    """A pidfd of a process whose namespaces are not a finished sandbox's (its root the host's, writable, its pid 1
    not the sandbox's init: what a fork would meet in bwrap's scaffolding)."""
    stranger = await anyio.open_process(
        ["/usr/bin/unshare", "--user", "--map-root-user", "--mount", "--net", "--ipc", "--uts", "--cgroup",
         "--pid", "--fork", "/usr/bin/sleep", "60"],
        stdin=None, stdout=None, stderr=None,
    )  # fmt: skip
    try:
        with anyio.fail_after(10):
            while not (inner := _only_child(stranger.pid)):
                await anyio.sleep(0.02)
        pidfd = os.pidfd_open(inner)
        try:
            yield pidfd
        finally:
            os.close(pidfd)
    finally:
        stranger.kill()
        await stranger.wait()


async def fork_then(world: Any, pidfd: int, go: bytes) -> tuple[bytes, int]:
    """A fork request by hand, then `go` on its go pipe (b"": only its end); what it reported, and its pidfd."""
    go_read, go_write = os.pipe()
    report_read, report_write = os.pipe()
    try:
        request = encode_request(KIND_FORK, uid=1000, gid=1000, environment={"PATH": "/usr/bin"})
        try:
            answer = await world.template._ask(request, [pidfd, 2, go_read, report_write])
        finally:
            for fd in (go_read, report_write):  # the fork holds its own
                os.close(fd)
        assert answer.error == 0 and answer.pidfd is not None  # forked, waiting for "go"
        if go:
            os.write(go_write, go)
        os.close(go_write)
        go_write = -1
        with anyio.fail_after(20):
            await anyio.wait_readable(report_read)
        return os.read(report_read, REPORT.size), answer.pidfd
    finally:
        for fd in (go_write, report_read):
            if fd >= 0:
                os.close(fd)


async def test_the_template_enters_nothing_but_a_finished_sandbox() -> None:
    """Handed a pidfd of a process whose namespaces are not a finished sandbox's, the fork refuses once told to go,
    before anything of it runs, and the template serves on."""
    async with template_world() as world, stranger_pidfd() as pidfd:
        said, fork = await fork_then(world, pidfd, b"1")
        os.close(fork)
        assert REPORT.unpack(said)[0] == -errno.EAGAIN  # it refused: nothing of it ran
        assert (await world.template.counters()).error == 0


async def test_a_fork_never_told_to_go_exits_having_entered_nothing() -> None:
    """A start abandoned before its sandbox was finished closes the fork's "go" unsaid: the fork exits without a
    word (no setns, no kernel), and the template serves on."""
    async with template_world() as world, stranger_pidfd() as pidfd:
        said, fork = await fork_then(world, pidfd, b"")
        try:
            assert said == b""  # its end of the report pipe, nothing said
            with anyio.fail_after(10):
                await anyio.wait_readable(fork)  # it exited
        finally:
            os.close(fork)
        assert (await world.template.counters()).error == 0


def _only_child(pid: int) -> int | None:
    """The child of `pid` once it exec'd sleep (unshare --fork's), else None."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                fields = status_of(int(entry))
                if fields.get("PPid") == str(pid) and fields.get("Name") == "sleep":
                    return int(entry)
    return None


def _pagemap_bits(pid: int, addresses: list[int]) -> list[int]:
    with open(f"/proc/{pid}/pagemap", "rb") as handle:
        return [int.from_bytes(os.pread(handle.fileno(), 8, address // PAGE * 8), "little") for address in addresses]


def _template_pages(pid: int, count: int) -> list[int]:
    """`count` pages the template holds (present), from the private writable mapping where it holds the most."""
    with open(f"/proc/{pid}/maps") as handle:
        mappings = writable_private_mappings(handle.read())
    best: list[int] = []
    for start, end in mappings:
        candidates = list(range(start, end, PAGE))
        bits = _pagemap_bits(pid, candidates)
        present = [address for address, value in zip(candidates, bits, strict=True) if value & PRESENT]
        best = max(best, present, key=len)
    return best[len(best) // 3 :][:count]


async def _copied_before_go(world: World, pages: list[int]) -> int:
    """How many of `pages` a fork holds as its own copy while it waits for "go" (then it is let go unsaid)."""
    async with stranger_pidfd() as pidfd:
        go_read, go_write = os.pipe()
        report_read, report_write = os.pipe()
        try:
            request = encode_request(KIND_FORK, uid=1000, gid=1000, environment={"PATH": "/usr/bin"})
            answer = await world.template._ask(request, [pidfd, 2, go_read, report_write])
            assert answer.error == 0 and answer.pidfd is not None
            try:
                fork = host_pid_of(answer.pidfd)
                with anyio.fail_after(20):  # once it sleeps in its wait for "go", whatever it copies is copied
                    while "poll" not in Path(f"/proc/{fork}/wchan").read_text():
                        await anyio.sleep(0.01)
                bits = _pagemap_bits(fork, pages)
            finally:
                os.close(answer.pidfd)
        finally:
            for fd in (go_read, go_write, report_read, report_write):
                os.close(fd)
    return sum(1 for value in bits if value & PRESENT and value & EXCLUSIVE)


async def test_a_page_plan_makes_forks_copy_only_the_templates_own_pages_and_nothing_else() -> None:
    """The host's page plan (guest/page_plan.py) is addresses the template checks against its own mappings: a fork
    copies those of its pages before "go" (charged to the sandbox it joined), and nothing of an address outside
    them is kept: not an unmapped page, not the template's code, not a misaligned or a kernel address. A plan
    over the bound is refused whole, and the template forks on."""
    async with template_world() as world:
        pages = _template_pages(world.template.pid, 64)
        assert len(pages) == 64
        shared = await _copied_before_go(world, pages)
        assert shared < len(pages)  # without a plan, a fork shares these pages with the template
        with open(f"/proc/{world.template.pid}/maps") as handle:
            code = next(line for line in handle if " r-xp " in line)
        foreign = [0x1000, int(code.split("-")[0], 16), pages[0] + 1, 0xFFFFFFFFFF600000, 2**47 - PAGE]
        assert await world.template.give_plan(foreign) == 0
        assert await world.template.give_plan(pages + foreign) == len(pages)
        assert await _copied_before_go(world, pages) == len(pages)
        with pytest.raises(TemplateUnavailable, match="refused a page plan"):
            await world.template.give_plan([pages[0]] * (MAX_PAGES + 1))
        child = await start_child(world)  # the template serves on, its plan as it was; the child is confined
        try:
            assert child.report["threads"] == 1 and await still_answers(child)
        finally:
            await end_child(world, child)
