"""The abuse suite's boundary cases against the podman backend: the same arena, attacks and checks.

Every syscall case holds here as under bwrap (the tightened seccomp profile: new namespaces by
unshare, clone and clone3, AF_VSOCK and the other unneeded socket families), and so do the /sys
and /proc cases (/sys is an empty read-only tmpfs, kallsyms and kmsg read as empty).
One case is held differently by a container, and is checked for what podman does instead:
- past the memory limit the container's memory cgroup kills the kernel, but on cgroup v1 the engine
  cannot say it was an OOM kill (conmon reports OOMKilled=false), so the reply says "kernel died".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from coderunner.sandbox.container import LABEL_INSTANCE, server_tag

from ..conftest import ServerDirs, fresh_dirs, raw_stdio_server, run, server_env, text_of, wait_until
from ..test_e2e_podman import OCI_RUNTIME, podman_image  # noqa: F401  (the session's image fixture)
from .conftest import Arena, HostTargets, open_arena
from .test_abuse import CASES, INTERNET_ALLOWED, Case, assert_still_serving, attack

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

HELD_DIFFERENTLY = {"memory: raising RLIMIT_AS, then allocating past the limit"}
SAME = [case for case in CASES if f"{case.boundary}: {case.name}" not in HELD_DIFFERENTLY]


def _case(name: str) -> Case:
    return next(case for case in CASES if f"{case.boundary}: {case.name}" == name)


@pytest.fixture(scope="module")
async def arena(
    podman_image: str,  # noqa: F811
    abuse_dirs: ServerDirs,
    host_listeners: HostTargets,
) -> AsyncIterator[Arena]:
    """The abuse conftest's arena, on podman."""
    async with open_arena(
        abuse_dirs, host_listeners, CODERUNNER_BACKEND="podman", CODERUNNER_OCI_RUNTIME=OCI_RUNTIME, **INTERNET_ALLOWED
    ) as made:
        yield made


@pytest.mark.parametrize("case", SAME, ids=[f"{case.boundary}: {case.name}" for case in SAME])
async def test_boundary_holds_on_podman(arena: Arena, case: Case) -> None:
    result = await attack(arena, case)
    case.check(result, arena)
    await assert_still_serving(arena)


async def test_memory_past_the_limit_is_bounded_by_the_container(arena: Arena) -> None:
    result = await attack(arena, _case("memory: raising RLIMIT_AS, then allocating past the limit"))
    text = text_of(result)
    assert result.is_error and ("MemoryError" in text or "kernel died" in text), text
    await assert_still_serving(arena)


