"""The agent asks for more network than the user allowed: every tool refuses, nothing is attached.

Issue 25, finding 0: with `serve --network none`, `execute_code(network='internet')` got a tap
device and DNS, and with an allowlist ceiling `create_session(network='internet')` was granted.
Each case is the agent's exact request against a real sandbox; the canary is the sandbox's own
view of its network (interfaces and resolver), which must stay at what the user allowed. Then the
server still serves and the bystander keeps its state.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from mcp import Client

from ..conftest import fresh_dirs, run, text_of
from .conftest import BYSTANDER_VALUE, Arena, HostTargets, open_arena

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: Bash that prints the network the sandbox really has: its interfaces and its resolver.
SEE_NETWORK = "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '; echo resolv:; cat /etc/resolv.conf"


@pytest.fixture(scope="module")
async def allowlist_arena(host_listeners: HostTargets) -> AsyncIterator[Arena]:
    """The user allowed the package index and nothing more (so: at most 'allowlist')."""
    with fresh_dirs("crn-") as dirs:
        async with open_arena(
            dirs, host_listeners, CODERUNNER_NETWORK="none", CODERUNNER_ALLOWED_DOMAINS="python-packages"
        ) as made:
            yield made


async def _still_serves(client: Client, bystander: str) -> None:
    assert BYSTANDER_VALUE in text_of(await run(client, "guarded", session_id=bystander))
    assert text_of(await run(client, "6 * 7")).splitlines()[0] == "42"


def _refused(text: str) -> None:
    assert "above what the user allows" in text and "max_network" in text and "ask the user" in text, text


async def test_with_network_none_execute_code_cannot_turn_on_the_internet(arena: Arena) -> None:
    asked = await arena.client.call_tool(
        "execute_code", {"language": "bash", "code": f"{SEE_NETWORK}; echo RAN", "network": "internet"}
    )
    assert asked.is_error and "RAN" not in text_of(asked)
    _refused(text_of(asked))
    # What the sandbox gets instead, at the user's default: loopback only, no resolver.
    seen = await arena.client.call_tool("execute_code", {"language": "bash", "code": SEE_NETWORK})
    stdout = json.loads(text_of(seen))["stdout"]
    interfaces = stdout.split("resolv:")[0].split()
    assert interfaces == ["lo"] and "nameserver" not in stdout, stdout
    await _still_serves(arena.client, arena.bystander)


async def test_with_network_none_no_session_gets_more(arena: Arena) -> None:
    asked = await arena.client.call_tool("create_session", {"network": "internet"})
    assert asked.is_error, text_of(asked)
    _refused(text_of(asked))
    asked = await arena.client.call_tool("create_session", {"network": "allowlist"})
    assert asked.is_error and "allowed_domains" in text_of(asked), text_of(asked)
    _refused(text_of(asked))
    sessions = json.loads(text_of(await arena.client.call_tool("manage_sessions", {"action": "list"})))["sessions"]
    assert {session["network"] for session in sessions} == {"none"}, sessions
    await _still_serves(arena.client, arena.bystander)


async def test_nothing_the_server_writes_offers_more_than_none(arena: Arena) -> None:
    listed = {tool.name: tool for tool in (await arena.client.list_tools()).tools}
    for name in ("create_session", "execute_code"):
        assert listed[name].input_schema["properties"]["network"]["enum"] == ["none"]
    capabilities = text_of(await arena.client.call_tool("get_capabilities", {}))
    assert "internet" not in json.dumps(json.loads(capabilities)["network"])
    hint = text_of(await arena.client.call_tool("install_packages", {"packages": ["six"]}))
    browse = text_of(await arena.client.call_tool("browser_navigate", {"url": "http://example.com/"}))
    for text in (hint, browse):
        assert "network='internet'" not in text and "network='allowlist'" not in text, text
        assert "ask the user" in text, text
    await _still_serves(arena.client, arena.bystander)


async def test_under_an_allowlist_ceiling_internet_is_refused_from_every_tool(allowlist_arena: Arena) -> None:
    client = allowlist_arena.client
    made = await client.call_tool("create_session", {"network": "internet"})
    assert made.is_error, text_of(made)
    _refused(text_of(made))
    ran = await client.call_tool(
        "execute_code", {"language": "bash", "code": f"{SEE_NETWORK}; echo RAN", "network": "internet"}
    )
    assert ran.is_error and "RAN" not in text_of(ran)
    _refused(text_of(ran))
    # Within the ceiling the agent still gets what it may have: the allowlist, through the proxy only.
    allowed = await client.call_tool("create_session", {"network": "allowlist", "allow": ["python-packages"]})
    assert not allowed.is_error, text_of(allowed)
    session = json.loads(text_of(allowed))
    assert session["network"] == "allowlist"
    probe = f"import subprocess\nprint(subprocess.check_output({SEE_NETWORK!r}, shell=True).decode())"
    seen = text_of(await run(client, probe, session_id=session["session_id"]))
    assert seen.split("resolv:")[0].split() == ["lo"], seen
    listed = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert listed["create_session"].input_schema["properties"]["network"]["enum"] == ["none", "allowlist"]
    hint = text_of(await client.call_tool("install_packages", {"packages": ["six"]}))
    assert "network='internet'" not in hint and "python-packages" in hint, hint
    capabilities = json.loads(text_of(await client.call_tool("get_capabilities", {})))
    assert list(capabilities["network"]["modes"]) == ["none", "allowlist"]
    assert "internet" not in json.dumps(capabilities["network"])
    await client.call_tool("manage_sessions", {"action": "close", "session_id": session["session_id"]})
    await _still_serves(client, allowlist_arena.bystander)
