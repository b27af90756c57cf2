"""Fixtures: the real server, reached through the official MCP client.

Behaviour tests (`client`, `memory_client`) run the real server in this process on the real default
backend and reach it in memory; tests about the process itself (transports, signals, HTTP, the
command line) start a real `coderunner serve` (`stdio_client`, `http_server`, `raw_stdio_server`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import anyio
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult

from coderunner.config import Settings, load_settings
from coderunner.hostfs.blank_images import BLANK
from coderunner.hostfs.sandbox_mounts import START_CLONES_PREFIX
from coderunner.hostfs.session_dirs import MADE_AHEAD, remove_stale_dirs
from coderunner.oneshot.local import LocalOneShots
from coderunner.sandbox import make_backend
from coderunner.sandbox.gvisor import BACKEND_DIR as GVISOR_DIR
from coderunner.sandbox.gvisor import GvisorBackend
from coderunner.server import build_server
from coderunner.sessions import SessionManager

from .netns_servers import NetnsServers, available, netns_servers

REPO = Path(__file__).resolve().parents[1]
#: The bearer token test servers are given (CODERUNNER_TOKEN); the generated-token path has its own test.
TEST_TOKEN = "test-token-" + "4c2e9d7a1b" * 3
SECRET_NAME = "CODERUNNER_TEST_API_KEY"
SECRET_VALUE = "sk-test-" + "7f3a9c1e5b" * 3
#: Bound on a test server's start to listening (0.7 s as a rule). 120 s, not 60: one clean-clone run saw
#: a start pass 60 s right after a test that had written and deleted a large workspace (not reproduced
#: in six tries; disk writeback on the shared machine is the likely cause). The error carries its log.
SERVER_START_TIMEOUT_S = 120
SERVER_STOP_TIMEOUT_S = 20
#: Bound on a server its client left ending on its own (fresh_dirs: what it mounted is then its own to remove).
CLEAN_UP_WAIT_S = 10

#: Workers for the whole suite: one per core of the 2-core machines it is sized for (each test file's real
#: kernels and sandboxes are CPU work; more workers only queue them).
SUITE_WORKERS = 2
#: Workers for the fast suite alone (every path given is under tests/unit): its tests wait more than they
#: compute (one worker: 67 s for 29 CPU-s, kernels starting and timers running out), so four overlap those
#: waits. Measured on this 2-core machine, quiet: 27.5-29 s with four against 35-38 s with two.
FAST_SUITE_WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """addopts' `-n auto`: the fast suite on FAST_SUITE_WORKERS, anything else on SUITE_WORKERS (an
    explicit `-n N` still wins)."""
    unit = REPO / "tests" / "unit"
    given = [(config.invocation_params.dir / arg.split("::")[0]).resolve() for arg in config.args]
    if given and all(path == unit or unit in path.parents for path in given):
        return FAST_SUITE_WORKERS
    return SUITE_WORKERS


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _passable(path: Path) -> Path:
    """mkdtemp makes 0700 dirs; a root server's sandbox user must be able to pass through."""
    path.chmod(0o711)
    return path


