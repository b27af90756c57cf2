"""The mount namespace a root server's bwrap starts in (sandbox/start_namespace.py), through a real server.

A start beside held sessions must see none of their mounts (that is its point: the table bwrap copies and reads
stays the same size), and it must give a sandbox nothing more than before: no handle on the start namespace, no
view of another session's clones or workspace. Each held session keeps a canary in its workspace; the new session
looks for them, for the clones dir and for any mount namespace fd, and the held sessions still read their own
canaries afterwards. With `start_namespace = false` bwrap starts in the host's namespace, as before.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mcp import Client

from coderunner.hostfs.sandbox_mounts import sweep_dead_start_clones
from coderunner.sandbox.start_namespace import PSEUDO_FILESYSTEMS, StartNamespace
from coderunner.vocabulary.host_identity import HostIdentity

from ..conftest import REPO, ServerDirs, connect_http, http_server, run, server_env, text_of

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="the start namespace is a root server's (its held mounts are)"),
]

HELD = 3
CANARY = "held-canary-4e1a"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def outer_bwraps(runtime: Path) -> list[int]:
    """The host pids of this server's outer bwraps (their argv names its runtime dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "bwrap":
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(str(runtime).encode() in part for part in argv) and b"--as-pid-1" in argv:
            found.append(int(entry.name))
    return found


def mount_points(pid: int | str) -> list[str]:
    return [line.split()[4] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]


def kernel_filesystems(pid: int | str) -> list[str]:
    """The mounts of a PSEUDO_FILESYSTEMS type that `pid` sees, as "point (type)"."""
    found = []
    for fields in (line.split() for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()):
        if (kind := fields[fields.index("-") + 1]) in PSEUDO_FILESYSTEMS:
            found.append(f"{fields[4]} ({kind})")
    return found


async def session(client: Client) -> str:
    made = await client.call_tool("create_session", {})
    assert not made.is_error, text_of(made)
    return json.loads(text_of(made))["session_id"]


#: Run in the newcomer: every mount namespace fd in its sandbox, which of the clones dirs (the host's paths) it
#: can reach, and every canary file below the places another session's workspace could show.
PROBE = """
import glob, json, os
fds = []
for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
    try:
        fds += [os.readlink(f'/proc/{{pid}}/fd/{{fd}}') for fd in os.listdir(f'/proc/{{pid}}/fd')]
    except OSError:
        pass
reached = [path for path in {clones!r} if os.path.exists(path)]
tops = ('/workspace', {workspaces!r}, {runtime!r})
found = [path for top in tops for path in glob.glob(top + '/**/canary.txt', recursive=True)]
print(json.dumps({{"ns_fds": [fd for fd in fds if fd.startswith('mnt:')], "clones": reached, "canaries": found}}))
"""


def clones_left(points: list[str]) -> list[str]:
    """Mount points below a clones dir: a start's clones not detached."""
    return [point for point in points if re.search(r"/\.live-[0-9a-f]+/", point)]


async def test_a_start_beside_held_sessions_sees_none_of_their_mounts_and_gets_no_more(dirs: ServerDirs) -> None:
    # No standby kernels: one starts in the background at a session's first quiet moment, so how many bwraps there
    # are when they are counted below would depend on the machine's load (a fifth was there under a full suite).
    env = server_env(dirs, CODERUNNER_MAX_SESSIONS=str(HELD + 2), CODERUNNER_RESET_STANDBY="0")
    with http_server(env) as url:
        async with connect_http(url) as client:
            held = [await session(client) for _ in range(HELD)]
            for index, session_id in enumerate(held):
                wrote = await run(client, f"open('canary.txt', 'w').write('{CANARY}-{index}')", session_id=session_id)
                assert not wrote.is_error, text_of(wrote)
            workspaces = [point for point in mount_points("self") if point.startswith(str(dirs.workspaces))]
            assert len(workspaces) >= HELD, "a root server's held workspaces are host mounts"

            newcomer = await session(client)
            clones = [str(path) for path in dirs.runtime.glob(".live-*") if path.is_dir()]
            assert clones, "a root server makes its start clones dir"
            code = PROBE.format(clones=clones, workspaces=str(dirs.workspaces), runtime=str(dirs.runtime))
            probe = await run(client, code, session_id=newcomer)
            assert not probe.is_error, text_of(probe)
            seen = json.loads(text_of(probe).splitlines()[0])
            assert seen["ns_fds"] == [], f"a mount namespace fd reached the sandbox: {seen['ns_fds']}"
            assert seen["clones"] == [], f"the sandbox sees the start clones dir: {seen['clones']}"
            assert seen["canaries"] == [], f"another session's workspace reached the sandbox: {seen['canaries']}"

            bwraps = outer_bwraps(dirs.runtime)
            assert len(bwraps) == HELD + 1, bwraps
            own = os.readlink("/proc/self/ns/mnt")
            assert kernel_filesystems("self"), "the host mounts none of them: the check below could not fail"
            for pid in bwraps:
                assert os.readlink(f"/proc/{pid}/ns/mnt") != own, "bwrap started in the host's mount namespace"
                assert kernel_filesystems(pid) == [], "the kernel's own filesystems are not dropped where bwrap starts"
                theirs = [point for point in mount_points(pid) if point.startswith(str(dirs.workspaces))]
                assert theirs == [], f"bwrap {pid} started beside held workspaces: {theirs}"
                assert clones_left(mount_points(pid)) == [], "a start's clones outlived its build"
            assert clones_left(mount_points("self")) == [], "a start's clones outlived its build"

            for index, session_id in enumerate(held):  # the bystanders: their own files, their own sandboxes
                read = await run(client, "print(open('canary.txt').read())", session_id=session_id)
                assert text_of(read).splitlines()[0] == f"{CANARY}-{index}", text_of(read)
            assert text_of(await run(client, "6 * 7", session_id=newcomer)).splitlines()[0] == "42"


