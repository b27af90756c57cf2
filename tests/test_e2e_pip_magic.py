"""`%pip install` and `!pip install` in run_python, for real: install_packages' install where the session's
network reaches the package index, an error at once (naming the way out) where it does not.

One server with the egress tests' ceiling (the package index preset, a test server in a network
namespace of its own), so the three cases are sessions of it: allowlist with the index, allowlist
without it, and network 'none'.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from mcp import Client

from .conftest import ServerDirs, run, stdio_client, text_of
from .netns_servers import NetnsServers
from .test_e2e_egress import create, egress_env, module_dirs, ok  # noqa: F401 - module_dirs: a fixture

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: What %pip prints when pip starts: absent from a refusal, which must come before any pip.
PIP_STARTED = "pip install six"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def client(module_dirs: ServerDirs, servers: NetnsServers) -> AsyncIterator[Client]:  # noqa: F811
    async with stdio_client(egress_env(module_dirs, servers)) as client:
        yield client


async def failed(client: Client, code: str, session_id: str) -> str:
    result = await run(client, code, session_id=session_id)
    assert result.is_error, text_of(result)
    return text_of(result)


async def test_percent_pip_installs_into_the_session_and_the_next_cell_imports_it(client: Client) -> None:
    session = await create(client, network="allowlist", allow=["python-packages"])
    text = await ok(client, "%pip install -q six==1.17.0", session)
    assert "installed six==1.17.0 into /workspace/.coderunner/site-packages" in text, text
    assert "1.17.0" in await ok(client, "import six; print(six.__version__)", session)
    # The same folder install_packages reports: one install, two doors.
    listed = await client.call_tool("install_packages", {"packages": ["six==1.17.0"], "session_id": session})
    assert json.loads(text_of(listed))["installed"] == {"six": "1.17.0"}, text_of(listed)


async def test_bang_pip_forms_install_the_same_way(client: Client) -> None:
    session = await create(client, network="allowlist", allow=["python-packages"])
    code = "import sys\nfor spec in ['six==1.16.0']:\n    !{sys.executable} -m pip install {spec}\n"
    assert "installed six==1.16.0" in await ok(client, code, session)
    text = await ok(client, "!pip3 install six==1.17.0\nimport six\nprint('version', six.__version__)", session)
    assert "installed six==1.17.0" in text and "version 1.17.0" in text, text


async def test_an_allowlist_without_the_index_fails_at_once_naming_the_way(
    client: Client, servers: NetnsServers
) -> None:
    session = await create(client, network="allowlist", allow=[servers.public_ip])
    text = await failed(client, "%pip install six", session)
    assert "PackageInstallError" in text and "pip cannot reach the package index" in text, text
    assert "not in this session's allowlist" in text and PIP_STARTED not in text, text
    # The reply's network line names the host and how to get a session that reaches it.
    assert "create_session(network='allowlist', allow=[" in text, text
    # install_packages runs the same guest code: the same refusal, before pip too (no "pip failed").
    tool = await client.call_tool("install_packages", {"packages": ["six"], "session_id": session})
    assert tool.is_error and "pip cannot reach the package index" in text_of(tool), text_of(tool)
    assert "pip failed" not in text_of(tool) and "not in this session's allowlist" in text_of(tool), text_of(tool)


async def test_network_none_fails_at_once_with_install_packages_words(client: Client) -> None:
    session = await create(client, network="none")
    text = await failed(client, "!pip install six", session)
    assert "installing packages needs network" in text and "network 'none'" in text, text
    # The way out within the user's ceiling (allowlist here), never a mode above it.
    assert "create_session(network='allowlist', allow=['python-packages'])" in text, text
    assert "network='internet'" not in text and PIP_STARTED not in text, text


async def test_conda_and_uv_are_refused_naming_pip_and_other_shell_commands_still_run(client: Client) -> None:
    session = await create(client, network="none")
    for code in ("!conda install numpy", "%conda install numpy", "!uv pip install numpy", "%uv pip install numpy"):
        text = await failed(client, code, session)
        assert "not available in this sandbox" in text and "%pip install NAME" in text, (code, text)
        assert "install_packages" in text, text
    assert "still runs" in await ok(client, "!echo still runs", session)
    assert "pip " in await ok(client, "!pip --version", session)
    text = await failed(client, "%pip install six --index-url=http://127.0.0.1/simple", session)
    assert "--index-url=http://127.0.0.1/simple" in text and PIP_STARTED not in text, text
