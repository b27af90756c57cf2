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
from collections.abc import Callable, Iterator
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


def processes(proc_file: str, match: Callable[[bytes], bool]) -> list[int]:
    """Live processes whose /proc/<pid>/<proc_file> (environ, cmdline) `match` says yes to."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/{proc_file}", "rb") as handle:
                if match(handle.read()):
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def marked(folder: Path) -> list[int]:
    """Live processes started through the stand-in wrapper in `folder` (its marker in their environment)."""
    needle = f"{apple_emulation.MARKER}={folder}\0".encode()
    return processes("environ", lambda environ: needle in environ)


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


def watchers() -> list[int]:
    """Live apple watchers (`python -I .../watcher.py PLAN`), of any server."""

    def is_watcher(cmdline: bytes) -> bool:
        argv = cmdline.split(b"\0")
        return any(part.endswith(b"watcher.py") for part in argv) and b'"apple"' in cmdline

    return processes("cmdline", is_watcher)


async def test_one_servers_end_leaves_anothers_live_vms_alone(root: Path) -> None:
    """Claude Desktop's and Cursor's servers share a runtime dir (one name prefix): when one ends
    with a VM slow to stop, its watcher removes its own VMs, never the other server's live one."""
    real = apple_emulation.cli_dir(root / "bin", apple_emulation.VERSIONS[-1])
    try:
        image = apple_emulation.build_image(real)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    dirs = ServerDirs(root=root / "s", runtime=root / "s" / "r", workspaces=root / "s" / "w")
    dirs.root.mkdir(mode=0o711)
    base = files_env(dirs, files.host.__wrapped__(dirs))
    base = {**base, "CODERUNNER_BACKEND": "apple", "CODERUNNER_IMAGE": image}
    staying = {**base, "PATH": f"{real}:{base['PATH']}"}
    ending = {**base, "PATH": f"{slow_stop(root, real)}:{base['PATH']}"}
    before = set(watchers())
    async with open_client("stdio", staying) as bystander:
        assert not (await run(bystander, "canary = 'still-here-5e1f'")).is_error
        theirs = set(watchers()) - before
        async with open_client("stdio", ending) as leaving:
            assert "42" in text_of(await run(leaving, "print(6 * 7)"))
        # The ending server's watcher has done its sweeps once only the bystander's is left.
        assert await wait_until(lambda: set(watchers()) - before == theirs, timeout_s=90), watchers()
        kept = await run(bystander, "canary")
        assert not kept.is_error and "still-here-5e1f" in text_of(kept), text_of(kept)