async def test_with_the_setting_off_bwrap_starts_in_the_hosts_namespace(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs, CODERUNNER_START_NAMESPACE="false")) as url:
        async with connect_http(url) as client:
            session_id = await session(client)
            wrote = await run(client, "open('canary.txt', 'w').write('x'); print(open('canary.txt').read())",
                              session_id=session_id)  # fmt: skip
            assert text_of(wrote).splitlines()[0] == "x", text_of(wrote)
            bwraps = outer_bwraps(dirs.runtime)
            assert len(bwraps) == 1, bwraps
            assert os.readlink(f"/proc/{bwraps[0]}/ns/mnt") == os.readlink("/proc/self/ns/mnt")
            assert not list(dirs.runtime.glob(".live-*")), "no start clones dir without the start namespace"


#: A server that dies mid-start: its start namespace made, one start's clones staged, then SIGKILLed.
DIES_MID_START = """
import os, signal, sys
from pathlib import Path
from coderunner.sandbox.start_namespace import StartNamespace
from coderunner.vocabulary.host_identity import HostIdentity
runtime, folder = Path(sys.argv[1]), Path(sys.argv[2])
namespace = StartNamespace.open(runtime, [])
namespace.stage("0000dead", [folder])
print("staged", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_dead_servers_start_clones_are_swept_and_a_live_servers_are_left(tmp_path: Path, canary: Path) -> None:
    runtime = tmp_path / "r"
    runtime.mkdir()
    died = subprocess.run([sys.executable, "-c", DIES_MID_START, str(runtime), str(canary)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO / "src")})  # fmt: skip
    assert died.stdout.strip() == "staged", died.stderr
    dead = [path for path in runtime.glob(".live-*") if path.is_dir()]
    assert len(dead) == 1 and clones_left(mount_points("self")), "the dead server's clones are mounted"

    live = StartNamespace.open(runtime, [])
    staged = live.stage("0000a11e", [canary])
    try:
        sweep_dead_start_clones(runtime)
        assert not dead[0].exists() and not Path(f"{dead[0]}.lock").exists()
        assert [point for point in clones_left(mount_points("self")) if str(runtime) in point] == [
            str(staged.moved[canary])
        ], "only the live server's clone is left"
        assert (canary / "keep").read_text() == "untouched"
    finally:
        live.release(staged)
        assert live.close()
    assert not [point for point in mount_points("self") if str(runtime) in point]
    assert not list(runtime.iterdir())


def credentials(argv: list[str]) -> dict[str, str]:
    """The credential lines of /proc/self/status of `argv` + cat, started by this root process with supplementary
    groups of its own (a canary: the server's groups must not reach the sandbox's user)."""
    shown = subprocess.run([*argv, "cat", "/proc/self/status"], capture_output=True, text=True, timeout=30,
                           extra_groups=[4, 5], check=True).stdout  # fmt: skip
    wanted = ("Uid:", "Gid:", "Groups:", "CapInh:", "CapPrm:", "CapEff:", "CapAmb:")
    return {line.split(":")[0]: line.split(":", 1)[1].split() for line in shown.splitlines() if line.startswith(wanted)}


def test_the_start_prelude_drops_root_as_setpriv_did(tmp_path: Path) -> None:
    """boundary: host identity. nsenter becomes the sandbox's host user itself (one exec less a start): no
    supplementary group of the server's, its uid and gid in every slot, no capability; what setpriv gave."""
    user = HostIdentity("sandbox-canary", 61234, 61235)
    namespace = StartNamespace.open(tmp_path, [])
    try:
        entered = credentials(namespace.prelude(user))
        dropped = credentials(user.setpriv_prefix())
    finally:
        assert namespace.close()
    assert entered["Uid"] == ["61234"] * 4 and entered["Gid"] == ["61235"] * 4
    assert entered["Groups"] == [], f"the server's supplementary groups reached the sandbox's user: {entered}"
    assert all(entered[key] == ["0000000000000000"] for key in ("CapInh", "CapPrm", "CapEff", "CapAmb"))
    assert entered == dropped
    assert credentials([])["Groups"] == ["4", "5"], "the canary groups were there to drop"
