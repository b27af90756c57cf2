"""The MCP tools, one module per concern; server.build_server registers them through one ToolContext.

    context.py     ToolContext (session host, settings, caller lookup, session by id); `tool` and `resource`,
                   the decorators that declare a module-level function `async def name(tools, ...)`
    arguments.py   argument types shared by several tools
    python.py      run_python, kernel_reset
    sessions.py    create_session, manage_sessions (status, close, list)
    files.py       read_file (a file or a folder), write_file, transfer_file; the sandbox:// resource
    documents.py   pdf_ops, image_ops (work done inside the sandbox)
    browser.py     browser_navigate, browser_extract, browser_screenshot, browser_interact (inside too)
    execute_code.py      execute_code (one-shot runs; check_only: a syntax check)
    jobs.py        manage_jobs (wait, cancel, list: runs that outlived their call)
    install_packages.py  install_packages
    named_workspaces.py  manage_workspaces (list, delete)
    snapshots.py   manage_snapshots (save, restore, fork, list, delete)
    meta.py        get_capabilities
    egress.py      network 'allowlist' during a call: the user asked about a host, denials named in the reply

MCP shaping lives beside them: schemas.py (portable input schemas), replies.py (results as content),
file_results.py (a file as content), capabilities.py (get_capabilities' answer).

A tool parses its arguments, calls a session or the session host (sessions/seam.py, the only way in),
and shapes the reply; the work is elsewhere.
MODULES is in the order tools/list shows the tools. Each tool is a module-level function whose first
argument is the ToolContext (`@tool(group=...)` declares it, `register` adds it bound to a context), so
its body can be read, imported and called by name. Each declares its group(s) (`--tools`) where it is
defined; declared_groups() is that table, for checking a setting before any server is built.
Operations that share their arguments are one tool with an `action` (or `op`): tools/list goes to the
model on every turn, and its budget is held by tests/test_tool_schemas.py.
"""

import functools
import types

from mcp.server.mcpserver import MCPServer

from coderunner.config import Settings
from coderunner.policy.tool_groups import ToolGroups
from coderunner.tools import (
    browser,
    documents,
    execute_code,
    files,
    install_packages,
    jobs,
    meta,
    named_workspaces,
    python,
    sessions,
    snapshots,
)
from coderunner.tools.context import ToolContext, declared_in

MODULES = (
    python, jobs, sessions, snapshots, files, browser, documents, execute_code, install_packages,
    named_workspaces, meta,
)  # fmt: skip


@functools.cache
def declared_groups() -> ToolGroups:
    """The group each tool declares, read by registering every tool once on a bare server.

    The settings are the defaults, unvalidated (model_construct): the settings' own check of a `tools`
    entry asks for this table, so building it must not read or check the settings again.
    """
    host = types.SimpleNamespace(settings=Settings.model_construct())  # registration reads only settings
    tools = ToolContext.create(MCPServer("declarations"), host, host)  # nor one-shot runs
    register(tools)
    return ToolGroups(tools.groups)


def register(tools: ToolContext) -> None:
    """Every tool and resource the modules declare, on `tools`' server, in MODULES' order."""
    for module in MODULES:
        for function in declared_in(module):
            tools.add(function)


__all__ = ["MODULES", "ToolContext", "declared_groups", "register"]
