"""The seed's tool table is a contract: its six tools, by name and argument name, in the default set and
in every setting that offers them; an unknown name is told what to use; no text names a tool that is not.

Clients, prompts and skills (SKILL.md among them) call these names. Nothing here starts a sandbox: the
server is built as `serve` builds it, with a host that has only settings.
"""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.types import TextContent, Tool

from coderunner.config import Settings
from coderunner.edge.instructions import INSTRUCTIONS
from coderunner.edge.stdio_proxy import build_proxy
from coderunner.policy.tool_groups import ALL, DEFAULT_GROUPS, GROUP_NAMES
from coderunner.policy.tool_mentions import names_in
from coderunner.policy.tool_renames import RENAMED
from coderunner.server import build_server
from coderunner.tools import declared_groups
from coderunner.tools.documents import ImageArgs, PdfArgs
from coderunner.tools.meta import tool_groups

REPO = Path(__file__).resolve().parents[2]

#: The seed's table: each tool, its arguments (the seed's names), and which of them a call must give.
SEED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "run_python": (("code",), ("code",)),
    "browser_navigate": (("url", "wait_for"), ("url",)),
    "browser_extract": (("selector", "format"), ("selector",)),
    "pdf_ops": (("input_path", "op", "args"), ("input_path", "op")),
    "image_ops": (("input_path", "op", "args"), ("input_path", "op")),
    "kernel_reset": ((), ()),
}
#: Every setting worth trying: the default, each group alone and beside python, everything.
SETTINGS: list[list[str]] = [
    list(DEFAULT_GROUPS),
    [ALL],
    *([group] for group in GROUP_NAMES),
    *(["python", group] for group in GROUP_NAMES if group != "python"),
]
GROUPS = declared_groups()


def listed(entries: list[str]) -> dict[str, Tool]:
    host = types.SimpleNamespace(settings=Settings(tools=entries))
    server = build_server(host, host)  # type: ignore[arg-type]
    return {tool.name: tool for tool in anyio.run(server.list_tools)}


def test_a_server_with_no_settings_offers_the_seed_s_six() -> None:
    assert set(SEED) <= set(listed(Settings().tools))
    assert Settings().tools == list(DEFAULT_GROUPS)


@pytest.mark.parametrize("entries", SETTINGS, ids=",".join)
def test_every_setting_that_offers_a_seed_tool_keeps_its_name_and_arguments(entries: list[str]) -> None:
    tools = listed(entries)
    for name in set(SEED) & set(GROUPS.selected(entries)):
        arguments, required = SEED[name]
        schema = tools[name].input_schema
        assert set(arguments) <= set(schema["properties"]), (entries, name, schema["properties"])
        # A call written against the seed's table is never refused for lacking an argument it did not have.
        assert set(schema.get("required", [])) <= set(required), (entries, name, schema.get("required"))
        assert set(required) <= set(schema.get("required", [])), (entries, name)
    for name in set(SEED) - set(tools):  # a seed tool left out is left out by the setting, never lost
        assert name not in GROUPS.selected(entries), (entries, name)


def test_every_seed_tool_is_in_a_group_a_setting_can_name() -> None:
    for name in SEED:
        assert set(GROUPS.of[name]) & set(GROUP_NAMES), name
        assert set(GROUPS.of[name]) & set(DEFAULT_GROUPS), name


@pytest.mark.parametrize(("tool", "model"), [("pdf_ops", PdfArgs), ("image_ops", ImageArgs)])
def test_args_is_a_closed_object_whose_every_property_is_declared(tool: str, model: type) -> None:
    args = listed([ALL])[tool].input_schema["properties"]["args"]
    assert args["type"] == "object" and list(args["properties"]) == list(model.model_fields)
    assert "additionalProperties" not in str(args)  # google-genai fails on the keyword; closure is ours:
    assert model.model_config["extra"] == "forbid"
    for name, field in args["properties"].items():
        assert field.get("type") not in ("object", ["object", "null"]), (tool, name)


async def call(entries: list[str], name: str, arguments: dict[str, Any] | None = None) -> tuple[bool, str]:
    host = types.SimpleNamespace(settings=Settings(tools=entries))
    server = build_server(host, host)  # type: ignore[arg-type]
    async with Client(server) as client:
        result = await client.call_tool(name, arguments or {})
    text = "\n".join(block.text for block in result.content if isinstance(block, TextContent))
    return result.is_error, text


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("entries", "name", "said"),
    [
        (list(DEFAULT_GROUPS), "use_browser", "use browser_navigate or browser_extract or browser_screenshot"),
        (list(DEFAULT_GROUPS), "document_ops", "use pdf_ops or image_ops"),
        (list(DEFAULT_GROUPS), "wait_job", "use manage_jobs"),
        (list(DEFAULT_GROUPS), "reset_kernel", "use kernel_reset"),
        (list(DEFAULT_GROUPS), "execute_python", "use run_python"),
        (list(DEFAULT_GROUPS), "pdf_op", "did you mean pdf_ops?"),
        (list(DEFAULT_GROUPS), "create_session", "tool group 'sessions', which the user can add"),
        (list(DEFAULT_GROUPS), "fork_session", "manage_snapshots does that job, but it is in the tool group 'snap"),
        (["python"], "pdf_ops", "pdf_ops is not offered by this server: it is in the tool group 'documents'"),
        (["python"], "frobnicate", "the tools are get_capabilities, install_packages, kernel_reset"),
    ],
)
async def test_an_unknown_tool_name_is_told_the_tool_to_use(entries: list[str], name: str, said: str) -> None:
    is_error, text = await call(entries, name)
    assert is_error and said in text, text
    assert "Unknown tool" not in text


