"""The user's network ceiling: what the agent is offered, and what it is refused, in memory.

Containment of each mode is the abuse suite's (tests/abuse/test_abuse_egress/ceiling.py); here
the rules: the ceiling that follows from the settings, the tool schemas and texts that offer only
modes within it, and a refusal that names the setting from every tool that takes a network.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mcp import Client
from mcp.types import TextContent

from coderunner.config import ConfigError, load_settings
from coderunner.oneshot.local import LocalOneShots
from coderunner.server import build_server
from coderunner.vocabulary.network import (
    MODES,
    NetworkCeilingError,
    check_within,
    default_ceiling,
    modes_within,
    offline_install,
)

from .conftest import ManagerFactory

pytestmark = pytest.mark.anyio

NO_FILE = Path(os.devnull)  # read no config file


@pytest.mark.parametrize(
    ("overrides", "ceiling"),
    [
        ({}, "none"),
        ({"allowed_domains": ["github"]}, "allowlist"),
        ({"network": "allowlist", "allowed_domains": ["github"]}, "allowlist"),
        ({"network": "internet"}, "internet"),
        ({"max_network": "internet"}, "internet"),
        ({"allowed_domains": ["github"], "max_network": "none"}, "none"),
    ],
)
def test_the_ceiling_is_what_the_user_turned_on(overrides: dict[str, object], ceiling: str) -> None:
    assert load_settings(NO_FILE, **overrides).network_ceiling == ceiling


@pytest.mark.parametrize("ceiling", MODES)
def test_the_offline_install_refusal_names_no_mode_above_the_ceiling(ceiling: str) -> None:
    """install_packages' refusal in network 'none', which the kernel's %pip says too (in every sandbox)."""
    text = offline_install(ceiling)
    assert text.startswith("installing packages needs network, and this session has network 'none': ")
    for mode in MODES[MODES.index(ceiling) + 1 :]:
        assert f"network={mode!r}" not in text, text
    if ceiling != "none":
        assert f"network={ceiling!r}" in text, text


def test_a_default_network_above_max_network_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match="above max_network"):
        load_settings(NO_FILE, network="internet", max_network="allowlist")


def test_each_mode_above_the_ceiling_is_refused_naming_the_setting() -> None:
    for ceiling in MODES:
        for mode in MODES:
            if mode in modes_within(ceiling):
                check_within(mode, ceiling)
            else:
                with pytest.raises(NetworkCeilingError, match="max_network") as refused:
                    check_within(mode, ceiling)
                assert "ask the user" in str(refused.value)
    assert default_ceiling("none", [], None) == "none"


def _texts(result: object) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, TextContent))  # type: ignore[attr-defined]


async def test_no_tool_offers_or_grants_a_mode_above_the_ceiling(make_scripted: ManagerFactory) -> None:
    async with (
        make_scripted() as manager,
        Client(build_server(manager, LocalOneShots.for_manager(manager)), raise_exceptions=True) as client,
    ):
        assert manager.settings.network_ceiling == "none"
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        for name in ("create_session", "execute_code"):
            network = tools[name].input_schema["properties"]["network"]
            assert network["enum"] == ["none"] and "internet" not in json.dumps(network), (name, network)
        for tool, arguments in [
            ("create_session", {"network": "internet"}),
            ("create_session", {"network": "allowlist"}),
            ("execute_code", {"language": "bash", "code": "echo hi", "network": "internet"}),
        ]:
            refused = await client.call_tool(tool, arguments)
            assert refused.is_error, (tool, _texts(refused))
            assert "max_network" in _texts(refused) and "ask the user" in _texts(refused), _texts(refused)
            assert "Value error" not in _texts(refused)
        # 'allowlist' is refused with how the user allows hosts too.
        assert "allowed_domains" in _texts(await client.call_tool("create_session", {"network": "allowlist"}))
        assert manager.list() == []
        capabilities = json.loads(_texts(await client.call_tool("get_capabilities", {})))
        assert "internet" not in json.dumps(capabilities["network"]), capabilities["network"]
        assert list(capabilities["network"]["modes"]) == ["none"]
        # The hint install_packages gives names no mode above the ceiling either.
        hint = _texts(await client.call_tool("install_packages", {"packages": ["six"]}))
        assert "network" in hint and "internet" not in hint and "allowlist" not in hint, hint


async def test_within_the_ceiling_the_asked_mode_is_granted(make_scripted: ManagerFactory) -> None:
    async with (
        make_scripted(max_network="internet") as manager,
        Client(build_server(manager, LocalOneShots.for_manager(manager)), raise_exceptions=True) as client,
    ):
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert tools["create_session"].input_schema["properties"]["network"]["enum"] == list(MODES)
        made = await client.call_tool("create_session", {"network": "internet"})
        assert not made.is_error, _texts(made)
        assert json.loads(_texts(made))["network"] == "internet"
