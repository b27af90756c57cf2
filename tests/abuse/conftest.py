"""One server for the whole abuse suite, a bystander session, and host-side targets to aim at."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mcp import Client

from ..conftest import ServerDirs, fresh_dirs, run, server_env, stdio_client, text_of

BYSTANDER_VALUE = "bystander-state-7d1e"

#: What the host's own services answer to whoever reaches them. A probe counts as crossing only on
#: this answer: an address that accepts for someone else (a VM's gateway, a proxy in front of the
#: machine) is not the host's loopback, and reaching it proves nothing either way.
CANARY = "host-canary-5c2b"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class HostTargets:
    """A TCP service on the host's 127.0.0.1 and an abstract unix socket that no sandbox may reach.
    Each answers CANARY and writes down who reached it, so the host side can tell too."""

    loopback_port: int
    abstract_socket: str
    reached: list[str] = field(default_factory=list)


@dataclass
class Arena:
    client: Client
    dirs: ServerDirs
    bystander: str
    bystander_workspace: Path
    host: HostTargets

    @property
    def loopback_port(self) -> int:
        return self.host.loopback_port

    @property
    def abstract_socket(self) -> str:
        return self.host.abstract_socket


@pytest.fixture(scope="module")
def abuse_dirs() -> Iterator[ServerDirs]:
    with fresh_dirs("cra-") as dirs:
        yield dirs


def _answer_canary(listeners: list[socket.socket], targets: HostTargets, stop: threading.Event) -> None:
    while not stop.is_set():
        ready, _, _ = select.select(listeners, [], [], 0.2)
        for listener in ready:
            conn, peer = listener.accept()
            with conn:
                targets.reached.append(f"{listener.getsockname()!r} from {peer!r}")
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    conn.sendall(CANARY.encode())


@contextlib.contextmanager
def host_targets() -> Iterator[HostTargets]:
    """The host's canary services (HostTargets), answering on a thread while the block runs."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"coderunner-abuse-{os.getpid()}-{tcp.getsockname()[1]}"
    abstract.bind("\0" + name)
    abstract.listen(8)
    targets = HostTargets(tcp.getsockname()[1], name)
    stop = threading.Event()
    answering = threading.Thread(target=_answer_canary, args=([tcp, abstract], targets, stop), daemon=True)
    answering.start()
    try:
        yield targets
    finally:
        stop.set()
        answering.join(timeout=5)
        tcp.close()
        abstract.close()


@pytest.fixture(scope="module")
def host_listeners() -> Iterator[HostTargets]:
    with host_targets() as targets:
        yield targets


@contextlib.asynccontextmanager
async def open_arena(
    dirs: ServerDirs, host_listeners: HostTargets, path_first: Path | None = None, **settings: str
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
        [workspace] = [path for path in dirs.session_workspaces() if path.is_dir()]
        yield Arena(client, dirs, bystander, workspace, host_listeners)


@pytest.fixture(scope="module")
async def arena(abuse_dirs: ServerDirs, host_listeners: tuple[int, str]) -> AsyncIterator[Arena]:
    async with open_arena(abuse_dirs, host_listeners) as made:
        yield made
