"""`coderunner proxy`: a stdio client reaching a long-running HTTP server through the bridge."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator, Iterator

import anyio
import pytest
from mcp import Client, MCPError, StdioServerParameters

from .conftest import (
    REPO,
    SERVER_CMD,
    TEST_TOKEN,
    ServerDirs,
    _await_listening,
    _free_port,
    connect_http,
    http_server,
    images_of,
    run,
    server_env,
    text_of,
)

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


@contextlib.asynccontextmanager
async def proxy_client(url: str, dirs: ServerDirs, *extra: str) -> AsyncIterator[Client]:
    """What Claude Desktop does with `coderunner proxy URL`: launch it and speak MCP over its stdio."""
    env = server_env(dirs)
    env.pop("CODERUNNER_TOKEN")  # the proxy gets the token only the way each test says
    params = StdioServerParameters(
        command=SERVER_CMD[0], args=[*SERVER_CMD[1:-1], "proxy", url, *extra], env=env, cwd=str(REPO)
    )
    async with Client(params, read_timeout_seconds=120) as client:
        yield client


@contextlib.contextmanager
def server_on_port(dirs: ServerDirs, port: int, transport: str = "streamable-http") -> Iterator[None]:
    """A server on a fixed port, so that a test can stop it and start another in its place."""
    process = subprocess.Popen(
        [*SERVER_CMD, "--transport", transport, "--port", str(port)],
        env=server_env(dirs),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with open("/dev/null", "rb") as log:
            _await_listening(process, port, log)
        yield
    finally:
        process.terminate()
        process.wait(timeout=20)


async def test_proxy_carries_state_charts_and_progress(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs)) as url:
        async with proxy_client(url, dirs, "--token", TEST_TOKEN) as client:
            names = {tool.name for tool in (await client.list_tools()).tools}
            assert {"run_python", "create_session", "read_file"} <= names
            await run(client, "total = 40")
            assert text_of(await run(client, "total + 2")).splitlines()[0] == "42"
            chart = await run(client, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()")
            assert images_of(chart)[0].startswith(b"\x89PNG")

            notes: list[str] = []

            async def on_progress(progress: float, total: float | None, message: str | None) -> None:
                notes.append(message or "")

            code = "import time\nfor i in range(4):\n    print('step', i, flush=True)\n    time.sleep(0.6)"
            result = await client.call_tool("run_python", {"code": code}, progress_callback=on_progress)
            assert "step 3" in text_of(result)
            assert notes, "no progress notification crossed the proxy"
            assert any("step" in note for note in notes)


async def test_proxy_over_legacy_sse(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs), transport="sse") as url:
        async with proxy_client(url, dirs, "--token", TEST_TOKEN) as client:
            await run(client, "word = 'sse'")
            assert "sse" in text_of(await run(client, "word"))


async def test_proxy_takes_the_token_from_the_environment(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs)) as url:
        env = {**server_env(dirs)}
        params = StdioServerParameters(command=SERVER_CMD[0], args=[*SERVER_CMD[1:-1], "proxy", url], env=env)
        async with Client(params, read_timeout_seconds=120) as client:
            assert text_of(await run(client, "3 * 3")).splitlines()[0] == "9"


async def test_proxy_says_when_the_token_is_wrong(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs)) as url:
        async with proxy_client(url, dirs, "--token", "not-the-token") as client:
            result = await run(client, "1")
            assert result.is_error
            assert "refused" in text_of(result) and "token" in text_of(result)
            with pytest.raises(MCPError, match="token"):
                await client.list_tools()


async def test_proxy_says_when_the_server_is_down_and_reconnects_once_it_is_up(dirs: ServerDirs) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    async with proxy_client(url, dirs, "--token", TEST_TOKEN) as client:
        down = await run(client, "1")
        assert down.is_error and "cannot reach" in text_of(down) and url in text_of(down)
        with server_on_port(dirs, port):
            await run(client, "kept = 'first server'")
            assert "first server" in text_of(await run(client, "kept"))
        # The server restarts: its sessions are gone, the proxy reconnects by itself.
        with server_on_port(dirs, port):
            fresh = await run(client, "'kept' in globals()")
            assert not fresh.is_error, text_of(fresh)
            assert text_of(fresh).splitlines()[0] == "False"


async def test_cancelling_through_the_proxy_interrupts_the_cell(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs)) as url:
        async with proxy_client(url, dirs, "--token", TEST_TOKEN) as client:
            await run(client, "marker = 'alive'")
            with anyio.move_on_after(2.0):
                await run(client, "while True:\n    pass", timeout_s=300)
            # Had the cell kept running, the default session would still be busy for 300 s.
            after = await run(client, "marker", timeout_s=20)
            assert not after.is_error, text_of(after)
            assert "alive" in text_of(after)
        # The proxy's client and a direct client are different clients with different defaults.
        async with connect_http(url) as direct:
            assert "NameError" in text_of(await run(direct, "marker"))


async def test_a_named_proxy_keeps_its_export_folder_across_restarts(dirs: ServerDirs) -> None:
    """`proxy --client NAME`: the same client (exports, named workspaces) after the proxy restarts."""
    export = dirs.root / "out"
    env = server_env(dirs, CODERUNNER_EXPORT_DIR=str(export))
    with http_server(env) as url:
        for round_ in ("first", "second"):
            async with proxy_client(url, dirs, "--token", TEST_TOKEN, "--client", "desk") as client:
                saved = await run(client, f"open('/mnt/outputs/{round_}.txt', 'w').write('{round_}')")
                assert not saved.is_error, text_of(saved)
    assert sorted(path.name for path in (export / "desk").iterdir()) == ["first.txt", "second.txt"]