async def test_container_processes_are_not_root_on_the_host(arena: Arena) -> None:
    """boundary: host identity. The kernel's processes, as the host sees them, are never root."""
    await run(arena.client, "import time\ntime.sleep(0.1)")
    tag = __import__("coderunner.sandbox.container", fromlist=["server_tag"]).server_tag(arena.dirs.runtime)
    names = subprocess.run(
        ["podman", "ps", "--filter", f"label=coderunner.server={tag}", "--format", "{{.Names}}"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()  # fmt: skip
    assert names
    for name in names:
        users = subprocess.run(
            ["podman", "top", name, "huser", "user"], capture_output=True, text=True, timeout=60, check=True
        ).stdout.split()[2:]  # after the two column headers
        assert users and "root" not in users and "0" not in users, (name, users)
    if os.getuid() == 0:  # each container runs as a host uid of its own from the reserved range
        from coderunner.sandbox.identity import UID_BASE, UID_SPAN

        assert all(UID_BASE < int(user) < UID_BASE + 2 * UID_SPAN for user in users), users
    await assert_still_serving(arena)


def _containers(tag: str) -> list[str]:
    done = subprocess.run(
        ["podman", "ps", "--all", "--filter", f"label=coderunner.server={tag}", "--format", "{{.Names}}"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.split()


def _watchers(instance: str) -> list[int]:
    """Host pids of watcher processes for one server instance (found by their command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] if cmdline else "Z"
        except OSError:
            continue
        if b"coderunner/sandbox/watcher.py" in cmdline and instance.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


#: Everything in the container this sandbox can signal, but itself (the kernel); pid 1 ignores it.
KILL_ALL_BUT_THE_KERNEL = (
    "import os, signal\n"
    "tried = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]\n"
    "for pid in tried:\n"
    "    try:\n"
    "        os.kill(pid, signal.SIGKILL)\n"
    "    except OSError:\n"
    "        pass\n"
    "print('tried', tried)"
)


async def test_a_killed_servers_containers_go_whatever_the_sandbox_killed(
    arena: Arena,
    podman_image: str,  # noqa: F811
) -> None:
    """boundary: container lifetime. The sandbox kills all it can in its container, then the server's whole
    process group is SIGKILLed: the server's watcher (on the host, in its own session) removes its
    container, and only its: the arena's server and bystander keep theirs."""
    with fresh_dirs("crk-") as dirs:  # what its SIGKILLed server left mounted goes too
        env = server_env(dirs, CODERUNNER_BACKEND="podman", CODERUNNER_OCI_RUNTIME=OCI_RUNTIME)
        tag = server_tag(dirs.runtime)
        try:
            calls: list[tuple[str, dict[str, object]]] = [("run_python", {"code": KILL_ALL_BUT_THE_KERNEL})]
            with raw_stdio_server(env, calls, new_session=True) as server:
                [name] = _containers(tag)
                instance = subprocess.run(
                    ["podman", "inspect", "--format", f'{{{{index .Config.Labels "{LABEL_INSTANCE}"}}}}', name],
                    capture_output=True, text=True, timeout=60, check=True,
                ).stdout.strip()  # fmt: skip
                [watcher] = _watchers(instance)
                assert os.getsid(watcher) != os.getsid(server.pid), "the watcher has its own session"
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)
            assert await wait_until(lambda: _containers(tag) == [], timeout_s=90), "the container outlived its server"
            assert await wait_until(lambda: _watchers(instance) == [], timeout_s=90), "the watcher did not exit"
        finally:
            for leftover in _containers(tag):
                subprocess.run(["podman", "rm", "--force", "--time", "0", leftover], capture_output=True, timeout=60)
    await assert_still_serving(arena)


async def test_links_in_the_runtime_dir_make_root_create_nothing(arena: Arena) -> None:
    """boundary: host files. The old host.lock was opened with O_CREAT by root in the runtime dir: a link
    there named any host path. The sandbox plants links at that name and kills its kernel; the restart,
    the next call and the session's close must create no canary."""
    canaries = Path(tempfile.mkdtemp(prefix="crc-", dir="/tmp"))
    try:
        canary = canaries / "made-by-the-host"
        code = (
            "import os\n"
            "args = open('/proc/self/cmdline', 'rb').read().split(b'\\0')\n"
            "run_dir = os.path.dirname(args[args.index(b'-f') + 1].decode())\n"
            "for name in ('host.lock', 'kernel.lock', 'lock'):\n"
            "    try:\n"
            f"        os.symlink({str(canary)!r}, os.path.join(run_dir, name))\n"
            "    except OSError as exc:\n"
            "        print('could not plant', name, exc)\n"
            "os.kill(os.getpid(), 9)"
        )
        created = await arena.client.call_tool("create_session", {})
        session_id = json.loads(text_of(created))["session_id"]
        died = await run(arena.client, code, session_id=session_id)
        assert "kernel died" in text_of(died) and "fresh kernel is ready" in text_of(died), text_of(died)
        after = await run(arena.client, "6 * 7", session_id=session_id)
        assert text_of(after).splitlines()[0] == "42", text_of(after)
        await arena.client.call_tool("manage_sessions", {"action": "close", "session_id": session_id})
        assert not canary.exists() and not canary.is_symlink(), "the host created a file through a link"
        assert os.listdir(canaries) == []
    finally:
        shutil.rmtree(canaries, ignore_errors=True)
    await assert_still_serving(arena)


def _engine_clients(tag: str) -> list[int]:
    """Host pids of `podman run` clients of one server configuration (found by the label in their argv)."""
    needle = f"coderunner.server={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if needle in cmdline and b"\0run\0" in cmdline:
            found.append(int(entry.name))
    return found


async def test_a_server_killed_while_its_container_starts_leaves_none(
    arena: Arena,
    podman_image: str,  # noqa: F811
) -> None:
    """boundary: container lifetime. SIGKILL lands while the engine client is still creating the container:
    the watcher keeps sweeping while that client lives, so the container it makes goes too."""
    with fresh_dirs("crk-") as dirs:  # what its SIGKILLed server left mounted goes too
        env = server_env(dirs, CODERUNNER_BACKEND="podman", CODERUNNER_OCI_RUNTIME=OCI_RUNTIME)
        tag = server_tag(dirs.runtime)
        try:
            with raw_stdio_server(env, [], new_session=True) as server:
                assert server.stdin is not None
                call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                        "params": {"name": "run_python", "arguments": {"code": "1"}}}  # fmt: skip
                server.stdin.write((json.dumps(call) + "\n").encode())
                server.stdin.flush()
                assert await wait_until(lambda: _engine_clients(tag) != [], timeout_s=60), "no engine client started"
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)
            assert await wait_until(lambda: _containers(tag) == [] and _engine_clients(tag) == [], timeout_s=90), (
                "a container or engine client outlived its server"
            )
        finally:
            for leftover in _containers(tag):
                subprocess.run(["podman", "rm", "--force", "--time", "0", leftover], capture_output=True, timeout=60)
    await assert_still_serving(arena)
