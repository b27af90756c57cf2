"""Every tool's input schema through the real conversion code of other clients, and the tools/list budget.

google-genai (its MCP-tool conversion) and openai-agents (MCPUtil.to_function_tool, which runs
ensure_strict_json_schema) are pinned in the dev extra. Nothing here talks to a network or a sandbox:
the server is built as `serve` builds it and only its tool list is read.
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path
from typing import Any

import anyio
import pytest
from agents.mcp import MCPServerStdio, MCPUtil
from agents.strict_schema import ensure_strict_json_schema
from google.genai import _mcp_utils as genai_mcp
from mcp.server.mcpserver import MCPServer
from mcp.types import Tool

from coderunner.config import ConfigError, Settings, load_settings
from coderunner.policy.tool_groups import ALWAYS, DEFAULT_GROUPS, GROUP_NAMES, ToolGroups, ToolsetError
from coderunner.policy.tool_mentions import Mentions, names_in
from coderunner.server import build_server
from coderunner.tools import ToolContext, declared_groups
from coderunner.tools.documents import called_as
from coderunner.tools.schemas import SchemaError, finish_tools, portable_schema

from .conftest import ServerDirs, run, server_env, stdio_client, text_of

#: The tools as they declare their groups (tools/context.py's decorator).
GROUPS = declared_groups()
ALL_TOOLS = GROUPS.all_tools

#: Schema keywords google-genai's MCP conversion keeps (it silently drops the rest, e.g. exclusiveMinimum).
GEMINI_KEPT = {"type", "description", "enum", "default", "minimum", "maximum", "items", "pattern"}
#: 2,500 before issue 15/16: +41 for network "allowlist" (two enums) and create_session's allow, +234 for
#: the job tools (wait_job, cancel_job, list_jobs, and detach_after_s on two tools); issue 19: +265 for the
#: snapshot tools (snapshot_session, restore_session, fork_session, list_snapshots, delete_snapshot) and
#: create_session's keep_state: 3,040. Issue 28: 1,970 (31 tools, 12,109 bytes, became 14, 7,811 bytes):
#: operations that share arguments folded into one tool with an action, descriptions cut to what picks
#: the tool and fills its arguments, defaults that say nothing (false, []) left out.
#: Issue 37: the seed's six by name again (kernel_reset, browser_*, pdf_ops, image_ops with a closed
#: `args`) and the default set cut to the groups python, files, browser and documents: 15 tools,
#: 7,247 bytes (~1,812 tokens); all 19 tools are 9,486 bytes. The budget is the default set's.
BUDGET_TOKENS = 2_000


def tools_of(**settings: Any) -> list[Tool]:
    manager = types.SimpleNamespace(settings=Settings(**settings))
    return anyio.run(build_server(manager, manager).list_tools)


@pytest.fixture(scope="module")
def tools() -> list[Tool]:
    return tools_of()


def walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every sub-schema with its path: properties and array items."""
    found = [(path, schema)]
    for name, sub in schema.get("properties", {}).items():
        found += walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        found += walk(schema["items"], f"{path}[]")
    return found


def test_the_default_set_is_the_default_groups_and_every_tool_is_a_setting_away(tools: list[Tool]) -> None:
    assert {tool.name for tool in tools} == GROUPS.selected(DEFAULT_GROUPS)
    assert {tool.name for tool in tools_of(tools="all")} == ALL_TOOLS


@pytest.fixture(scope="module")
def all_tools() -> list[Tool]:
    return tools_of(tools="all")


def test_the_declared_groups_are_exactly_the_names_a_setting_may_use() -> None:
    declared = {group for groups in GROUPS.of.values() for group in groups}
    assert declared == {*GROUP_NAMES, ALWAYS}
    assert GROUPS.members(ALWAYS) == ("get_capabilities",)
    assert all(GROUPS.members(group) for group in GROUP_NAMES)


