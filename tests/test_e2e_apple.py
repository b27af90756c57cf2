"""The Apple `container` backend end to end, through the official MCP client, on Linux.

`container` is tests/emulators/container here: a stand-in that follows apple/container's sources
per release, with podman underneath. Each release below gets one server for the module (one
before 0.10.0, which has no `run --init` and where the guest's own first process reaps; and 1.2.2,
install.sh's pin), running the bwrap backend's spine scenarios unchanged, then what is particular
to this backend. What the stand-in cannot show (vsock timing, virtiofs ownership on a Mac) is on
the checklist in docs/backends-and-macos.md (macOS).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from mcp import Client

from coderunner.sandbox.container import name_prefix, server_tag

from . import apple_emulation
from . import test_e2e_files as files
from . import test_e2e_guest_tools as guest_tools
from . import test_e2e_run_python as run_python
from .conftest import ServerDirs, _passable, open_client, run, text_of, wait_until
from .test_e2e_files import Host, files_env

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=apple_emulation.VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def apple_dirs() -> Iterator[ServerDirs]:
    root = _passable(Path(tempfile.mkdtemp(prefix="cre-", dir="/tmp")))  # short: socket paths < 107 bytes
    yield ServerDirs(root=root, runtime=root / "r", workspaces=root / "w")
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def apple_bin(apple_dirs: ServerDirs, version: str) -> Path:
    if problem := apple_emulation.emulation_problem():
        pytest.fail(problem)
    return apple_emulation.cli_dir(apple_dirs.root / "bin", version)


@pytest.fixture(scope="module")
def apple_image(apple_bin: Path) -> str:
    try:
        return apple_emulation.build_image(apple_bin)
    except RuntimeError as exc:
        pytest.fail(str(exc))


def apple_env(dirs: ServerDirs, folders: Host, folder: Path, image: str, **extra: str) -> dict[str, str]:
    env = files_env(dirs, folders)
    return {**env, "PATH": f"{folder}:{env['PATH']}", "CODERUNNER_BACKEND": "apple", "CODERUNNER_IMAGE": image,
            **extra}  # fmt: skip


@pytest.fixture(scope="module")
def server_dirs(apple_dirs: ServerDirs, version: str) -> ServerDirs:
    root = apple_dirs.root / version
    root.mkdir(mode=0o711)
    return ServerDirs(root=root, runtime=root / "r", workspaces=root / "w")


@pytest.fixture(scope="module")
def host(server_dirs: ServerDirs) -> Host:
    """test_e2e_files' host folders, made once per server."""
    return files.host.__wrapped__(server_dirs)


@pytest.fixture(scope="module")
async def client(server_dirs: ServerDirs, host: Host, apple_bin: Path, apple_image: str) -> AsyncIterator[Client]:
    async with open_client("stdio", apple_env(server_dirs, host, apple_bin, apple_image)) as connected:
        made = await run(connected, guest_tools.MAKE_INPUTS)
        assert not made.is_error, text_of(made)
        yield connected
    # The server stopped and deleted every VM of its own on the way out.
    assert await wait_until(lambda: vms(server_dirs, apple_bin) == [], timeout_s=60), vms(server_dirs, apple_bin)


