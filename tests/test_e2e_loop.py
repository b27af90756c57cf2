"""The event loop never stalls: one client's 400 MiB copy does not hold up another client's run_python.

Two clients share one HTTP server. One uploads a 400 MiB file from an import folder into its
session (the heaviest host-side path: a whole file read and written through fds); while the
host is seen still writing it, the other client (the bystander) runs `1+1` and must get its
answer before the upload returns. No timing assertion: only the order of the two events.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import pytest
from mcp import Client

from .conftest import ServerDirs, connect_http, http_server, run, server_env, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

SIZE = 400 * 2**20
NAME = "big-in.bin"


def make_import(folder: Path) -> Path:
    """A 400 MiB file of real (not sparse) blocks, so the host has to read and write every byte."""
    folder.mkdir(mode=0o755)
    path = folder / NAME
    block = os.urandom(1 << 20)
    with open(path, "wb") as handle:
        for _ in range(SIZE >> 20):
            handle.write(block)
    return path


def copied_so_far(workspaces: Path) -> int:
    """Bytes of the upload's target found so far under the server's workspaces (0 before it exists)."""
    for folder, _dirs, names in os.walk(workspaces):
        if NAME in names:
            try:
                return os.lstat(os.path.join(folder, NAME)).st_size
            except OSError:
                return 0
    return 0


async def test_a_bystander_is_answered_while_another_client_copies_400_mib_in(dirs: ServerDirs) -> None:
    imports = dirs.root / "imports"
    source = make_import(imports)
    env = server_env(
        dirs,
        CODERUNNER_IMPORT_DIRS=json.dumps([str(imports)]),
        CODERUNNER_EXPORT_DIR="",
        CODERUNNER_DISK_MB="1024",
    )
    with http_server(env) as url:
        async with connect_http(url) as copier, connect_http(url, read_timeout_seconds=300) as bystander:
            await check_bystander_during_copy(copier, bystander, source, dirs.workspaces)


async def check_bystander_during_copy(copier: Client, bystander: Client, source: Path, workspaces: Path) -> None:
    for client in (copier, bystander):  # both default sessions started: the copy is the only thing left
        assert text_of(await run(client, "1+1")).startswith("2\n")
    upload_done = anyio.Event()
    upload_result: list[str] = []

    async def upload() -> None:
        result = await copier.call_tool(
            "transfer_file", {"direction": "upload", "host_path": str(source), "overwrite": True}
        )
        upload_result.append(text_of(result))
        assert not result.is_error, text_of(result)
        upload_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(upload)
        with anyio.fail_after(120):
            while copied_so_far(workspaces) == 0 and not upload_done.is_set():
                await anyio.sleep(0.002)
        seen_during_copy = copied_so_far(workspaces)
        assert not upload_done.is_set() and 0 < seen_during_copy < SIZE, (
            "the upload finished before it was seen in progress: nothing was measured"
        )
        answer = await run(bystander, "1+1")
        bystander_done_first = not upload_done.is_set()
        assert text_of(answer).startswith("2\n")
    assert json.loads(upload_result[0])["bytes"] == SIZE
    assert bystander_done_first, "the bystander's run_python waited for another client's copy to finish"