def test_a_tool_in_no_group_fails_at_start_instead_of_vanishing() -> None:
    server = MCPServer("t")

    @server.tool()
    async def stray_tool() -> str:
        """Registered, but named in no group."""
        return ""

    with pytest.raises(SchemaError, match="stray_tool: in no tool group"):
        finish_tools(server, ALL_TOOLS, GROUPS)


def test_a_tool_that_declares_no_group_or_an_unknown_one_fails_at_start() -> None:
    host = types.SimpleNamespace(settings=Settings())
    tools = ToolContext.create(MCPServer("t"), host, host)  # type: ignore[arg-type]

    @tools.server.tool()  # the SDK's own decorator: no group declared
    async def undeclared() -> str:
        """Declares no group."""
        return ""

    with pytest.raises(SchemaError, match="undeclared: in no tool group"):
        finish_tools(tools.server, {"undeclared"}, ToolGroups(tools.groups))
    with pytest.raises(ToolsetError, match="odd_tool: declares tool group 'pythn'"):
        ToolGroups({"odd_tool": ("python", "pythn")})


def test_schemas_have_no_titles_wrappers_free_form_objects_or_booleans_gemini_chokes_on(all_tools: list[Tool]) -> None:
    for tool in all_tools:
        text = json.dumps(tool.input_schema)
        assert '"title"' not in text and "anyOf" not in text and "$ref" not in text, tool.name
        assert "additionalProperties" not in text, tool.name  # google-genai fails on any boolean there
        assert tool.input_schema["type"] == "object" and "properties" in tool.input_schema
        for path, sub in walk(tool.input_schema):
            assert set(sub) <= GEMINI_KEPT | {"properties", "required"}, (tool.name, path, sub)
            if sub.get("type") == "object" and path:
                # One object argument at most, closed and one level deep: the seed's `args`.
                assert path == ".args" and sub["properties"], f"{tool.name}{path}: a nested object"
                assert all(inner.get("type") != "object" for inner in sub["properties"].values()), tool.name
        assert tool.description and "\n    " not in tool.description, tool.name  # no source indentation


def test_fixed_value_sets_are_enums(all_tools: list[Tool]) -> None:
    tools = all_tools
    by_name = {tool.name: tool.input_schema["properties"] for tool in tools}
    # Network modes: only those within the user's ceiling (vocabulary/network.py), so by default none.
    assert by_name["create_session"]["network"]["enum"] == ["none"]
    assert by_name["execute_code"]["network"]["enum"] == ["none"]
    for ceiling, modes in [("allowlist", ["none", "allowlist"]), ("internet", ["none", "allowlist", "internet"])]:
        widened = {tool.name: tool.input_schema["properties"] for tool in tools_of(max_network=ceiling, tools="all")}
        assert widened["create_session"]["network"]["enum"] == modes
        assert widened["execute_code"]["network"]["enum"] == modes
    assert by_name["execute_code"]["language"]["enum"] == ["python", "javascript", "bash"]
    assert by_name["write_file"]["encoding"]["enum"] == ["text", "base64"]
    assert by_name["browser_extract"]["format"]["enum"] == ["text", "html", "json", "table", "links"]
    assert by_name["browser_interact"]["action"]["enum"][:2] == ["click", "fill"]
    assert "to_images" in by_name["pdf_ops"]["op"]["enum"] and "ocr" in by_name["image_ops"]["op"]["enum"]
    assert by_name["image_ops"]["args"]["properties"]["format"]["enum"][:2] == ["png", "jpeg"]
    schemas = {tool.name: tool.input_schema for tool in tools}
    for tool, count in [("manage_jobs", 3), ("manage_sessions", 3), ("manage_snapshots", 5), ("manage_workspaces", 2)]:
        assert len(by_name[tool]["action"]["enum"]) == count and schemas[tool]["required"] == ["action"], tool
    assert by_name["run_python"]["variables"]["type"] == "string"


