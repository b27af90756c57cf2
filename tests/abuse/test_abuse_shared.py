"""Abuse cases for what clients used to share: the export folder, persistent names, start-up files,
and host folders mounted from under a 0700 parent on a root server.

One HTTP server; two clients told apart by their X-CodeRunner-Client header (alice, the
attacker mallory), and a bystander session of alice's created before any attack. Every case
aims at a canary the test wrote itself, checks it is untouched, then checks the server still
serves and the bystander kept its state.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from coderunner.hostfs import staging
from coderunner.hostfs.sandbox_mounts import START_CLONES_PREFIX

from ..conftest import (
    ServerDirs,
    _passable,
    connect_http,
    http_server,
    raw_stdio_server,
    run,
    server_env,
    stdio_client,
    text_of,
)

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

CANARY = "alice-canary-5e1f0b"
BYSTANDER_VALUE = "bystander-shared-93a2"
EXPORT_LIMIT_MB = 8
#: Owner of the folders mounted from under a 0700 parent: neither root nor the sandbox user.
FOLDER_OWNER = (1234, 1234)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Shared:
    url: str
    dirs: ServerDirs
    out: Path
    private_ro: Path
    private_rw: Path
    bystander: str
    alice: Client


@pytest.fixture(scope="module")
def shared_dirs() -> Iterator[tuple[ServerDirs, Path]]:
    root = _passable(Path(tempfile.mkdtemp(prefix="crs-", dir="/tmp")))
    # A folder under a 0700 parent, as `mktemp -d` makes them: the sandbox user cannot pass it.
    private = Path(tempfile.mkdtemp(prefix="crs-private-", dir="/tmp"))
    assert (os.stat(private).st_mode & 0o777) == 0o700
    yield ServerDirs(root=root, runtime=root / "r", workspaces=root / "w"), private
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(private, ignore_errors=True)


def _private_folders(private: Path) -> tuple[Path, Path]:
    ro, rw = private / "ro", private / "rw"
    for folder in (ro, rw):
        folder.mkdir(mode=0o700)
    (ro / "canary.txt").write_text(CANARY)
    if os.getuid() == 0:
        for folder in (ro, rw, ro / "canary.txt"):
            os.chown(folder, *FOLDER_OWNER)
    return ro, rw


@contextlib.asynccontextmanager
async def as_client(url: str, name: str) -> AsyncIterator[Client]:
    async with connect_http(url, headers={"X-CodeRunner-Client": name}) as client:
        yield client


@pytest.fixture(scope="module")
async def shared(shared_dirs: tuple[ServerDirs, Path]) -> AsyncIterator[Shared]:
    dirs, private = shared_dirs
    out = dirs.root / "exports"
    ro, rw = _private_folders(private)
    env = server_env(
        dirs,
        CODERUNNER_DISK_MB="64",
        CODERUNNER_MEMORY_MB="1024",
        CODERUNNER_TIMEOUT_S="60",
        CODERUNNER_EXPORT_DIR=str(out),
        CODERUNNER_EXPORT_LIMIT_MB=str(EXPORT_LIMIT_MB),
        CODERUNNER_MOUNTS=json.dumps([f"{ro}:/private:ro", f"{rw}:/private-rw:rw"]),
    )
    with http_server(env) as url:
        async with as_client(url, "alice") as alice:
            created = await call(alice, "create_session")
            bystander = created["session_id"]
            await run(alice, f"guarded = {BYSTANDER_VALUE!r}\nopen('bystander.txt', 'w').write('mine')",
                      session_id=bystander)  # fmt: skip
            yield Shared(url, dirs, out, ro, rw, bystander, alice)


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))


async def assert_still_serving(shared: Shared) -> None:
    normal = await run(shared.alice, "sum(range(10))")
    assert not normal.is_error and text_of(normal).splitlines()[0] == "45", text_of(normal)
    bystander = await run(shared.alice, "guarded, open('bystander.txt').read()", session_id=shared.bystander)
    assert f"('{BYSTANDER_VALUE}', 'mine')" in text_of(bystander), text_of(bystander)


def tree_bytes(folder: Path) -> int:
    return sum(path.lstat().st_size for path in folder.rglob("*") if path.is_file())


async def test_clients_cannot_read_or_overwrite_each_others_exports(shared: Shared) -> None:
    """boundary: exports. Each client's exports land in its own folder, which no sandbox sees."""
    saved = await run(shared.alice, f"open('/mnt/outputs/report.txt', 'w').write({CANARY!r})")
    assert "report.txt" in text_of(saved), text_of(saved)
    canary = shared.out / "alice" / "report.txt"
    assert canary.read_text() == CANARY
    async with as_client(shared.url, "mallory") as mallory:
        probe = await run(
            mallory,
            "import os, json\n"
            "found = [os.path.join(d, f) for d, _, fs in os.walk('/mnt/outputs') for f in fs]\n"
            f"visible = any(os.path.exists(p) for p in ({str(shared.out)!r}, {str(canary)!r}))\n"
            "open('/mnt/outputs/report.txt', 'w').write('mallory was here')\n"
            "print(json.dumps({'found': found, 'visible': visible}))",
        )
        seen = json.loads(text_of(probe).splitlines()[0])
        assert seen == {"found": [], "visible": False}, seen
        for target in ("../alice/report.txt", str(canary), str(shared.out / "alice" / "new.txt")):
            result = await mallory.call_tool("write_file", {"path": "x.txt", "content": "x"})
            assert not result.is_error
            refused = await mallory.call_tool(
                "transfer_file",
                {"direction": "download", "sandbox_path": "x.txt", "host_path": target, "overwrite": True},
            )
            assert refused.is_error, target
        written = await call(mallory, "write_file", path="/mnt/outputs/report.txt", content="mallory again")
        assert "report.txt" in written["exported"], written
        sessions = await call(mallory, "manage_sessions", action="list")
        assert shared.bystander not in json.dumps(sessions)
    assert canary.read_text() == CANARY, "another client's export was overwritten"
    assert (shared.out / "mallory" / "report.txt").read_text() == "mallory again"
    assert not (shared.out / "alice" / "new.txt").exists()
    await assert_still_serving(shared)


