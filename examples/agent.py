"""A small agent loop on CodeRunner, with the official MCP Python client.

It stands in for the model: a fixed plan of steps, each one Python code sent to `run_python`,
whose text it prints and whose charts it saves. Swap the plan for your model's tool calls.

    python examples/agent.py                                  # launches `coderunner serve` over stdio
    python examples/agent.py --url http://127.0.0.1:8765/mcp  # a running HTTP server
                                                              # (token: $CODERUNNER_TOKEN or --token)
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

PLAN = [
    "import random\nrandom.seed(7)\nrolls = [random.randint(1, 6) + random.randint(1, 6) for _ in range(10_000)]\n"
    "len(rolls)",
    "from collections import Counter\ncounts = Counter(rolls)\nmost = counts.most_common(1)[0]\n"
    "print(f'most common total: {most[0]} ({most[1]} times)')",
    "import matplotlib.pyplot as plt\nplt.bar(sorted(counts), [counts[k] for k in sorted(counts)])\n"
    "plt.title('10,000 rolls of two dice')\nplt.show()",
]


#: Set when the server answers 401: the MCP client reports that only as "Server returned an error response".
UNAUTHORIZED: list[int] = []


async def note_refusal(response: httpx2.Response) -> None:
    if response.status_code == 401:
        UNAUTHORIZED.append(response.status_code)


@contextlib.asynccontextmanager
async def connect(url: str | None, token: str | None) -> AsyncIterator[Client]:
    if url is None:
        coderunner = Path(sys.executable).parent / "coderunner"
        command = (
            [str(coderunner), "serve"] if coderunner.exists() else [sys.executable, "-m", "coderunner.cli", "serve"]
        )
        # The server gets only what it needs: never this process's API keys.
        env = {key: os.environ[key] for key in ("PATH", "HOME") if key in os.environ}
        env.update({key: value for key, value in os.environ.items() if key.startswith("CODERUNNER_")})
        async with Client(StdioServerParameters(command=command[0], args=command[1:], env=env)) as client:
            yield client
        return
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    hooks = {"response": [note_refusal]}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=None), event_hooks=hooks) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        yield client


async def main(url: str | None, token: str | None, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    async with connect(url, token) as client:
        tools = [tool.name for tool in (await client.list_tools()).tools]
        print(f"tools: {', '.join(tools)}")
        for number, code in enumerate(PLAN, start=1):
            result = await client.call_tool("run_python", {"code": code})
            for block in result.content:
                if block.type == "text":
                    print(f"step {number}: {block.text}")
                elif block.type == "image":
                    path = out / f"step{number}.png"
                    path.write_bytes(base64.b64decode(block.data))
                    print(f"step {number}: chart saved to {path}")
            if result.is_error:
                return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server's MCP endpoint (default: launch one over stdio)")
    parser.add_argument("--token", default=os.environ.get("CODERUNNER_TOKEN"), help="its bearer token")
    parser.add_argument("--out", type=Path, default=Path("agent-output"), help="where charts are saved")
    arguments = parser.parse_args()
    try:
        sys.exit(anyio.run(main, arguments.url, arguments.token, arguments.out))
    except Exception:
        if not UNAUTHORIZED:
            raise
        given = "no token was given" if not arguments.token else "the token was refused"
        sys.exit(f"agent.py: {arguments.url} answered 401 Unauthorized: {given}; pass --token (or set "
                 "CODERUNNER_TOKEN) with the one `coderunner token` prints on the server's machine")  # fmt: skip