def test_google_genai_converts_every_tool_keeping_descriptions_and_constraints(all_tools: list[Tool]) -> None:
    for tool in all_tools:
        converted = genai_mcp.mcp_to_gemini_tool(tool).function_declarations[0]
        assert converted.name == tool.name and converted.description == tool.description
        parameters = converted.parameters.model_dump(exclude_none=True, mode="json")
        assert sorted(parameters.get("required", [])) == sorted(tool.input_schema.get("required", []))
        kept = parameters.get("properties", {})
        for name, ours in tool.input_schema["properties"].items():
            theirs = kept[name]
            types_ = ours["type"] if isinstance(ours["type"], list) else [ours["type"]]
            assert theirs["type"].lower() == next(t for t in types_ if t != "null"), (tool.name, name)
            assert theirs.get("nullable", False) == ("null" in types_), (tool.name, name)
            for key in ("description", "enum", "default", "minimum", "maximum", "pattern"):
                if key in ours:
                    assert theirs.get(key) == ours[key], (tool.name, name, key, theirs)
            if "items" in ours:
                assert theirs["items"]["type"].lower() == ours["items"]["type"], (tool.name, name)
            for inner, schema in ours.get("properties", {}).items():  # the seed's `args`, kept field by field
                kept_inner = theirs["properties"][inner]
                assert kept_inner.get("description") == schema.get("description"), (tool.name, name, inner)
                assert kept_inner.get("enum") == schema.get("enum"), (tool.name, name, inner)


def test_openai_agents_strict_conversion_keeps_every_tool_with_arguments_strict(all_tools: list[Tool]) -> None:
    server = MCPServerStdio(params={"command": "true"})  # never started: only its conversion is used
    for tool in all_tools:
        function_tool = MCPUtil.to_function_tool(tool, server, convert_schemas_to_strict=True)
        schema = function_tool.params_json_schema
        if not tool.input_schema["properties"]:
            # No argument to lose. openai-agents wants an explicit additionalProperties:false for these,
            # which google-genai cannot read; the tool is then sent non-strict, with the same empty object.
            assert function_tool.strict_json_schema is False and schema["properties"] == {}
            continue
        assert function_tool.strict_json_schema is True, tool.name
        assert schema["additionalProperties"] is False
        for name, ours in tool.input_schema["properties"].items():
            for key, value in ours.items():
                assert schema["properties"][name][key] == value, (tool.name, name, key)


def test_ensure_strict_json_schema_accepts_every_schema_unchanged_but_for_closure(all_tools: list[Tool]) -> None:
    for tool in all_tools:
        strict = ensure_strict_json_schema(json.loads(json.dumps(tool.input_schema)))
        if "args" in strict["properties"]:  # the one object argument is closed too, every field required
            args = strict["properties"]["args"]
            assert args.pop("additionalProperties") is False and args.pop("required") == list(args["properties"])
        assert strict["properties"] == tool.input_schema["properties"], tool.name
        assert strict["additionalProperties"] is False


def test_the_default_tool_list_fits_the_token_budget(tools: list[Tool]) -> None:
    size = sum(len(tool.model_dump_json(by_alias=True, exclude_none=True).encode()) for tool in tools)
    assert size / 4 <= BUDGET_TOKENS, f"tools/list is {size:,} bytes, ~{size // 4:,} tokens"


def test_tools_setting_exposes_groups_and_always_capabilities() -> None:
    names = {tool.name for tool in tools_of(tools=["python", "files"])}
    assert names == {*GROUPS.members("python"), *GROUPS.members("files"), "get_capabilities"}
    assert {tool.name for tool in tools_of(tools="oneshot,read_file")} == {
        "execute_code", "manage_jobs", "read_file", "get_capabilities",
    }  # fmt: skip
    assert GROUPS.selected(["all", "python"]) == ALL_TOOLS


#: Every group alone, and each with python (where most narrower settings start).
NARROW_SETTINGS = [[group] for group in GROUP_NAMES] + [["python", group] for group in GROUP_NAMES if group != "python"]