async def test_one_shot_runs_export_to_their_own_client_only(shared: Shared) -> None:
    """boundary: exports. A throwaway sandbox has its own empty outbox, copied to its caller's folder."""
    (shared.out / "alice").mkdir(exist_ok=True)
    (shared.out / "alice" / "oneshot.txt").write_text(CANARY)
    async with as_client(shared.url, "mallory") as mallory:
        code = (
            "import os\n"
            "print(sorted(os.listdir('/mnt/outputs')))\n"
            "open('/mnt/outputs/oneshot.txt', 'w').write('mallory one-shot')\n"
            "os.symlink('/etc/passwd', '/mnt/outputs/passwd')\n"
        )
        done = await call(mallory, "execute_code", language="python", code=code)
        assert done["stdout"].strip() == "[]", done
        assert "oneshot.txt" in (done["exported"] or "") and "passwd (not a regular file)" in done["exported"], done
    assert (shared.out / "alice" / "oneshot.txt").read_text() == CANARY
    assert (shared.out / "mallory" / "oneshot.txt").read_text() == "mallory one-shot"
    assert not (shared.out / "mallory" / "passwd").exists()
    await assert_still_serving(shared)


async def test_exports_count_against_a_cap(shared: Shared) -> None:
    """boundary: exports. A session cannot put more than export_limit_mb (or its disk_mb) on the host."""
    async with as_client(shared.url, "filler") as filler:
        session = (await call(filler, "create_session"))["session_id"]
        big = await run(
            filler,
            "import os\n"
            "chunk = b'x' * (1 << 20)\n"
            "written = 0\n"
            "try:\n"
            "    with open('/mnt/outputs/huge.bin', 'wb') as f:\n"
            "        for _ in range(300):\n"
            "            f.write(chunk); written += 1\n"
            "except OSError as exc:\n"
            "    print('refused:', exc.strerror)\n"
            "print('written MiB', written)\n"
            "os.remove('/mnt/outputs/huge.bin')\n"
            "for i in range(6):\n"
            "    try:\n"
            "        open(f'/mnt/outputs/part{i}.bin', 'wb').write(b'y' * (3 << 20))\n"
            "    except OSError as exc:\n"
            "        print('refused:', exc.strerror)\n",
            session_id=session,
        )
        text = text_of(big)
        assert "over the export limit" in text, text
        assert tree_bytes(shared.out / "filler") <= EXPORT_LIMIT_MB * 2**20
        assert not (shared.out / "filler" / "huge.bin").exists()
        if os.getuid() == 0:
            # As root the outbox is inside the 64 MiB workspace image: the disk refuses first.
            assert "refused: No space left on device" in text, text
        more = await run(filler, "open('/mnt/outputs/late.bin', 'wb').write(b'z' * (4 << 20))", session_id=session)
        assert "late.bin" in text_of(more) and "over the export limit" in text_of(more), text_of(more)
        await call(filler, "manage_sessions", action="close", session_id=session)
    assert tree_bytes(shared.out / "filler") <= EXPORT_LIMIT_MB * 2**20
    await assert_still_serving(shared)


