"""The error tree: one root for what the caller is told, drawn where a reader looks, caught in one place."""

from __future__ import annotations

import importlib
import pkgutil
import types

import anyio
import pytest
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import UnexpectedToolError
from mcp.types import CallToolResult

import coderunner
from coderunner import errors
from coderunner.config import Settings
from coderunner.errors import CodeRunnerError
from coderunner.hostfs.sandbox_files import FileAccessError
from coderunner.sandbox.base import SandboxUnavailable, start_failures
from coderunner.sandbox.cgroups import CgroupsUnavailable
from coderunner.sandbox.engine import EngineError
from coderunner.tools import ToolContext
from coderunner.tools.context import tool

#: Host modules only (the guest package runs inside the sandbox and imports its own stack).
HOST_MODULES = [
    name
    for _, name, _ in pkgutil.walk_packages(coderunner.__path__, "coderunner.")
    if not name.startswith("coderunner.guest")
]


def _all_subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= _all_subclasses(sub)
    return found


def test_every_caller_facing_error_is_drawn_in_the_tree() -> None:
    for name in HOST_MODULES:
        importlib.import_module(name)
    subclasses = {cls.__name__ for cls in _all_subclasses(CodeRunnerError)}
    assert {"SessionError", "SandboxUnavailable", "MountError", "ConfigError", "FileAccessError"} <= subclasses
    missing = sorted(name for name in subclasses if name not in (errors.__doc__ or ""))
    assert not missing, f"draw these in errors.py's tree: {missing}"


def test_errors_the_tools_and_cli_used_to_list_derive_from_the_root() -> None:
    from coderunner import config
    from coderunner.edge import auth, client_tokens
    from coderunner.hostfs import workspaces as workspace
    from coderunner.kernel import incarnation as kernel
    from coderunner.oneshot import runs as oneshot
    from coderunner.policy import call_variables as variables
    from coderunner.policy import mounts
    from coderunner.policy import requirements as packages
    from coderunner.sandbox import env as sandbox_env

    for cls in (auth.AuthError, client_tokens.ClientTokenError, config.ConfigError, kernel.KernelStartError,
                mounts.MountError, oneshot.OneShotError, packages.PackagesError, sandbox_env.SetupError,
                variables.VariablesError, workspace.WorkspaceError, SandboxUnavailable, FileAccessError,
                errors.SessionError, errors.SessionBusy, errors.GuestCallError):  # fmt: skip
        assert issubclass(cls, CodeRunnerError), cls
    assert issubclass(mounts.MountError, ValueError)  # pydantic reports it as a settings error only as such
    from coderunner.sessions import SessionError

    assert SessionError is errors.SessionError  # still importable from where callers found it


@pytest.mark.parametrize(
    ("raised", "told"),
    [
        (FileNotFoundError(2, "No such file or directory", "bwrap"), "No such file or directory"),
        (EngineError("`podman run` failed (exit 125): boom"), "podman run"),
        (CgroupsUnavailable("no usable cgroup hierarchy"), "no usable cgroup hierarchy"),
        (TimeoutError(), "TimeoutError"),
    ],
)
def test_the_backend_seam_translates_errors_from_below(raised: Exception, told: str) -> None:
    with (
        pytest.raises(SandboxUnavailable, match="could not start the bwrap sandbox") as caught,
        start_failures("bwrap"),
    ):
        raise raised
    assert told in str(caught.value)
    assert caught.value.__cause__ is raised  # kept for the server's log


def test_the_backend_seam_lets_its_own_errors_and_bugs_through() -> None:
    own = SandboxUnavailable("slirp4netns is missing: install it")
    with pytest.raises(SandboxUnavailable) as caught, start_failures("bwrap"):
        raise own
    assert caught.value is own
    with pytest.raises(KeyError), start_failures("bwrap"):
        raise KeyError("a bug stays a bug")


def _tool_server() -> MCPServer:
    server = MCPServer("test")
    host = types.SimpleNamespace(settings=Settings())
    tools = ToolContext.create(server, host, host)  # type: ignore[arg-type]

    @tool(group="files")
    async def refuses(tools: ToolContext, path: str) -> CallToolResult:
        """Refuses every path."""
        raise FileAccessError(f"{path}: outside what the sandbox shares")

    @tool(group="python")
    async def crashes(tools: ToolContext) -> CallToolResult:
        """Has a bug."""
        raise RuntimeError("internal detail")

    tools.add(refuses)
    tools.add(crashes)
    return server


def test_the_tool_decorator_turns_the_root_into_an_error_result_and_nothing_else() -> None:
    server = _tool_server()

    async def main() -> None:
        listed = {tool.name: tool for tool in await server.list_tools()}
        assert listed["refuses"].description == "Refuses every path."
        assert list(listed["refuses"].input_schema["properties"]) == ["path"]
        result = await server.call_tool("refuses", {"path": "/etc/passwd"})
        assert isinstance(result, CallToolResult) and result.is_error
        assert result.content[0].text == "/etc/passwd: outside what the sandbox shares"
        with pytest.raises(UnexpectedToolError) as caught:  # a bug: the SDK's, its text kept from the model
            await server.call_tool("crashes", {})
        assert "internal detail" not in str(caught.value)

    anyio.run(main)
