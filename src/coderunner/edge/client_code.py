"""Code that connects agent libraries to CodeRunner, with the client-side settings that matter.

Each library has its own limits that a long cell or a failing one runs into, and none of them says
so: the TypeScript SDK gives up on a request after 60 s, openai-agents after 5 s, and pydantic-ai
ends a whole run when a tool fails twice (a traceback is an `isError` result). The snippets set
those, next to the command or URL of this install. Over HTTP they read the bearer token from
$CODERUNNER_TOKEN (the comment says which command prints it: this install's own, since
install.sh puts nothing on PATH), never from the snippet itself.
"""

from __future__ import annotations

import json
import shlex

LIBRARY_CLIENTS = ("typescript", "openai-agents", "pydantic-ai", "langchain")
LIBRARY_LOCATIONS = {
    "typescript": "your agent's code (an ES module; npm install @modelcontextprotocol/sdk)",
    "openai-agents": "your agent's code (Python; pip install openai-agents)",
    "pydantic-ai": "your agent's code (Python; pip install pydantic-ai)",
    "langchain": "your agent's code (Python; pip install langchain-mcp-adapters)",
}
#: Client-side bound on one call: above the server's default detach_after_s (40 s), when a long run answers.
CALL_TIMEOUT_S = 60
#: Name a stateless HTTP client gives itself, so its calls share one default session (see callers.py).
CLIENT_NAME = "my-agent"


def _py(value: object) -> str:
    """A Python literal (JSON strings and lists are valid Python)."""
    return json.dumps(value)


def _python(imports: list[str], url: str | None, body: str, token_command: str) -> str:
    """A Python snippet: its imports, over HTTP the headers (token from the environment), then `body`."""
    head = "\n".join(["import os", "", *imports] if url else imports) + "\n\n"
    if url:
        head += (
            f'# export CODERUNNER_TOKEN="$({token_command})"; the client name gives this agent its own default '
            "session.\n"
            "headers = {\n"
            '    "Authorization": f"Bearer {os.environ[\'CODERUNNER_TOKEN\']}",\n'
            f'    "X-CodeRunner-Client": {_py(CLIENT_NAME)},\n'
            "}\n"
        )
    return head + body


def typescript(command: str, args: list[str], url: str | None) -> str:
    if url:
        connect = (
            'import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";\n\n'
            'const client = new Client({ name: "my-agent", version: "1.0.0" });\n'
            f"await client.connect(new StreamableHTTPClientTransport(new URL({_py(url)}), {{\n"
            "  requestInit: { headers: { Authorization: `Bearer ${process.env.CODERUNNER_TOKEN}` } },\n"
            "}));\n"
        )
    else:
        connect = (
            'import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";\n\n'
            'const client = new Client({ name: "my-agent", version: "1.0.0" });\n'
            f"await client.connect(new StdioClientTransport({{ command: {_py(command)}, args: {_py(args)} }}));\n"
        )
    return (
        'import { Client } from "@modelcontextprotocol/sdk/client/index.js";\n'
        + connect
        + "\n// The SDK gives up on a request after 60 s; a cell still running at 40 s answers first with a job id\n"
        "// (manage_jobs reads the rest). To wait longer in one call, let progress notifications keep it alive:\n"
        "const result = await client.callTool(\n"
        '  { name: "run_python", arguments: { code: "6 * 7", detach_after_s: 600 } },\n'
        "  undefined,\n"
        "  { onprogress: () => {}, resetTimeoutOnProgress: true, maxTotalTimeout: 660_000 },\n"
        ");\n"
        "console.log(result.content[0].text);\n"
        "await client.close();"
    )


def openai_agents(command: str, args: list[str], url: str | None) -> str:
    if url:
        kind, params = "MCPServerStreamableHttp", f'{{"url": {_py(url)}, "headers": headers, "sse_read_timeout": 3600}}'
    else:
        kind, params = "MCPServerStdio", f'{{"command": {_py(command)}, "args": {_py(args)}}}'
    body = (
        f"coderunner = {kind}(\n"
        f"    params={params},\n"
        "    # The default is 5 s: a longer call fails here. Keep it above detach_after_s (40 s).\n"
        f"    client_session_timeout_seconds={CALL_TIMEOUT_S},\n"
        "    cache_tools_list=True,\n"
        ")\n"
        "# async with coderunner:\n"
        '#     agent = Agent(name="analyst", mcp_servers=[coderunner])'
    )
    return _python([f"from agents.mcp import {kind}"], url, body, _token_command(command, args))


def pydantic_ai(command: str, args: list[str], url: str | None) -> str:
    if url:
        kind, where = "MCPServerStreamableHTTP", f"    {_py(url)},\n    headers=headers,\n"
    else:
        kind, where = "MCPServerStdio", f"    {_py(command)},\n    args={_py(args)},\n    timeout=30,\n"
    body = (
        f"coderunner = {kind}(\n"
        + where
        + "    # A traceback is an isError result, which pydantic-ai retries; the default (1) ends the whole\n"
        "    # run at the second failing cell. Let the model fix its code a few times:\n"
        "    max_retries=5,\n"
        "    read_timeout=3600,\n"
        ")\n"
        "# agent = Agent(model, toolsets=[coderunner])"
    )
    return _python([f"from pydantic_ai.mcp import {kind}"], url, body, _token_command(command, args))


def langchain(command: str, args: list[str], url: str | None) -> str:
    if url:
        connection = f'{{"transport": "streamable_http", "url": {_py(url)}, "headers": headers}}'
    else:
        connection = f'{{"transport": "stdio", "command": {_py(command)}, "args": {_py(args)}}}'
    body = (
        f'client = MultiServerMCPClient({{\n    "coderunner": {connection},\n}})\n'
        "# client.get_tools() opens a new MCP session for every call, so variables would not carry\n"
        "# over; keep one session for the conversation. Big outputs come back as resource links, which\n"
        '# langchain turns into file URLs some model APIs refuse: set file_links = "text" on the server.\n'
        'async with client.session("coderunner") as session:\n'
        "    tools = await load_mcp_tools(session)"
    )
    imports = [
        "from langchain_mcp_adapters.client import MultiServerMCPClient",
        "from langchain_mcp_adapters.tools import load_mcp_tools",
    ]
    return _python(imports, url, body, _token_command(command, args))


def _token_command(command: str, args: list[str]) -> str:
    """This install's `coderunner token`: the launch command with `token` for `serve`."""
    return shlex.join([command, *(arg for arg in args if arg != "serve"), "token"])


WRITERS = {"typescript": typescript, "openai-agents": openai_agents, "pydantic-ai": pydantic_ai, "langchain": langchain}


def library_snippet(client: str, command: str, args: list[str], url: str | None) -> str:
    """The code for `client`: over stdio it launches `command args`, with `url` it speaks HTTP to it."""
    return WRITERS[client](command, args, url)