async def test_a_persistent_name_belongs_to_its_client(shared: Shared) -> None:
    """boundary: persistent workspaces. Another client's same name is another workspace."""
    first = await call(shared.alice, "create_session", name="project", persistent=True)
    await run(shared.alice, f"open('secret.txt', 'w').write({CANARY!r})", session_id=first["session_id"])
    await call(shared.alice, "manage_sessions", action="close", session_id=first["session_id"])
    async with as_client(shared.url, "mallory") as mallory:
        theirs = await call(mallory, "create_session", name="project", persistent=True)
        probe = await run(mallory, "import os\nsorted(os.listdir('.'))", session_id=theirs["session_id"])
        assert "secret.txt" not in text_of(probe), text_of(probe)
        await call(mallory, "manage_sessions", action="close", session_id=theirs["session_id"])
        listed = await call(mallory, "manage_workspaces", action="list")
        assert [entry["name"] for entry in listed["workspaces"]] == ["project"]
        await call(mallory, "manage_workspaces", action="delete", name="project")
        gone = await mallory.call_tool("manage_workspaces", {"action": "delete", "name": "project"})
        assert gone.is_error and "no persistent workspace" in text_of(gone)
        for bad in ("../alice/project", "project/../../alice/project", "x/../../alice/project"):
            refused = await mallory.call_tool("manage_workspaces", {"action": "delete", "name": bad})
            assert refused.is_error, bad
    mine = await call(shared.alice, "manage_workspaces", action="list")
    assert [entry["name"] for entry in mine["workspaces"]] == ["project"]
    again = await call(shared.alice, "create_session", name="project", persistent=True)
    kept = await run(shared.alice, "open('secret.txt').read()", session_id=again["session_id"])
    assert CANARY in text_of(kept), text_of(kept)
    await call(shared.alice, "manage_sessions", action="close", session_id=again["session_id"])
    await call(shared.alice, "manage_workspaces", action="delete", name="project")
    assert (await call(shared.alice, "manage_workspaces", action="list"))["workspaces"] == []
    await assert_still_serving(shared)


async def test_a_planted_sitecustomize_does_not_run_silently(shared: Shared) -> None:
    """boundary: persistent workspaces. Start-up hooks left by an earlier session are set aside and named."""
    first = await call(shared.alice, "create_session", name="hooked", persistent=True)
    plant = (
        "import os\n"
        "site = '/workspace/.coderunner/site-packages'\n"
        "os.makedirs(site + '/usercustomize', exist_ok=True)\n"
        "hook = \"open('/workspace/PWNED', 'a').write('ran ')\\n\"\n"
        "open(site + '/sitecustomize.py', 'w').write(hook)\n"
        "open(site + '/usercustomize/__init__.py', 'w').write(hook)\n"
        "open(site + '/evil.pth', 'w').write('import os; ' + hook)\n"
        "os.makedirs(site + '/helper', exist_ok=True)\n"
        "open(site + '/helper/__init__.py', 'w').write('X = 1\\n')\n"
    )
    await run(shared.alice, plant, session_id=first["session_id"])
    await call(shared.alice, "manage_sessions", action="close", session_id=first["session_id"])
    again = await call(shared.alice, "create_session", name="hooked", persistent=True)
    startup = again.get("startup_files")
    assert startup is not None, again
    assert sorted(startup["disabled"]) == ["sitecustomize.py", "usercustomize"], startup
    assert startup["ignored_pth"] == ["evil.pth"] and "helper" in startup["packages"], startup
    probe = await run(
        shared.alice,
        "import os, sys, subprocess\n"
        "subprocess.run([sys.executable, '-c', 'import helper'], check=True)\n"
        "aside = '/workspace/.coderunner/disabled-startup'\n"
        "print(os.path.exists('/workspace/PWNED'), sorted(os.listdir(aside)) if os.path.isdir(aside) else None)",
        session_id=again["session_id"],
    )
    first_line = text_of(probe).splitlines()[0]
    assert first_line.startswith("False [") and "'sitecustomize.py." in first_line, text_of(probe)
    await call(shared.alice, "manage_sessions", action="close", session_id=again["session_id"])
    await call(shared.alice, "manage_workspaces", action="delete", name="hooked")
    await assert_still_serving(shared)