@pytest.mark.parametrize("entries", NARROW_SETTINGS, ids=",".join)
def test_no_description_or_instruction_names_a_tool_the_setting_leaves_out(entries: list[str]) -> None:
    host = types.SimpleNamespace(settings=Settings(tools=entries))
    server = build_server(host, host)  # type: ignore[arg-type]
    listed = anyio.run(server.list_tools)
    offered = {tool.name for tool in listed}
    assert offered == GROUPS.selected(entries)
    hidden = ALL_TOOLS - offered
    for tool in listed:
        text = f"{tool.description} {json.dumps(tool.input_schema)}"
        assert not names_in(text, hidden), (tool.name, names_in(text, hidden))
    assert server.instructions and not names_in(server.instructions, hidden)


def test_a_run_answering_with_a_job_id_is_followed_by_a_job_tool_in_its_group() -> None:
    for group in ("python", "oneshot"):
        assert "manage_jobs" in GROUPS.selected([group])


def test_a_mention_of_a_tool_not_offered_becomes_the_group_the_user_can_add() -> None:
    mentions = Mentions(GROUPS.selected(["python"]), GROUPS)
    reply = (
        "denied 'a.org'; to reach it: create_session(network='allowlist', allow=['a.org']); or copy it with "
        "transfer_file (download); manage_jobs reads the rest; run_python (persistent kernel)"
    )
    assert mentions.text(reply) == (
        "denied 'a.org'; to reach it: a tool not offered here (the user can add 'sessions' to the tools setting); "
        "or copy it with a tool not offered here (the user can add 'files' to the tools setting) (download); "
        "manage_jobs reads the rest; run_python (persistent kernel)"
    )
    only_run = Mentions(GROUPS.selected(["run_python"]), GROUPS)
    assert only_run.value({"note": ["manage_jobs reads the rest"], "n": 1}) == {
        "note": ["a tool not offered here (the user can add 'python' or 'oneshot' or 'jobs' to the tools setting) "
                 "reads the rest"],
        "n": 1,
    }  # fmt: skip
    everything = Mentions(ALL_TOOLS, GROUPS)
    assert everything.text(reply) == reply


def test_an_unknown_group_is_refused_with_the_valid_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ToolsetError, match=r"unknown tool group 'pyhton'.*python, sessions"):
        GROUPS.selected(["pyhton"])
    monkeypatch.setenv("CODERUNNER_TOOLS", "python,no such")
    with pytest.raises(ConfigError, match=r"tools: unknown tool group 'no such'"):
        load_settings(Path(os.devnull))
    # A name that could be a tool's is checked where the server is built, against the tools themselves.
    monkeypatch.setenv("CODERUNNER_TOOLS", "python,nope")
    settings = load_settings(Path(os.devnull))
    with pytest.raises(ConfigError, match=r"tools: unknown tool group 'nope': use all, python"):
        build_server(types.SimpleNamespace(settings=settings), types.SimpleNamespace())  # type: ignore[arg-type]
    monkeypatch.setenv("CODERUNNER_TOOLS", "python, browser")
    assert load_settings(Path(os.devnull)).tools == ["python", "browser"]


def test_portable_schema_rewrites_null_wrappers_and_refuses_what_converters_cannot_keep() -> None:
    wrapped = {
        "type": "object",
        "title": "xArguments",
        "properties": {
            "n": {
                "anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}],
                "default": None,
                "title": "N",
                "description": "count",
            }
        },
    }
    assert portable_schema(wrapped) == {
        "type": "object",
        "properties": {"n": {"type": ["integer", "null"], "minimum": 1, "description": "count"}},
    }
    free = {"type": "object", "properties": {"v": {"type": "object", "additionalProperties": True}}}
    with pytest.raises(SchemaError, match="free-form object"):
        portable_schema(free, "t")
    union = {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}
    with pytest.raises(SchemaError, match="union"):
        portable_schema(union, "t")


