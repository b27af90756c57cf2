"""One server for the whole abuse suite, a bystander session, and host-side targets to aim at."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mcp import Client

from ..conftest import ServerDirs, fresh_dirs, run, server_env, stdio_client, text_of

BYSTANDER_VALUE = "bystander-state-7d1e"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Arena:
    client: Client
    dirs: ServerDirs
    bystander: str
    bystander_workspace: Path
    loopback_port: int
    abstract_socket: str


@pytest.fixture(scope="module")
def abuse_dirs() -> Iterator[ServerDirs]:
    with fresh_dirs("cra-") as dirs:
        yield dirs


@pytest.fixture(scope="module")
def host_listeners() -> Iterator[tuple[int, str]]:
    """A TCP listener on the host's 127.0.0.1 and an abstract unix socket: both must stay unreachable."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"coderunner-abuse-{os.getpid()}"
    abstract.bind("\0" + name)
    abstract.listen(8)
    yield tcp.getsockname()[1], name
    tcp.close()
    abstract.close()


@contextlib.asynccontextmanager
async def open_arena(
    dirs: ServerDirs, host_listeners: tuple[int, str], path_first: Path | None = None, **settings: str
) -> AsyncIterator[Arena]:
    """A server with the abuse suite's limits (plus `settings`, e.g. another backend) and its
    bystander session; `path_first` goes first on the server's PATH (a stand-in CLI)."""
    env = server_env(
        dirs,
        CODERUNNER_DISK_MB="64",
        CODERUNNER_MEMORY_MB="1024",
        CODERUNNER_TIMEOUT_S="30",
        CODERUNNER_MAX_SESSIONS="4",
        # Each abuse case wants its whole answer in one reply (a slow flood must not turn into a job).
        CODERUNNER_DETACH_AFTER_S="3600",
        **settings,
    )
    if path_first is not None:
        env["PATH"] = f"{path_first}:{env['PATH']}"
    async with stdio_client(env) as client:
        created = await client.call_tool("create_session", {})
        bystander = json.loads(text_of(created))["session_id"]
        await run(client, f"guarded = {BYSTANDER_VALUE!r}\nopen('bystander.txt', 'w').write('mine')",
                  session_id=bystander)  # fmt: skip
        [workspace] = [path for path in dirs.workspaces.iterdir() if path.is_dir()]
        yield Arena(client, dirs, bystander, workspace, *host_listeners)


@pytest.fixture(scope="module")
async def arena(abuse_dirs: ServerDirs, host_listeners: tuple[int, str]) -> AsyncIterator[Arena]:
    async with open_arena(abuse_dirs, host_listeners) as made:
        yield made