def vms(dirs: ServerDirs, folder: Path) -> list[str]:
    """This server's VMs, as the `container` CLI lists them (its own JSON shape per release)."""
    from coderunner.sandbox.apple import names_with_prefix

    done = subprocess.run([str(folder / "container"), "list", "--all", "--format", "json"],
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return names_with_prefix(done.stdout, name_prefix(server_tag(dirs.runtime)))


# --- the bwrap backend's spine scenarios, unchanged ---------------------------------------------------

test_state_persists_across_calls = run_python.test_state_persists_across_calls
test_matplotlib_chart_arrives_as_image = run_python.test_matplotlib_chart_arrives_as_image
test_infinite_loop_is_interrupted_and_state_kept = run_python.test_infinite_loop_is_interrupted_and_state_kept
test_kernel_killed_from_inside_gives_clear_error_then_works = (
    run_python.test_kernel_killed_from_inside_gives_clear_error_then_works
)
test_story_load_a_read_only_host_folder = files.test_story_load_a_read_only_host_folder
test_write_list_read_roundtrip_and_ranges = files.test_write_list_read_roundtrip_and_ranges
test_every_image_op = guest_tools.test_every_image_op


# --- what is particular to this backend -----------------------------------------------------------------


async def test_capabilities_name_the_vm_and_the_release(client: Client, version: str) -> None:
    """How the sandbox is built is get_capabilities' to say, once (session replies leave it out)."""
    described = json.loads(text_of(await client.call_tool("get_capabilities", {})))
    isolation = described["sandbox"]["isolation"]
    assert isolation.startswith(f"Apple container {version}: its own lightweight Linux VM"), described
    assert "no network (kernel sockets relayed over vsock)" in isolation
    assert described["files"]["workspace"] == "/workspace"


async def test_orphans_are_reaped_with_or_without_run_init(client: Client, version: str) -> None:
    """Before 0.10.0 the guest's own first process (vm_init) is PID 1 and reaps; from 0.10.0, `--init`."""
    code = (
        "import os, subprocess, time\n"
        "for _ in range(5):\n"
        "    subprocess.Popen(['sh', '-c', 'sleep 0.2 & exit 0']).wait()\n"
        "time.sleep(1.5)\n"
        "states = [open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0] for p in os.listdir('/proc')"
        " if p.isdigit()]\n"
        "init = open('/proc/1/cmdline').read().replace('\\0', ' ')\n"
        "print('zombies', states.count('Z'), 'init', init)"
    )
    result = await run(client, code)
    text = text_of(result)
    assert "zombies 0 " in text, text
    if version == "0.9.0":
        assert "coderunner_guest.vm_init" in text, text


async def test_closing_a_session_removes_its_vm(client: Client, server_dirs: ServerDirs, apple_bin: Path) -> None:
    before = set(vms(server_dirs, apple_bin))
    created = json.loads(text_of(await client.call_tool("create_session", {})))
    assert not (await run(client, "1", session_id=created["session_id"])).is_error
    [new] = set(vms(server_dirs, apple_bin)) - before
    closed = await client.call_tool("manage_sessions", {"action": "close", "session_id": created["session_id"]})
    assert not closed.is_error
    assert new not in vms(server_dirs, apple_bin)


async def test_tcp_fallback_binds_the_vm_address_only() -> None:
    """kernel_channels = "tcp": ports published on the host's 127.0.0.1, the kernel bound to the VM's
    own address on the container network (what `--publish` forwards to), never to 0.0.0.0.
    Its argv does not differ by release, so it runs at install.sh's pin only."""
    if problem := apple_emulation.emulation_problem():
        pytest.fail(problem)
    root = _passable(Path(tempfile.mkdtemp(prefix="crf-", dir="/tmp")))
    try:
        await _tcp_fallback(ServerDirs(root, root / "r", root / "w"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def _tcp_fallback(dirs: ServerDirs) -> None:
    folder = apple_emulation.cli_dir(dirs.root / "bin", apple_emulation.VERSIONS[-1])
    image = apple_emulation.build_image(folder)
    folders = files.host.__wrapped__(dirs)
    env = apple_env(dirs, folders, folder, image, CODERUNNER_KERNEL_CHANNELS="tcp", CODERUNNER_NETWORK="internet")
    async with open_client("stdio", env) as connected:
        answered = await connected.call_tool("get_capabilities", {})
        # One clean-clone run got a non-JSON answer here (an error, unrecorded): say what it was next time.
        assert not answered.is_error, text_of(answered)
        described = json.loads(text_of(answered))
        assert "reachable at the VM's address" in described["sandbox"]["isolation"], described
        code = (
            "import json\n"
            "rows = [l.split() for l in open('/proc/net/tcp').read().splitlines()[1:]]\n"
            "print(json.dumps(sorted({r[1].split(':')[0] for r in rows if r[3] == '0A'})))"
        )
        result = await run(connected, code)
        assert not result.is_error, text_of(result)
        listening = json.loads(text_of(result).splitlines()[0])
        assert listening and "00000000" not in listening, listening  # 0.0.0.0 in /proc/net/tcp's hex


async def test_capabilities_tell_the_vm_isolation(client: Client) -> None:
    result = await client.call_tool("get_capabilities", {})
    assert not result.is_error, text_of(result)
    described = json.loads(text_of(result))
    assert described["sandbox"]["backend"] == "apple"
    assert "its own lightweight Linux VM" in described["sandbox"]["isolation"]