@dataclass
class ServerDirs:
    """Per-test runtime and workspace parents, so tests can look at what the server left on the host."""

    root: Path
    runtime: Path
    workspaces: Path

    def made_ahead(self) -> set[str]:
        """Keys of the dirs a server made ahead of a create (hostfs/session_dirs.py: MADE_AHEAD): no session's."""
        return {mark.parent.name for mark in self.runtime.glob(f"*/{MADE_AHEAD}")}

    def session_runtime_dirs(self) -> list[Path]:
        """RUNTIME/<key> of the sandboxes (sessions' and one-shot runs'), not the dirs made ahead, the guest nor
        the server's start clones dir (sandbox/start_namespace.py)."""
        ahead = self.made_ahead()
        return [
            entry for entry in self.runtime.iterdir()
            if entry.is_dir() and not entry.name.startswith(("guest", START_CLONES_PREFIX)) and entry.name not in ahead
        ]  # fmt: skip

    def session_workspaces(self) -> list[Path]:
        """The sandboxes' workspaces (each a folder, and as root an .img file beside it), not those made ahead."""
        ahead = self.made_ahead()
        return [entry for entry in self.workspace_entries() if entry.name.removesuffix(".img") not in ahead]

    def workspace_entries(self) -> list[Path]:
        """What the workspaces folder holds but the blank images capped workspaces are copied from (a cache kept
        between servers: hostfs/blank_images.py)."""
        return [entry for entry in self.workspaces.iterdir() if not BLANK.fullmatch(entry.name)]


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    """A host folder with one file that no host operation on sandbox-made paths may reach."""
    folder = tmp_path / "canary"
    folder.mkdir()
    (folder / "keep").write_text("untouched")
    return folder


