"""The README and docs/ say only what the code has: commands, settings, tools, links (no sandbox).

A command printed in the docs must work as printed, so every `coderunner ...` line of a shell block
(and every inline `coderunner ...` span) is parsed by the CLI's own parser, without running it. The
settings table of docs/configuration.md names exactly Settings' fields, with their numeric defaults;
a backticked name that looks like a tool is one; the tool tables list every tool, in its group; and
CI's commands are the README's own. Names are read from the code, so a renamed tool, flag or
setting fails here until the docs follow.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import types
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from mcp.server.mcpserver import MCPServer

from coderunner.cli import COMMANDS, _parser
from coderunner.config import Settings
from coderunner.tools import ToolContext, declared_groups, register

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
SHELL_LANGUAGES = {"sh", "bash", "shell", "console"}
FENCE = re.compile(r"^\s*```\s*([\w-]*)\s*$")
SUBSTITUTION = re.compile(r"\$\(([^()]*)\)")
INLINE_CODE = re.compile(r"`([^`]+)`")
#: Words a shell ends a command at, as shlex splits them with punctuation_chars.
OPERATORS = {"|", "||", "&&", ";", "&", "(", ")", ">", ">>", "<", "2>", "|&"}
#: The first word of a tool's name, now and before the tools were folded into fewer (issue 28):
#: a backticked snake_case name that starts with one of these is taken for a tool.
TOOL_VERBS = {
    "run", "kernel", "wait", "cancel", "list", "create", "close", "session", "snapshot", "restore", "fork",
    "delete", "read", "write", "upload", "download", "browser", "pdf", "image", "execute", "validate",
    "install", "get", "job", "jobs", "workspace", "workspaces", "snapshots", "sessions",
}  # fmt: skip
#: Names in the docs that look like tools and are not: Jupyter's own (docs/performance.md).
NOT_TOOLS = {"kernel_info", "wait_for_ready", "wait_for"}  # wait_for: a browser_interact action
#: Environment variables the docs name that are no setting: read by install.sh, the tests or a backend.
ENV_SOURCES = [REPO / "install.sh", *sorted((REPO / "src").rglob("*.py")), REPO / "tests" / "conftest.py"]


@dataclass(frozen=True)
class Command:
    """One `coderunner` invocation in the docs: where, and its arguments after the executable."""

    where: str
    argv: list[str]
    complete: bool  # from a shell block (every required argument given), not an inline mention


def _fenced(path: Path) -> tuple[list[tuple[int, str]], str]:
    """The lines of shell blocks (continuations joined) and the page's text outside every block."""
    shell: list[tuple[int, str]] = []
    prose: list[str] = []
    language: str | None = None
    pending = ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            language = None if language is not None else fence.group(1).lower()
            continue
        if language is None:
            prose.append(line)
        elif language in SHELL_LANGUAGES:
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            shell.append((number, pending + line))
            pending = ""
    return shell, "\n".join(prose)


