"""get_capabilities: what this server offers, for a model to learn before it calls anything else."""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

from typing import Any

from mcp.types import CallToolResult, ToolAnnotations

from coderunner.policy.tool_groups import ALWAYS, GROUP_NAMES, GROUP_PURPOSES, ToolGroups
from coderunner.tools.context import ToolContext, json_result, tool

#: How the user (never the agent) turns a group on; said beside the groups that are off.
TURN_ON = (
    "the user adds a group to the tools setting (serve --tools python,sessions; CODERUNNER_TOOLS; tools in config.toml)"
)


def tool_groups(groups: ToolGroups, offered: set[str]) -> dict[str, Any]:
    """Which groups this server offers, and what each one it does not is for, with how to turn one on
    (its tools go unnamed: a reply names only offered tools, policy/tool_mentions.py)."""
    on = [group for group in GROUP_NAMES if set(groups.members(group)) <= offered]
    off = {group: GROUP_PURPOSES[group] for group in GROUP_NAMES if group not in on}
    answer: dict[str, Any] = {"on": on}
    if off:
        answer["off"] = off
        answer["to_turn_one_on"] = TURN_ON
    return answer


@tool(group=ALWAYS, annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
async def get_capabilities(
    tools: ToolContext,
) -> CallToolResult:
    """This server's languages, sandbox, limits, network, packages, tools."""
    names = sorted(listed.name for listed in await tools.server.list_tools())
    answer = await tools.capabilities.describe(tools.host, tools.oneshots, names)
    answer["tool_groups"] = tool_groups(ToolGroups(tools.groups), set(names))
    return json_result(answer)
