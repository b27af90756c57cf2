"""The least an MCP server around a Jupyter kernel can do: latency.py's "minimal MCP" anchor lane.

    python bench/minimal_mcp.py        (stdio; JUPYTER_PATH must name a kernelspec `bench-python`)

One tool, run_python(code), on one plain ipykernel (the same kernelspec as the raw lane, no
sandbox): send execute, gather stream and result text until the kernel is idle and has replied,
return the text. No sessions, no bounds, no progress, no files. CodeRunner's warm round trip is
measured against this to see what its own work costs on top of the SDK and the kernel.
"""

from __future__ import annotations

import subprocess

from jupyter_client.manager import AsyncKernelManager
from mcp.server.mcpserver import MCPServer

server = MCPServer("minimal")
_kernel: dict[str, object] = {}


async def _client():  # type: ignore[no-untyped-def]
    if "client" not in _kernel:
        manager = AsyncKernelManager(kernel_name="bench-python")
        await manager.start_kernel(stderr=subprocess.DEVNULL)
        client = manager.client()
        client.start_channels()
        await client.wait_for_ready(timeout=60)
        _kernel.update(manager=manager, client=client)
    return _kernel["client"]


@server.tool()
async def run_python(code: str) -> str:
    """Run Python in a Jupyter kernel; returns its text output."""
    client = await _client()
    msg_id = client.execute(code)
    parts: list[str] = []
    while True:
        msg = await client.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            parts.append(content["text"])
        elif kind in ("execute_result", "display_data"):
            parts.append(content["data"].get("text/plain", ""))
        elif kind == "error":
            parts.append("\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            break
    while (await client.get_shell_msg(timeout=30))["parent_header"].get("msg_id") != msg_id:
        pass
    return "".join(parts)


if __name__ == "__main__":
    server.run(transport="stdio")
