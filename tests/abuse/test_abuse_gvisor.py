"""The abuse suite's bounds and file-system cases against the gvisor backend (runsc directly).

gVisor puts a kernel of its own between the code and the host, so the cases about the host kernel's
syscall surface say little new here; what must still hold is the host side the backend shares with
podman: the bounds (processes, memory, disk, time), the workspace and runtime dirs, the
network-none cases (runsc runs with no network stack), and the server and bystander staying served.
The path traps run on gvisor from test_abuse_paths.py's backend parametrisation.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ..conftest import ServerDirs, run, text_of
from ..test_e2e_podman import podman_image  # noqa: F401  (the session's image fixture)
from .conftest import Arena, HostTargets, open_arena
from .test_abuse import CASES, INTERNET_ALLOWED, Case, assert_still_serving, attack

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: The boundaries held on the host side, whatever kernel the code talks to.
BOUNDARIES = {"filesystem", "network none", "processes", "memory", "disk", "time", "kernel"}
#: Left to the bwrap and podman lanes, to keep this lane short: host files an image-based container
#: never binds (as on podman), and the interrupt path every backend shares (a control message).
ELSEWHERE = {
    "filesystem: read /etc/shadow",
    "filesystem: read the repository",
    "filesystem: read the server user's $HOME",
    "time: infinite loop",
}
#: Held differently. Memory: as on podman, the container's memory cgroup, not a MemoryError, may end
#: it. Fork bomb: gVisor enforces RLIMIT_NPROC (the session's pids), but under the ptrace platform
#: each guest process costs the Sentry several MB and ~5 host tasks, so within 1 GiB the memory
#: limit may end the kernel before the 256th fork fails.
HELD_DIFFERENTLY = {"memory: raising RLIMIT_AS, then allocating past the limit", "processes: fork bomb"}
PICKED = [
    case
    for case in CASES
    if case.boundary in BOUNDARIES and f"{case.boundary}: {case.name}" not in HELD_DIFFERENTLY | ELSEWHERE
]


@pytest.fixture(scope="module")
def gvisor_image(podman_image: str) -> str:  # noqa: F811
    if shutil.which("runsc") is None:
        pytest.fail("runsc is not installed: run ./install.sh (it installs runsc for the gvisor backend)")
    return podman_image


@pytest.fixture(scope="module")
async def arena(gvisor_image: str, abuse_dirs: ServerDirs, host_listeners: HostTargets) -> AsyncIterator[Arena]:
    """The abuse conftest's arena, on gvisor."""
    async with open_arena(abuse_dirs, host_listeners, CODERUNNER_BACKEND="gvisor", **INTERNET_ALLOWED) as made:
        yield made


@pytest.mark.parametrize("case", PICKED, ids=[f"{case.boundary}: {case.name}" for case in PICKED])
async def test_boundary_holds_on_gvisor(arena: Arena, case: Case) -> None:
    result = await attack(arena, case)
    case.check(result, arena)
    await assert_still_serving(arena)


@pytest.mark.parametrize("name", sorted(HELD_DIFFERENTLY))
async def test_memory_and_forks_past_the_limits_are_bounded_on_gvisor(arena: Arena, name: str) -> None:
    case = next(case for case in CASES if f"{case.boundary}: {case.name}" == name)
    result = await attack(arena, case)
    text = text_of(result)
    stopped = '"stopped"' in text or "MemoryError" in text or "kernel died" in text
    assert stopped and '["OK"' not in text, text
    await assert_still_serving(arena)


async def test_network_internet_is_refused_with_the_fix(arena: Arena) -> None:
    refused = await arena.client.call_tool("create_session", {"network": "internet"})
    assert refused.is_error and "gvisor backend" in text_of(refused) and "bwrap" in text_of(refused), text_of(refused)
    await assert_still_serving(arena)


def _host_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[2])  # effective
    raise AssertionError(f"no Uid line for {pid}")


async def test_the_code_runs_in_host_processes_that_are_not_root(arena: Arena) -> None:
    """boundary: host identity. Under runsc the guest's code runs in the Sentry's ptrace stubs, which
    (like the Sentry) are host `nobody` in a user namespace of their own; only the gofer, chrooted
    and with a handful of file capabilities, is root. Files the code makes are the per-sandbox uid's."""
    await run(arena.client, "open('mine.txt', 'w').write('x')", session_id=arena.bystander)
    assert arena.bystander_workspace.joinpath("mine.txt").stat().st_uid != 0
    ids = []  # the server's runsc containers, under its own runsc --root (sandbox/gvisor.py)
    for root in arena.dirs.runtime.glob(".runsc/*/root"):
        listed = subprocess.run(["runsc", f"--root={root}", "list", "-quiet"], capture_output=True, text=True,
                                timeout=60, check=True)  # fmt: skip
        ids += listed.stdout.split()
    assert ids
    for container in ids:
        sentries = [
            int(entry.name)
            for entry in Path("/proc").iterdir()
            if entry.name.isdigit()
            and _cmdline(entry).startswith(b"runsc-sandbox")
            and container.encode() in _cmdline(entry)
        ]
        assert sentries, container
        for sentry in sentries:
            stubs = [int(pid) for task in Path(f"/proc/{sentry}/task").iterdir() for pid in _children(task)]
            assert stubs, "no ptrace stubs under the Sentry"
            assert all(_host_uid(pid) != 0 for pid in [sentry, *stubs])
    await assert_still_serving(arena)


def _children(task: Path) -> list[str]:
    try:
        return (task / "children").read_text().split()
    except OSError:
        return []


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""


async def test_host_sockets_in_a_bound_folder_cannot_be_dialled(arena: Arena) -> None:
    """boundary: host sockets. host-uds=create lets the kernel bind its channels as host sockets, but
    not connect to any: a listener the host put in the session's own workspace stays unreached."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = arena.bystander_workspace / "canary.sock"
    listener.bind(str(path))
    listener.listen(4)
    listener.setblocking(False)
    os.chmod(path, 0o777)
    try:
        code = (
            "import socket\ns = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect('canary.sock'); print('connected')\n"
            "except OSError as exc:\n    print('refused', exc.errno)"
        )
        said = text_of(await run(arena.client, code, session_id=arena.bystander))
        assert said.startswith("refused"), said
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
        path.unlink()
    await assert_still_serving(arena)
