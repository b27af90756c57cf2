"""The abuse suite's host-boundary cases against the Apple `container` backend, on its stand-in.

`container` is tests/emulators/container (podman underneath), at install.sh's pinned release.
On a Mac the boundary is the VM; here it is podman's, so only the cases about what a session can
reach of the host and of other sessions apply: host files, the environment, the network, process
and memory bombs, output floods through the socket relay, and killing the guest's PID 1. The
cases about the guest kernel's own syscalls, /sys, /tmp and privileges inside probe the VM's
own Linux, which the stand-in does not have, and are left to a Mac.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from .. import apple_emulation
from ..conftest import ServerDirs, _passable
from .conftest import Arena, HostTargets, open_arena
from .test_abuse import CASES, INTERNET_ALLOWED, Case, assert_still_serving, attack

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

APPLIES = (
    "filesystem: read /etc/shadow",
    "filesystem: read the server user's $HOME",
    "filesystem: read another session's workspace",
    "filesystem: write outside the workspace",
    "filesystem: symlink and .. escapes",
    "environment: host variables and /proc/*/environ",
    "network none: TCP egress",
    "network none: DNS lookup",
    "network none: the host's loopback services",
    "network internet: the host's 127.0.0.1",
    "network internet: other sessions' kernel sockets",
    "processes: fork bomb",
    "memory: allocation bomb",
    "output: a forged 100 MB message",
    "output: binary garbage on stdout",
    "kernel: killing the sandbox's pid 1",
)
SELECTED = [case for case in CASES if f"{case.boundary}: {case.name}" in APPLIES]


@pytest.fixture(scope="module")
def apple_abuse_dirs() -> Iterator[ServerDirs]:
    root = _passable(Path(tempfile.mkdtemp(prefix="crq-", dir="/tmp")))
    yield ServerDirs(root=root, runtime=root / "r", workspaces=root / "w")
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
async def arena(apple_abuse_dirs: ServerDirs, host_listeners: HostTargets) -> AsyncIterator[Arena]:
    """The abuse conftest's arena, on the Apple backend."""
    if problem := apple_emulation.emulation_problem():
        pytest.fail(problem)
    folder = apple_emulation.cli_dir(apple_abuse_dirs.root / "bin", apple_emulation.VERSIONS[-1])
    try:
        image = apple_emulation.build_image(folder)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    settings = {"CODERUNNER_BACKEND": "apple", "CODERUNNER_IMAGE": image, **INTERNET_ALLOWED}
    async with open_arena(apple_abuse_dirs, host_listeners, path_first=folder, **settings) as made:
        yield made


def test_every_listed_case_exists() -> None:
    assert len(SELECTED) == len(APPLIES), {name for name in APPLIES} - {f"{c.boundary}: {c.name}" for c in CASES}


@pytest.mark.parametrize("case", SELECTED, ids=[f"{case.boundary}: {case.name}" for case in SELECTED])
async def test_boundary_holds_on_apple(arena: Arena, case: Case) -> None:
    result = await attack(arena, case)
    case.check(result, arena)
    await assert_still_serving(arena)
