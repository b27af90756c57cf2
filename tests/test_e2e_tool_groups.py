"""A narrower `tools` setting, through the official MCP client in real sandboxes: no reply names a tool
the server does not offer (policy/tool_mentions.py), so a model is never sent to a tool it cannot call.

A long run answers with a job id: under `--tools python` its reply names the job tool, which the
python group holds; under a single-tool setting it says which group the user can add instead.
"""

from __future__ import annotations

import json

import pytest
from mcp import Client

from coderunner.policy.tool_mentions import names_in
from coderunner.tools import declared_groups

from .conftest import ServerDirs, json_of, memory_client, run, server_env, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

ALL_TOOLS = declared_groups().all_tools
#: Runs long enough to outlast the 1 s detach the servers here are set to.
LONG = "import time\nprint('started', flush=True)\ntime.sleep(4)\nprint('finished')"


async def offered(client: Client) -> set[str]:
    return {tool.name for tool in (await client.list_tools()).tools}


def unoffered_named(text: str, tools: set[str]) -> set[str]:
    return names_in(text, ALL_TOOLS - tools)


async def test_under_the_python_group_a_long_run_names_only_tools_it_offers(dirs: ServerDirs) -> None:
    env = server_env(dirs, CODERUNNER_TOOLS="python", CODERUNNER_DETACH_AFTER_S="1", CODERUNNER_MAX_NETWORK="internet")
    async with memory_client(env) as client:
        tools = await offered(client)
        assert "manage_jobs" in tools and "create_session" not in tools
        detached = await run(client, LONG)
        job = (detached.meta or {})["coderunner/job"]
        assert job["status"] == "running" and "manage_jobs" in text_of(detached), text_of(detached)
        assert not unoffered_named(text_of(detached), tools), text_of(detached)
        replies = [detached]
        while (replies[-1].meta or {})["coderunner/job"]["status"] == "running":
            arguments = {"action": "wait", "job_id": job["job_id"], "timeout_s": 30}
            replies.append(await client.call_tool("manage_jobs", arguments))
        assert "finished" in text_of(replies[-1]), text_of(replies[-1])
        # pip wants network, which the default session lacks: the way out names no session tool.
        refused = await client.call_tool("install_packages", {"packages": ["six"]})
        assert refused.is_error and "needs network" in text_of(refused), text_of(refused)
        for reply in [*replies, refused]:
            assert not unoffered_named(text_of(reply), tools), text_of(reply)
        assert "the user can add 'sessions' to the tools setting" in text_of(refused), text_of(refused)
        capabilities = await client.call_tool("get_capabilities", {})
        assert not unoffered_named(json.dumps(json_of(capabilities)), tools)
        assert not unoffered_named(text_of(capabilities), tools)


async def test_a_single_tool_setting_says_which_group_would_wait_for_a_job(dirs: ServerDirs) -> None:
    env = server_env(dirs, CODERUNNER_TOOLS="run_python", CODERUNNER_DETACH_AFTER_S="1")
    async with memory_client(env) as client:
        tools = await offered(client)
        assert tools == {"run_python", "get_capabilities"}
        detached = await run(client, LONG)
        assert (detached.meta or {})["coderunner/job"]["status"] == "running", text_of(detached)
        assert not unoffered_named(text_of(detached), tools), text_of(detached)
        assert "the user can add 'python' or 'oneshot' or 'jobs' to the tools setting" in text_of(detached)
