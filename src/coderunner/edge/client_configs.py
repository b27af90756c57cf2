"""Snippets that add CodeRunner to MCP clients, with this install's absolute paths.

Each client launches a command over stdio: `coderunner serve` (a server of its own) or, with
`--url`, `coderunner proxy URL --client APP` (one long-running HTTP server shared by several clients).
Agent libraries (client_code.py) get code instead, speaking HTTP themselves with `--url`.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from coderunner.edge.client_code import LIBRARY_CLIENTS, LIBRARY_LOCATIONS, library_snippet

SERVER_NAME = "coderunner"
#: The Cline extension's id in VS Code: its settings live in globalStorage under this name.
CLINE_EXTENSION = "saoudrizwan.claude-dev"
#: Applications configured with a file (or a command); they launch CodeRunner over stdio.
APP_CLIENTS = ("claude-code", "claude-desktop", "cursor", "windsurf", "zed", "continue", "cline")
CLIENTS = APP_CLIENTS + LIBRARY_CLIENTS


def cline_settings_path(platform: str = sys.platform) -> str:
    """Where the Cline extension of VS Code (saoudrizwan.claude-dev) keeps its MCP servers, on this OS."""
    user = {
        "darwin": "~/Library/Application Support/Code/User",
        "win32": "%APPDATA%\\Code\\User",
    }.get(platform, "~/.config/Code/User")
    sep = "\\" if platform == "win32" else "/"
    return sep.join([user, "globalStorage", CLINE_EXTENSION, "settings", "cline_mcp_settings.json"])


#: Where each client keeps the file the snippet goes into (the user's, not the project's).
CONFIG_LOCATIONS = {
    "claude-code": "run the command in a shell",
    "claude-desktop": "claude_desktop_config.json (Settings > Developer > Edit Config)",
    "cursor": "~/.cursor/mcp.json (or .cursor/mcp.json in a project)",
    "windsurf": "~/.codeium/windsurf/mcp_config.json",
    "zed": "Zed settings.json (merge into the top-level object)",
    "continue": "~/.continue/config.yaml (merge the mcpServers list)",
    "cline": "Cline's cline_mcp_settings.json (in Cline: MCP Servers > Configure > Configure MCP Servers; "
    f"on disk: {cline_settings_path()}), merged into its mcpServers",
    **LIBRARY_LOCATIONS,
}


@dataclass(frozen=True)
class LaunchCommand:
    """What a client runs to reach CodeRunner over stdio."""

    command: str
    args: tuple[str, ...]

    @classmethod
    def for_install(cls, url: str | None = None, client: str = SERVER_NAME) -> LaunchCommand:
        """This install's `coderunner`, serving on its own or proxying to `url` as `client`."""
        script = Path(sys.executable).parent / "coderunner"
        base = (str(script),) if script.exists() else (sys.executable, "-m", "coderunner.cli")
        args = proxy_args(url, client) if url else ("serve",)
        return cls(base[0], (*base[1:], *args))


def proxy_args(url: str, client: str) -> tuple[str, ...]:
    """`proxy URL --client NAME`: one stable name per app, so its export folder and named workspaces
    are found again after a restart (without it, each proxy process is a new client)."""
    return ("proxy", url, "--client", client)


def snippet(client: str, launch: LaunchCommand, url: str | None = None) -> str:
    """The text to paste into `client`'s configuration (or run, for Claude Code; or code, for a library)."""
    if client in LIBRARY_CLIENTS:
        serve = LaunchCommand.for_install() if url else launch
        return library_snippet(client, serve.command, list(serve.args), url)
    entry = {"command": launch.command, "args": list(launch.args)}
    if client == "claude-code":
        return shlex.join(["claude", "mcp", "add", SERVER_NAME, "--", launch.command, *launch.args])
    if client in ("claude-desktop", "cursor", "windsurf"):
        return json.dumps({"mcpServers": {SERVER_NAME: entry}}, indent=2)
    if client == "cline":
        # Cline's own keys: `disabled` (its switch in the MCP Servers panel) and `autoApprove` (tools
        # run without asking each time): none, so the user decides which in Cline.
        return json.dumps({"mcpServers": {SERVER_NAME: {**entry, "disabled": False, "autoApprove": []}}}, indent=2)
    if client == "zed":
        return json.dumps({"context_servers": {SERVER_NAME: {"source": "custom", **entry, "env": {}}}}, indent=2)
    if client == "continue":
        # YAML; JSON strings are valid YAML scalars, so paths with spaces stay intact.
        lines = ["mcpServers:", f"  - name: {SERVER_NAME}", f"    command: {json.dumps(launch.command)}", "    args:"]
        lines += [f"      - {json.dumps(arg)}" for arg in launch.args]
        return "\n".join(lines)
    raise ValueError(f"unknown client {client!r}: use one of {', '.join(CLIENTS)}")
