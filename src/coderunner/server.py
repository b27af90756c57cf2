"""The MCP server: its instructions, its resource typing, and build_server, which registers the tools.

The tools themselves live in tools/, one module per concern; they parse arguments and shape results.
"""

# No `from __future__ import annotations`: the SDK reads signatures at runtime.

import posixpath
from collections.abc import Iterable
from typing import Any

from mcp.server.lowlevel.helper_types import ReadResourceContents
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult, InputRequiredResult, TextContent
from pydantic import AnyUrl

from coderunner import __version__
from coderunner.config import ConfigError, Settings
from coderunner.edge.instructions import INSTRUCTIONS
from coderunner.offload import off_loop
from coderunner.oneshot.host import OneShotHost
from coderunner.policy.tool_groups import ToolGroups, ToolsetError
from coderunner.policy.tool_mentions import Mentions
from coderunner.policy.tool_renames import unknown_tool
from coderunner.sessions.seam import SessionHost
from coderunner.tools import ToolContext, declared_groups, register
from coderunner.tools.file_results import resource_contents
from coderunner.tools.schemas import finish_tools

#: URIs of files in a session (see the sandbox-file resource template in tools/files.py).
SANDBOX_SCHEME = "sandbox://"


class CodeRunnerServer(MCPServer):
    """MCPServer whose sandbox:// reads carry the file's own MIME type, and text as text.

    A resource template declares one MIME type for all its reads; a workspace holds PNGs, CSVs and
    anything else, so the type of each read is decided here from the bytes read (never parsed).
    """

    #: The tools offered and their groups (set by build_server): an unknown name is told what to use.
    mentions: Mentions | None = None

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None
    ) -> CallToolResult | InputRequiredResult:
        """A call of a tool this server does not offer gets an isError reply naming the tool to use instead
        (policy/tool_renames.py), not the SDK's bare "Unknown tool"."""
        if self.mentions is not None and self._tool_manager.get_tool(name) is None:
            said = unknown_tool(name, self.mentions)
            return CallToolResult(content=[TextContent(type="text", text=said)], is_error=True)
        return await super().call_tool(name, arguments, context)

    async def read_resource(
        self, uri: AnyUrl | str, context: Context | None = None
    ) -> Iterable[ReadResourceContents] | InputRequiredResult:
        results = await super().read_resource(uri, context)
        if not str(uri).startswith(SANDBOX_SCHEME) or isinstance(results, InputRequiredResult):
            return results
        typed: list[ReadResourceContents] = []
        for item in results:
            data = item.content.encode() if isinstance(item.content, str) else item.content
            content, mime = await off_loop(resource_contents, posixpath.basename(str(uri)), data)  # up to 16 MiB
            typed.append(ReadResourceContents(content=content, mime_type=mime, meta=item.meta))
        return typed


def offered_tools(settings: Settings) -> frozenset[str]:
    """The tools the `tools` setting offers. A single tool's name in it is checked here, against the tools'
    own declarations: the settings load before any tool exists, and check only the group names."""
    try:
        return declared_groups().selected(settings.tools)
    except ToolsetError as exc:
        raise ConfigError(f"tools: {exc}") from None


def build_server(host: SessionHost, oneshots: OneShotHost) -> MCPServer:
    """The server with every tool registered, then trimmed to the `tools` setting and made portable.

    `host` is where sessions live (sessions/seam.py): a local SessionManager or a cluster's front door;
    `oneshots` where one-shot runs go (oneshot/host.py): a LocalOneShots on that manager, or the front door.
    """
    declared = declared_groups()
    offered = offered_tools(host.settings)
    mentions = Mentions(offered, declared)  # replies and instructions name only these (policy/tool_mentions.py)
    server = CodeRunnerServer("coderunner", version=__version__, instructions=mentions.text(INSTRUCTIONS))
    server.mentions = mentions
    tools = ToolContext.create(server, host, oneshots)
    tools.mentions = mentions
    register(tools)
    finish_tools(server, offered, ToolGroups(tools.groups))  # as these tools declared them
    return server