@pytest.mark.anyio
async def test_a_name_no_one_could_mean_is_shown_bounded() -> None:
    is_error, text = await call(list(DEFAULT_GROUPS), "x" * 5000 + "\x1b[31m")
    assert is_error and len(text) < 1000 and "\x1b" not in text, text


def test_get_capabilities_says_which_groups_are_off_and_how_the_user_turns_one_on() -> None:
    offered = set(GROUPS.selected(DEFAULT_GROUPS))
    answer = tool_groups(GROUPS, offered)
    # A group is on when all its tools are offered (jobs' one tool comes with python).
    assert answer["on"] == [group for group in GROUP_NAMES if set(GROUPS.members(group)) <= offered]
    assert set(DEFAULT_GROUPS) <= set(answer["on"]) and "jobs" in answer["on"]
    assert set(answer["off"]) == {"sessions", "oneshot", "workspaces", "snapshots"}
    assert "serve --tools" in answer["to_turn_one_on"] and "config.toml" in answer["to_turn_one_on"]
    # What a group is for, not its tools: a reply names only tools that are offered (tool_mentions.py).
    assert not names_in(str(answer), GROUPS.all_tools)
    assert "off" not in tool_groups(GROUPS, set(GROUPS.all_tools))


# --- every text names a real tool --------------------------------------------------------------------

#: Names no text of ours may use: tools that were, or that other servers have (policy/tool_renames.py).
RETIRED = sorted((name for name in RENAMED if "_" in name), key=len, reverse=True)
#: A retired name as a word of text; `session_status.py` (a module) and `.list_jobs(` (a method) are code.
RETIRED_WORD = re.compile(r"(?<![\w/.])(" + "|".join(RETIRED) + r")(?!\w|\.py|\()")


#: Jobs that moved between tools: said with the old tool, they send a model to the wrong one.
RESET = r"(?<!\w)reset(?!_)"
MOVED_JOB = re.compile(rf"{RESET}[^.;|]{{0,40}}\bmanage_sessions\b|\bmanage_sessions\b[^.;|]{{0,20}}{RESET}")


def retired_in(text: str) -> list[str]:
    return RETIRED_WORD.findall(text) + [f"moved: {found}" for found in MOVED_JOB.findall(text)]


def string_constants(path: Path) -> list[str]:
    """The strings a module can say (constants and f-string parts), without docstrings and bare
    identifiers (method names passed to a call, for instance)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and not node.value.isidentifier()
    ]


def test_the_instructions_and_the_proxy_s_copy_name_only_tools_a_default_server_offers() -> None:
    default = set(GROUPS.selected(DEFAULT_GROUPS))
    assert names_in(INSTRUCTIONS, GROUPS.all_tools) <= default
    assert {"run_python", "kernel_reset", "pdf_ops", "image_ops", "browser_navigate"} <= names_in(INSTRUCTIONS, default)
    proxy = build_proxy(types.SimpleNamespace())  # type: ignore[arg-type]  # built only, never connected
    assert proxy.instructions == INSTRUCTIONS
    assert not retired_in(INSTRUCTIONS)


def test_no_setting_description_names_a_tool_that_is_not() -> None:
    for name, field in Settings.model_fields.items():
        assert not retired_in(field.description or ""), (name, field.description)


def test_no_string_the_server_or_the_guest_can_say_names_a_tool_that_is_not() -> None:
    """Doctor's checks, the %pip reply, error texts, setting help: every string constant in src/."""
    found = {}
    for path in sorted((REPO / "src" / "coderunner").rglob("*.py")):
        if path.name == "tool_renames.py":
            continue
        for text in string_constants(path):
            if retired_in(text):
                found[f"{path.relative_to(REPO)}: {text[:80]!r}"] = retired_in(text)
    assert not found, found


def test_no_page_a_user_reads_names_a_tool_that_is_not_or_counts_tests_by_hand() -> None:
    pages = [REPO / "README.md", REPO / "SKILL.md", *sorted((REPO / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        assert not retired_in(text), (page.name, retired_in(text))
        # A count of tests goes stale with the next test: pytest prints it.
        assert not re.search(r"\b\d[\d,]* (unit )?(tests|cases)\b", text), page.name


def test_docs_tools_md_has_a_row_for_every_tool_and_none_for_a_tool_that_is_not() -> None:
    rows = re.findall(r"^\| `(\w+)` \|", (REPO / "docs" / "tools.md").read_text(), flags=re.MULTILINE)
    assert set(rows) == set(GROUPS.all_tools), set(rows) ^ set(GROUPS.all_tools)