async def call(tool_name: str, arguments: dict[str, Any]) -> Any:
    host = types.SimpleNamespace(settings=Settings(tools=["all"]))
    server = build_server(host, host)  # type: ignore[arg-type]
    tool = server._tool_manager.get_tool(tool_name)
    return await tool.run(arguments, context=None, convert_result=True)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_wrong_arguments_are_refused_in_plain_words_before_any_work() -> None:
    unknown = await call("run_python", {"code": "1", "sesion_id": "x"})
    assert unknown.is_error
    assert unknown.content[0].text == (
        "run_python: unknown argument 'sesion_id' (it takes: code, session_id, timeout_s, variables, detach_after_s)"
    )
    typed = await call("image_ops", {"input_path": "a.png", "op": "crop", "args": {"box": ["a", 0, 1, 1]}})
    assert typed.is_error and typed.content[0].text.startswith("image_ops: args.box.0: Input should be a valid integer")
    missing = await call("pdf_ops", {"op": "info"})
    assert missing.is_error and missing.content[0].text == "pdf_ops: missing argument 'input_path'"
    stray = await call("pdf_ops", {"input_path": "a.pdf", "op": "info", "args": {"colour": 1}})
    assert stray.content[0].text == (
        "pdf_ops: unknown argument 'args.colour' "
        "(args takes: pages, inputs, ranges, degrees, dpi, password, output, output_prefix)"
    )
    for text in (unknown.content[0].text, typed.content[0].text):
        assert "input_value" not in text and "pydantic" not in text and "validation error" not in text


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("tool", "arguments", "said"),
    [
        ("manage_jobs", {"action": "wait"}, "manage_jobs action 'wait' needs a job_id"),
        ("manage_sessions", {"action": "close"}, "manage_sessions action 'close' needs the session_id"),
        ("manage_snapshots", {"action": "restore"}, "manage_snapshots action 'restore' needs a snapshot"),
        ("manage_workspaces", {"action": "delete"}, "manage_workspaces action 'delete' needs the name"),
        ("transfer_file", {"direction": "download", "host_path": "x"}, "direction 'download' needs sandbox_path"),
        ("browser_navigate", {}, "browser_navigate: missing argument 'url'"),
        ("browser_navigate", {"url": "index.html"}, "browser_navigate needs an absolute URL"),
        ("browser_extract", {"selector": "p", "url": "x"}, "unknown argument 'url' (it takes: selector, format"),
        ("browser_interact", {"action": "click", "selector": "p", "full_page": True}, "unknown argument 'full_page'"),
    ],
)
async def test_a_folded_tool_says_what_its_action_lacks_or_does_not_take(
    tool: str, arguments: dict[str, Any], said: str
) -> None:
    """Checked before any session is touched: the host here has nothing but settings."""
    refused = await call(tool, arguments)
    assert refused.is_error and said in refused.content[0].text, refused.content[0].text


def test_a_guest_failure_is_said_as_the_tool_called() -> None:
    assert called_as("pdf_ops: pdf_ops merge needs inputs", "pdf_ops", "pdf_ops") == "pdf_ops: merge needs inputs"
    assert called_as("browser: could not load x", "browser", "browser_navigate") == "browser_navigate: could not load x"
    assert called_as("network is off", "browser", "browser_navigate") == "network is off"


@pytest.mark.anyio
@pytest.mark.e2e
async def test_a_server_started_with_some_groups_lists_and_serves_only_those(dirs: ServerDirs) -> None:
    async with stdio_client(server_env(dirs, CODERUNNER_TOOLS="python")) as client:
        listed = await client.list_tools()
        assert {tool.name for tool in listed.tools} == {*GROUPS.members("python"), "get_capabilities"}
        assert text_of(await run(client, "6 * 7")).splitlines()[0] == "42"
        hidden = await client.call_tool("read_file", {"path": "x"})
        assert hidden.is_error and "read_file" in text_of(hidden)