@pytest.mark.skipif(os.getuid() != 0, reason="folders under a 0700 parent only fail for a root server's sandboxes")
async def test_mounts_under_a_0700_parent_work_without_loosening_it(shared: Shared) -> None:
    """boundary: mounts. Read-only and read-write mounts of folders the sandbox user could not reach."""
    private = shared.private_ro.parent
    assert (os.stat(private).st_mode & 0o777) == 0o700
    read = await run(shared.alice, "open('/private/canary.txt').read()")
    assert CANARY in text_of(read), text_of(read)
    tamper = await run(shared.alice, "open('/private/canary.txt', 'w').write('x')")
    assert tamper.is_error and "Read-only file system" in text_of(tamper)
    mapped = staging.idmap_supported(shared.private_rw, FOLDER_OWNER, _sandbox_ids())
    wrote = await run(shared.alice, "open('/private-rw/made.txt', 'w').write('from the sandbox')")
    if mapped:
        assert not wrote.is_error, text_of(wrote)
        made = shared.private_rw / "made.txt"
        assert made.read_text() == "from the sandbox"
        assert (made.stat().st_uid, made.stat().st_gid) == FOLDER_OWNER, "files belong to the folder's owner"
        # The file tools write there too, and the sandbox can then change what they wrote.
        await call(shared.alice, "write_file", path="/private-rw/tool.txt", content="from write_file")
        changed = await run(shared.alice, "open('/private-rw/tool.txt', 'a').write(' and the sandbox')")
        assert not changed.is_error, text_of(changed)
        tool = shared.private_rw / "tool.txt"
        assert tool.read_text() == "from write_file and the sandbox"
        assert (tool.stat().st_uid, tool.stat().st_gid) == FOLDER_OWNER
    else:
        assert wrote.is_error and "Permission denied" in text_of(wrote)
    assert (shared.private_ro / "canary.txt").read_text() == CANARY
    assert (os.stat(private).st_mode & 0o777) == 0o700, "the host's permissions were not loosened"
    await assert_still_serving(shared)


def _sandbox_ids() -> tuple[int, int]:
    """A uid of the per-sandbox range: whether this machine can id-map to one does not depend on which."""
    from coderunner.sandbox.identity import UID_BASE

    return UID_BASE, UID_BASE


def _staged_points(under: Path) -> list[str]:
    """Mount points under `under` in this (the servers') mount namespace."""
    points = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            point = line.split()[4].encode().decode("unicode_escape")
            # A live server's start clones dir is no staged point (its clones below it would be).
            if point.startswith(str(under) + "/") and not Path(point).name.startswith(START_CLONES_PREFIX):
                points.append(point)
    return points


@pytest.mark.skipif(os.getuid() != 0, reason="only a root server stages mounts")
async def test_a_killed_servers_staged_mounts_are_detached_before_its_dirs_are_removed(tmp_path: Path) -> None:
    """boundary: mounts. A SIGKILLed server leaves a staged rw mount of the user's folder; the next
    server detaches it before deleting anything, so the user's files survive the cleanup."""
    root = _passable(Path(tempfile.mkdtemp(prefix="crsk-", dir="/tmp")))
    dirs = ServerDirs(root=root, runtime=root / "r", workspaces=root / "w")
    private = Path(tempfile.mkdtemp(prefix="crsk-private-", dir="/tmp"))
    try:
        folder = private / "project"
        folder.mkdir(mode=0o755)
        (folder / "canary.txt").write_text(CANARY)
        os.chown(folder, *FOLDER_OWNER)
        env = server_env(dirs, CODERUNNER_MOUNTS=json.dumps([f"{folder}:/project:rw"]),
                         CODERUNNER_EXPORT_DIR=str(root / "exports"))  # fmt: skip
        with raw_stdio_server(env, [("run_python", {"code": "open('/project/canary.txt').read()"})]) as server:
            assert _staged_points(dirs.runtime), "the mount and the outbox are staged in the runtime dir"
            os.kill(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
        assert _staged_points(dirs.runtime), "a SIGKILLed server cannot detach its staged mounts"
        async with stdio_client(env) as client:
            assert text_of(await run(client, "2 + 2")).splitlines()[0] == "4"
            assert len(_staged_points(dirs.runtime)) == 2, "only the live session's mount and outbox are staged"
        assert _staged_points(dirs.runtime) == []
        assert (folder / "canary.txt").read_text() == CANARY, "the cleanup deleted the user's files"
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


async def test_workspace_tools_take_nothing_but_their_arguments(shared: Shared) -> None:
    """No free-form input (tools/schemas.py leaves `additionalProperties` out for google-genai's sake),
    and an argument the tool does not take is refused by name rather than ignored."""
    tools = {tool.name: tool for tool in (await shared.alice.list_tools()).tools}
    assert tools["manage_workspaces"].input_schema.get("additionalProperties") in (None, False)
    smuggled = await shared.alice.call_tool(
        "manage_workspaces", {"action": "delete", "name": "nothing-here", "client": "bob"}
    )
    assert smuggled.is_error and "unknown argument 'client'" in text_of(smuggled), text_of(smuggled)