@contextlib.contextmanager
def fresh_dirs(prefix: str) -> Iterator[ServerDirs]:
    """A server's own runtime and workspace dirs under a new short /tmp folder (socket paths < 107 bytes).

    At the end nothing of its servers may stay mounted once coderunner's own clean-up ran: a test that
    SIGKILLs its server leaves that server's workspaces mounted until its dirs sweeper or a next start
    removes them, and a folder removed under a mount would hide the loop device it holds for good."""
    root = _passable(Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp")))
    dirs = ServerDirs(root=root, runtime=root / "r", workspaces=root / "w")
    try:
        yield dirs
    finally:
        # A server its client left may still be ending (its own clean-up runs last): its mounts are its own
        # to remove until it has, CLEAN_UP_WAIT_S at most.
        deadline = time.monotonic() + CLEAN_UP_WAIT_S
        while (left := clean_after_dead_servers(dirs)) and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.rmtree(root, ignore_errors=True)
    assert not left, f"mounted after its servers ended and the next start's clean-up ran: {left}"


def clean_after_dead_servers(dirs: ServerDirs) -> list[str]:
    """What a server's next start does with what a dead one left: coderunner's own clean-up of dead
    session dirs. Returns the mounts even that left below `dirs.root`."""
    if dirs.runtime.is_dir():
        # The backend the dead servers ran: a gVisor server's next start is a gVisor backend's (runsc state and
        # rootfs mounts are its own clean-up, by the dead sessions' names).
        gvisor = (dirs.runtime / GVISOR_DIR).is_dir()
        settings = load_settings(
            Path(os.devnull), runtime_dir=dirs.runtime, workspaces_dir=dirs.workspaces,
            **({"backend": "gvisor"} if gvisor else {}),
        )  # fmt: skip
        backend = make_backend(settings)
        try:
            remove_stale_dirs(settings.runtime_dir, settings.workspaces_dir, backend.remove_stale, 0.0)
        finally:
            if isinstance(backend, GvisorBackend):
                backend.close()
    return mounted_under(dirs.root)


def mounted_under(root: Path) -> list[str]:
    """The mount points below `root` (/proc/mounts)."""
    mounts = Path("/proc/mounts").read_text().splitlines()
    return [line.split()[1] for line in mounts if f" {root}/" in line]


@pytest.fixture
def dirs() -> Iterator[ServerDirs]:
    with fresh_dirs("crt-") as paths:
        yield paths


def server_env(dirs: ServerDirs, **extra: str) -> dict[str, str]:
    """The server's whole environment: a secret the sandbox must never see, and test-sized limits."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        # os.devnull: no config file at all (never the user's own; a named file that is missing is an error).
        "CODERUNNER_CONFIG": os.devnull,
        "CODERUNNER_RUNTIME_DIR": str(dirs.runtime),
        "CODERUNNER_WORKSPACES_DIR": str(dirs.workspaces),
        "CODERUNNER_INTERRUPT_GRACE_S": "1.5",
        "CODERUNNER_PROGRESS_INTERVAL_S": "0.3",
        # No warm pool unless a test asks (test_e2e_pool.py): many tests count the sandboxes that run.
        "CODERUNNER_POOL_SIZE": "0",
        # Every tool group: tests reach sessions, snapshots and one-shots as a user who turned them on would
        # (the default set is tests/unit/test_tool_contract.py's and test_tool_schemas.py's to hold).
        "CODERUNNER_TOOLS": "all",
        "CODERUNNER_TOKEN": TEST_TOKEN,
        # Never the user's own token file, even where a test drops CODERUNNER_TOKEN.
        "CODERUNNER_TOKEN_FILE": str(dirs.root / "token"),
        SECRET_NAME: SECRET_VALUE,
        # The server under test is this checkout's, whichever install made the venv (worktrees share one).
        "PYTHONPATH": str(REPO / "src"),
    }
    for key in (
        "CODERUNNER_SANDBOX_ENV",
        "CODERUNNER_BACKEND",
        "CODERUNNER_OCI_RUNTIME",
        "CODERUNNER_IMAGE",
        "CODERUNNER_EXPORT_DIR",
        "CODERUNNER_KERNEL_TEMPLATE",  # kernels from the warm template (issue 41): the suites run with it on too
        "CODERUNNER_DEV_GUEST_LIB",  # gvisor: a host copy of the guest package over the image's (development)
    ):
        if key in os.environ:
            env[key] = os.environ[key]
    env.update(extra)
    return env


SERVER_CMD = [sys.executable, "-m", "coderunner.cli", "serve"]


@contextlib.asynccontextmanager
async def stdio_client(env: dict[str, str]) -> AsyncIterator[Client]:
    params = StdioServerParameters(command=SERVER_CMD[0], args=SERVER_CMD[1:], env=env, cwd=str(REPO))
    async with Client(params, read_timeout_seconds=120) as client:
        yield client


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def http_server(env: dict[str, str], transport: str = "streamable-http") -> Iterator[str]:
    """Start `coderunner serve` on a free loopback port; yield its URL; SIGTERM it afterwards."""
    port = _free_port()
    path = "/mcp" if transport == "streamable-http" else "/sse"
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [*SERVER_CMD, "--transport", transport, "--port", str(port)],
            env=env,
            cwd=str(REPO),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _await_listening(process, port, log)
            yield f"http://127.0.0.1:{port}{path}"
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
                log.seek(0)
                said = log.read().decode(errors="replace")[-3000:]
                raise AssertionError(
                    f"the server did not stop within its bound after SIGTERM; its log:\n{said}"
                ) from None


def _await_listening(process: subprocess.Popen[bytes], port: int, log: typing.IO[bytes]) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited {process.returncode}: {log.read().decode()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if time.monotonic() > deadline:
            log.seek(0)
            said = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"server did not start listening within {SERVER_START_TIMEOUT_S}s; its log: {said}")
        time.sleep(0.05)


@contextlib.asynccontextmanager
async def connect_http(
    url: str, token: str | None = TEST_TOKEN, headers: dict[str, str] | None = None, **options: typing.Any
) -> AsyncIterator[Client]:
    """The official client on an HTTP URL (streamable HTTP, or legacy SSE for /sse), with a bearer token."""
    sent = {"Authorization": f"Bearer {token}"} if token else {}
    sent.update(headers or {})
    options.setdefault("read_timeout_seconds", 120)
    if url.endswith("/sse"):
        async with Client(sse_client(url, headers=sent), **options) as client:
            yield client
        return
    async with (
        httpx2.AsyncClient(headers=sent, timeout=httpx2.Timeout(30, read=None)) as http,
        Client(streamable_http_client(url, http_client=http), **options) as client,
    ):
        yield client


@contextlib.asynccontextmanager
async def http_client(env: dict[str, str]) -> AsyncIterator[Client]:
    with http_server(env) as url:
        async with connect_http(url) as client:
            yield client


@contextlib.asynccontextmanager
async def open_client(transport: str, env: dict[str, str]) -> AsyncIterator[Client]:
    factory = {"stdio": stdio_client, "streamable-http": http_client, "memory": memory_client}[transport]
    async with factory(env) as client:
        yield client


def server_settings(env: Mapping[str, str]) -> Settings:
    """The Settings `coderunner serve` reads when `env` is its whole environment (and the config file
    it names), as load_settings reads them; os.environ is itself again on return."""
    with mock.patch.dict(os.environ, env, clear=True):
        return load_settings()


@contextlib.asynccontextmanager
async def memory_client(env: dict[str, str], **options: typing.Any) -> AsyncIterator[Client]:
    """The real server in this process, reached in memory: the configured backend (bwrap by default),
    a real SessionManager and build_server, set up from `env` as `coderunner serve` would be.

    For the server's lifetime `env` is also laid over this process's environment, so that its secret
    (SECRET_NAME) and CODERUNNER_* values are in the environment of the process the sandboxes start
    from, as they are in a served process: the isolation tests' assertions can still fail.
    """
    settings = server_settings(env)
    options.setdefault("read_timeout_seconds", 120)
    with mock.patch.dict(os.environ, env):
        backend = make_backend(settings)
        async with (
            SessionManager(settings, backend) as manager,
            Client(build_server(manager, LocalOneShots.for_manager(manager)), **options) as client,
        ):
            yield client


@pytest.fixture
async def client(dirs: ServerDirs) -> AsyncIterator[Client]:
    """A client of the real server with the default test environment, in memory (one test each)."""
    async with memory_client(server_env(dirs)) as connected:
        yield connected


@contextlib.contextmanager
def raw_stdio_server(
    env: dict[str, str], tool_calls: list[tuple[str, dict[str, object]]], *, new_session: bool = False
) -> Iterator[subprocess.Popen[bytes]]:
    """A stdio server driven by hand (no client library), for tests that kill or signal it.

    Yields once the handshake and every call in `tool_calls` have been answered; kills it on exit.
    `new_session`: its own process group, which a test may kill whole.
    """
    server = subprocess.Popen(
        SERVER_CMD,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=new_session,
    )
    try:
        assert server.stdin and server.stdout
        handshake = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}
        messages: list[dict[str, object]] = [
            {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": handshake},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
        ]
        for number, (name, arguments) in enumerate(tool_calls, start=1):
            params = {"name": name, "arguments": arguments}
            messages.append({"jsonrpc": "2.0", "id": number, "method": "tools/call", "params": params})
        for message in messages:
            server.stdin.write((json.dumps(message) + "\n").encode())
            server.stdin.flush()
        replies = 0
        while replies < len(tool_calls) + 1:
            line = server.stdout.readline()
            assert line, "server closed stdout"
            replies += b'"id":' in line
        yield server
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)


def text_of(result: CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if block.type == "text")


def json_of(result: CallToolResult) -> typing.Any:
    """A JSON reply's value: replies carry it once, as the first text block (no structured copy)."""
    first = result.content[0]
    assert first.type == "text", result
    return json.loads(first.text)


def images_of(result: CallToolResult) -> list[bytes]:
    return [base64.b64decode(block.data) for block in result.content if block.type == "image"]


async def run(client: Client, code: str, **arguments: object) -> CallToolResult:
    return await client.call_tool("run_python", {"code": code, **arguments})


#: How many manage_jobs waits (each up to JOB_WAIT_S) follow a run that went on as a job.
JOB_WAITS = 40
JOB_WAIT_S = 30


def running_job(reply: CallToolResult) -> str | None:
    """The job id of a reply that says its run goes on as a job (run_python's `_meta`, execute_code's JSON)."""
    job = (reply.meta or {}).get("coderunner/job")
    if isinstance(job, dict):
        return str(job["job_id"]) if job.get("status") == "running" else None
    with contextlib.suppress(ValueError, IndexError, AssertionError):
        payload = json_of(reply)
        if isinstance(payload, dict) and payload.get("status") == "running" and "job_id" in payload:
            return str(payload["job_id"])
    return None


async def run_to_end(client: Client, code: str, tool: str = "run_python", **arguments: object) -> list[CallToolResult]:
    """Every reply of one run, as a careful client reads it: the run's own, then, if it went on as a job (it
    outlived detach_after_s: heavy output on a loaded machine, where sessions get only idle CPU), each
    manage_jobs wait until the job ended."""
    replies = [await client.call_tool(tool, {"code": code, **arguments})]
    for _ in range(JOB_WAITS):
        job_id = running_job(replies[-1])
        if job_id is None:
            return replies
        wait = {"action": "wait", "job_id": job_id, "timeout_s": JOB_WAIT_S}
        replies.append(await client.call_tool("manage_jobs", wait))
    raise AssertionError(f"still running after {JOB_WAITS} waits of {JOB_WAIT_S} s: {text_of(replies[-1])[-500:]}")


def sandbox_processes_alive(dirs: ServerDirs) -> list[int]:
    """Host pids of the processes whose command line names one of this test's runtime dirs (bwrap and its
    pid 1), and of everything below them (the kernel, which reads its connection file from its own root,
    and whatever it forked; a kernel forked from the kernel template is below the template's bwrap)."""
    found = []
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if str(dirs.runtime).encode() in cmdline:
            found.append(int(entry.name))
    named = set(found)
    for pid, parent in parents.items():
        seen: set[int] = set()
        while parent in parents and parent not in named and parent not in seen:  # bounded: each pid once
            seen.add(parent)
            parent = parents[parent]
        if parent in named and pid not in named:
            found.append(pid)
    # The kernel template (kernel_template) is no sandbox but the server's helper, whose bwrap names the guest
    # copy in the runtime dir: it and that bwrap are left out; the kernels forked from it (below it) are not.
    helpers = {pid for pid in found if _comm(pid) == TEMPLATE_NAME}
    helpers |= {parents[pid] for pid in helpers if parents.get(pid) in named}
    return [pid for pid in found if pid not in helpers]


#: The kernel template's name in /proc/PID/comm (guest/kernel_template.py NAME).
TEMPLATE_NAME = "kernel-template"


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


async def wait_until(predicate, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    with anyio.move_on_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.1)
        return True
    return False


@pytest.fixture(scope="module")
def servers() -> Iterator[NetnsServers]:
    """The egress tests' HTTP servers in a network namespace of their own (tests/netns_servers.py),
    one pair per test module that asks. A machine that cannot make them fails the module: the
    egress tests are the only proof that 'allowlist' holds."""
    problem = available()
    if problem:
        pytest.fail(f"the egress tests' servers cannot be made here: {problem}")
    with netns_servers() as made:
        yield made


#: The slowest test files (seconds on this 2-core machine, two workers), handed out first: pytest-xdist
#: gives each worker whole files in collection order, so a slow file left for last keeps one worker busy
#: while the other idles. Order only; every file runs as before.
SLOWEST_FILES = (
    "test_e2e_podman.py",  # ~115 s
    "test_conformance.py",  # ~95 s
    "test_cluster_mode.py",  # ~55 s (a real Ray cluster)
    "test_abuse_gvisor.py",  # ~60 s
    "test_abuse_podman.py",  # ~60 s
    "test_e2e_tsclient.py",  # ~45 s
    "test_abuse.py",  # ~45 s
    "test_abuse_paths.py",  # ~40 s
    "test_e2e_jobs.py",  # ~40 s
    # The fast suite's slowest (tests/unit), first when it runs alone.
    "test_tools_in_memory.py",  # ~8 s
    "test_standby.py",  # ~6 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FILES)))  # stable: the rest keep their order