def _segments(line: str) -> list[list[str]]:
    """The simple commands of a shell line (comments dropped), those in `$(...)` included."""
    found: list[list[str]] = []
    for inner in SUBSTITUTION.findall(line):
        found += _segments(inner)
    lexer = shlex.shlex(SUBSTITUTION.sub("SUBST", line), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    segment: list[str] = []
    for word in [*lexer, ";"]:
        if word not in OPERATORS:
            segment.append(word)
        elif segment:
            found.append(segment)
            segment = []
    return found


def _invocations(line: str) -> list[list[str]]:
    """The argument lists of every coderunner the line runs."""
    found: list[list[str]] = []
    for segment in _segments(line):
        for index, part in enumerate(segment):
            # The executable: a path ending in /coderunner, or the bare name where a command starts
            # (`claude mcp add coderunner -- ...` names the server, it runs nothing).
            if part.endswith("/coderunner") or (part == "coderunner" and index == 0):
                found.append(segment[index + 1 :])
                break
    return found


def _commands() -> list[Command]:
    commands: list[Command] = []
    for path in PAGES:
        shell, prose = _fenced(path)
        name = path.relative_to(REPO)
        for number, line in shell:
            commands += [Command(f"{name}:{number}", argv, True) for argv in _invocations(line)]
        for span in INLINE_CODE.findall(prose):
            text = " ".join(span.split())
            if re.search(r"(^|/)coderunner\b(?![-_.])", text):
                # A bare `coderunner` names the program; with words after it, it is a command.
                commands += [Command(f"{name}: `{text}`", argv, False) for argv in _invocations(text) if argv]
    return commands


COMMANDS_IN_DOCS = _commands()


def _parse(argv: list[str]) -> tuple[int | None, str]:
    """(exit code or None when it parsed, what argparse said), running nothing."""
    said = io.StringIO()
    with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
        try:
            parsed = _parser().parse_args(argv)
        except SystemExit as exc:
            return (exc.code if isinstance(exc.code, int) else 2), said.getvalue()
    if parsed.command not in COMMANDS:
        return 2, f"no command {parsed.command!r} in cli.COMMANDS"
    return None, ""


#: Issue 28: the README is the first screen and a map; the depth lives in docs/.
README_MAX_LINES = 250


def test_the_readme_gets_a_user_to_an_answer_on_its_first_screen() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move the depth to docs/"
    first_block = [line for number, line in _fenced(README)[0] if number <= 30]
    steps = ["./install.sh", ".venv/bin/coderunner doctor", ".venv/bin/coderunner config"]
    assert all(any(line.startswith(step) for line in first_block) for step in steps), first_block


def test_the_docs_print_the_commands_a_user_needs() -> None:
    """Not vacuous: the quick start's commands are found, in the README's own shell blocks."""
    in_readme = {command.argv[0] for command in COMMANDS_IN_DOCS if command.where.startswith("README.md:")}
    assert {"doctor", "config", "serve", "token", "run"} <= in_readme, in_readme
    assert len(COMMANDS_IN_DOCS) >= 40, len(COMMANDS_IN_DOCS)


@pytest.mark.parametrize("command", COMMANDS_IN_DOCS, ids=lambda command: command.where)
def test_every_coderunner_command_in_the_docs_parses(command: Command) -> None:
    code, said = _parse(command.argv)
    if code == 0 and "--help" in command.argv:
        return
    if code is not None and not command.complete and "the following arguments are required" in said:
        return  # an inline mention (`coderunner proxy`): its flags and choices were still checked
    assert code is None, f"{command.where}: coderunner {shlex.join(command.argv)}\n{said}"


def test_shell_blocks_run_the_installed_coderunner() -> None:
    """install.sh puts coderunner in .venv/bin, not on PATH: a bare `coderunner` in a block fails as printed."""
    bare = [
        f"{path.relative_to(REPO)}:{number}"
        for path in PAGES
        for number, line in _fenced(path)[0]
        for segment in _segments(line)
        if segment[0] == "coderunner"
    ]
    assert not bare, f"write .venv/bin/coderunner: {bare}"


def test_a_command_that_does_not_exist_fails_here() -> None:
    """The parser this test leans on refuses what the CLI lacks: a subcommand, a flag, a choice."""
    for argv in (
        ["serv"],
        ["serve", "--no-such-flag"],
        ["config", "no-such-client"],
        ["serve", "--max-network", "MODE"],
    ):
        assert _parse(argv)[0] == 2, argv


def _settings_rows() -> list[tuple[list[str], str]]:
    """docs/configuration.md's settings table: (the names in a row's first cell, its default cell)."""
    rows: list[tuple[list[str], str]] = []
    in_table = False
    for line in (REPO / "docs" / "configuration.md").read_text().splitlines():
        if line.startswith("| setting |"):
            in_table = True
            continue
        if in_table and not line.startswith("|"):
            break
        if in_table and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows.append((re.findall(r"`([a-z_0-9]+)`", cells[0]), cells[1]))
    return rows


def _default(name: str) -> object:
    return Settings.model_fields[name].get_default(call_default_factory=True)


def test_the_settings_table_names_every_setting_and_no_other() -> None:
    rows = _settings_rows()
    named = [name for names, _ in rows for name in names]
    assert len(named) == len(set(named)), "a setting is listed twice"
    assert set(named) - set(Settings.model_fields) == set(), "listed, but no such setting in config.py"
    assert set(Settings.model_fields) - set(named) == set(), "settings missing from docs/configuration.md"


def test_the_settings_tables_numbers_are_the_defaults() -> None:
    checked = 0
    for names, cell in _settings_rows():
        values = [value.strip() for value in cell.split(",")]
        if len(values) != len(names):  # one value per name, or prose
            values = [cell] if len(names) == 1 else []
        for name, value in zip(names, values, strict=False):
            default = _default(name)
            if re.fullmatch(r"\d+(\.\d+)?", value):
                assert float(value) == default, f"{name}: the table says {value}, config.py {default}"
                checked += 1
            elif value in ("true", "false"):
                assert (value == "true") == default, f"{name}: the table says {value}, config.py {default}"
                checked += 1
    assert checked >= 30, checked


def _tool_arguments() -> set[str]:
    """Every argument name of every tool, from the schemas tools/list would send."""

    async def listed() -> set[str]:
        server = MCPServer("docs")
        host = types.SimpleNamespace(settings=Settings.model_construct())
        tools = ToolContext.create(server, host, host)
        register(tools)
        return {name for tool in await server.list_tools() for name in tool.input_schema.get("properties", {})}

    return anyio.run(listed)


def test_every_tool_named_in_the_docs_exists() -> None:
    tools = declared_groups().all_tools
    not_tools = set(Settings.model_fields) | _tool_arguments() | NOT_TOOLS
    verbs = TOOL_VERBS | {tool.split("_")[0] for tool in tools}
    unknown: list[str] = []
    seen: set[str] = set()
    for path in PAGES:
        for span in INLINE_CODE.findall(_fenced(path)[1]):
            name = re.fullmatch(r"([a-z]+(?:_[a-z]+)+)(\(.*\))?", span.strip(), re.DOTALL)
            if name is None or name.group(1).split("_")[0] not in verbs:
                continue
            seen.add(name.group(1))
            if name.group(1) not in tools and name.group(1) not in not_tools:
                unknown.append(f"{path.relative_to(REPO)}: {name.group(1)}")
    assert seen & tools == tools, sorted(tools - seen)  # the check reads the tool names the docs use
    assert not unknown, f"not tools (coderunner.tools.declared_groups() has {sorted(tools)}): {sorted(set(unknown))}"


def _tool_table(path: Path, header: str, tool_column: int, group_column: int) -> dict[str, set[str]]:
    """tool -> the groups the page's table under `header` lists it in (a tool may be in several)."""
    listed: dict[str, set[str]] = {}
    lines = path.read_text().splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(header))
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        groups = {group.strip("() ") for group in cells[group_column].split(",")}
        groups = {"always" if group.startswith("always") else group for group in groups}
        for tool in re.findall(r"`([a-z_]+)`", cells[tool_column]):
            listed.setdefault(tool, set()).update(groups)
    return listed


