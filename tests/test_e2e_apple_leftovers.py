"""No `container` process of an Apple-backend server outlives it, on the stand-in.

Each `container run` client lives in a session of its own, which the MCP client's end of a stdio
server (stdin closed, then SIGTERM and SIGKILL to the server's process group) does not reach. A
VM that stops slowly (here: a `container stop` that takes longer than the client's grace) used to
leave the client, its relay and its podman run behind; the server's watcher now removes the VMs
and the clients exit with them. Processes are found by the marker every stand-in wrapper sets.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import apple_emulation
from . import test_e2e_files as files
from .conftest import ServerDirs, _passable, open_client, run, text_of, wait_until
from .test_e2e_files import files_env

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: Longer than the MCP client's grace after closing stdin (2 s) and after its SIGTERM (2 s).
SLOW_STOP_S = 6


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def root() -> Iterator[Path]:
    if problem := apple_emulation.emulation_problem():
        pytest.fail(problem)
    made = _passable(Path(tempfile.mkdtemp(prefix="crl-", dir="/tmp")))  # short: socket paths < 107 bytes
    yield made
    shutil.rmtree(made, ignore_errors=True)


def marked(folder: Path) -> list[int]:
    """Live processes started through the stand-in wrapper in `folder` (its marker in their environment)."""
    needle = f"{apple_emulation.MARKER}={folder}\0".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as handle:
                if needle in handle.read():
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def slow_stop(parent: Path, real: Path) -> Path:
    """A `container` whose `stop` takes SLOW_STOP_S before doing its work (a VM slow to stop)."""
    folder = parent / "slow"
    folder.mkdir()
    wrapper = folder / "container"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = stop ] && sleep {SLOW_STOP_S}\nexec {real}/container "$@"\n')
    wrapper.chmod(0o755)
    return folder


@pytest.mark.parametrize("version", apple_emulation.VERSIONS)
@pytest.mark.parametrize("slow", [False, True], ids=["prompt-stop", "slow-stop"])
async def test_no_container_process_outlives_its_server(root: Path, version: str, slow: bool) -> None:
    real = apple_emulation.cli_dir(root / "bin", version)
    try:
        image = apple_emulation.build_image(real)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    cli = slow_stop(root, real) if slow else real
    dirs = ServerDirs(root=root / "s", runtime=root / "s" / "r", workspaces=root / "s" / "w")
    dirs.root.mkdir(mode=0o711)
    env = files_env(dirs, files.host.__wrapped__(dirs))
    env = {**env, "PATH": f"{cli}:{env['PATH']}", "CODERUNNER_BACKEND": "apple", "CODERUNNER_IMAGE": image}
    async with open_client("stdio", env) as client:
        done = await run(client, "print(6 * 7)")
        assert not done.is_error and "42" in text_of(done), text_of(done)
        assert marked(real), "the session's `container run` should carry the stand-in's marker"
    # The server is gone; its watcher (a bounded sweep) removes what it could not, and then ends.
    assert await wait_until(lambda: marked(real) == [], timeout_s=90), marked(real)