@pytest.mark.parametrize(
    ("page", "header", "tool_column", "group_column"),
    [("README.md", "| group | tools |", 1, 0), ("docs/tools.md", "| tool | group |", 0, 1)],
)
def test_the_tool_tables_list_every_tool_in_its_group(
    page: str, header: str, tool_column: int, group_column: int
) -> None:
    declared = declared_groups().of
    listed = _tool_table(REPO / page, header, tool_column, group_column)
    assert set(listed) - set(declared) == set(), f"{page} lists tools that do not exist"
    assert set(declared) - set(listed) == set(), f"{page} leaves out tools"
    wrong = {tool: (groups, declared[tool]) for tool, groups in listed.items() if groups != set(declared[tool])}
    assert not wrong, f"{page}: tool: (group in the table, declared group): {wrong}"


def test_ci_runs_the_readmes_own_commands() -> None:
    """.ci/run runs exactly the README's set-up and test commands, each printed as a line of its own."""
    ci = [
        line.strip()
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "set ", "cd "))
    ]
    shell, _ = _fenced(README)
    printed = {line.split("#", 1)[0].strip() for _, line in shell}
    assert ci == ["./install.sh", ".venv/bin/pytest"], ci
    assert set(ci) <= printed, f"the README no longer prints {set(ci) - printed} as a command"


def test_environment_variables_named_in_the_docs_exist() -> None:
    sources = "\n".join(path.read_text() for path in ENV_SOURCES)
    unknown = {
        variable
        for path in PAGES
        for variable in re.findall(r"CODERUNNER_[A-Z0-9_]*[A-Z0-9]", path.read_text())
        if variable.removeprefix("CODERUNNER_").lower() not in Settings.model_fields and variable not in sources
    }
    assert not unknown, f"neither a setting nor read anywhere: {sorted(unknown)}"


def test_links_between_the_pages_resolve() -> None:
    broken = [
        f"{path.relative_to(REPO)}: {target}"
        for path in PAGES
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
        if "://" not in target and not (path.parent / target).exists()
    ]
    assert not broken, broken
