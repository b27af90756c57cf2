"""run_python and kernel_reset, the seed's two kernel tools: a session's persistent kernel, and a fresh one.

kernel_reset is also how a stale browser goes: the browser context lives in the kernel, so a new kernel
is a new context. Files in the workspace are kept.
"""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

import time
from typing import Annotated, Any

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult
from pydantic import Field

from coderunner.config import Settings
from coderunner.policy.call_variables import check_variables, parse_variables
from coderunner.sessions.job_runner import Job, attend, duration
from coderunner.sessions.sandbox_options import check_timeout
from coderunner.tools.arguments import DetachAfter, SessionId, VariablesArg
from coderunner.tools.context import ToolContext, json_result, tool
from coderunner.tools.egress import offline_noted
from coderunner.tools.jobs import KERNEL_META, kernel_stamp, python_job_reply
from coderunner.tools.replies import execution_reply

#: run_python's timeout_s says the default the user set.
TimeoutArg = Annotated[float | None, Field(ge=1)]


def run_python_settings(settings: Settings) -> dict[str, tuple[Any, Any]]:
    """run_python's timeout_s names the user's default in its description."""
    described = Annotated[float | None, Field(ge=1, description=f"Default: the session's ({settings.timeout_s:g}).")]
    return {"timeout_s": (described, None)}


@tool(group="python", per_settings=run_python_settings)  # not closed-world: a session may have network internet
async def run_python(
    tools: ToolContext,
    code: str,
    ctx: Context,
    session_id: SessionId = "",
    timeout_s: TimeoutArg = None,
    variables: VariablesArg = "",
    detach_after_s: DetachAfter = None,
) -> CallToolResult:
    """Python in the session's persistent sandboxed Jupyter kernel; charts come back as images."""
    settings = tools.settings
    check_timeout(settings, timeout_s)
    values = check_variables(parse_variables(variables), "python")
    called = time.monotonic()
    session = await tools.session(ctx, session_id, total=timeout_s or settings.timeout_s)
    async with tools.egress_call(ctx, session) as network:
        job = await session.start_run(code, timeout_s, values)
        limit = timeout_s or session.options.timeout_s

        async def progress(job: Job) -> None:
            assert job.output is not None
            since_call = time.monotonic() - called  # progress only grows, whatever the note says
            began = job.executing_since
            if began is None:  # not running yet: say what it waits for, not that a cell runs
                await ctx.report_progress(since_call, limit, f"waiting for the kernel ({since_call:.0f} s)")
                return
            if time.monotonic() - began < settings.progress_interval_s:
                return
            elapsed = job.elapsed_s()
            text = f"running {duration(elapsed)}: {job.output.tail_text(200)}"
            await ctx.report_progress(since_call, limit, text)

        wait = settings.detach_after_s if detach_after_s is None else detach_after_s
        attended = await attend(job, wait, progress, settings.progress_interval_s)
    links = settings.file_links == "resource_link"
    if not attended:
        job.detached = True
        return network.noted(python_job_reply(session, job, links))
    session.forget_job(job)  # answered whole: never a job the caller needs to know about
    result = session.job_result(job)
    reply = execution_reply(result, session.session_id, links=links)
    reply = offline_noted(reply, session.options.network, settings.network_ceiling)
    return network.noted(tools.with_export_note(kernel_stamp(reply, session, result.state_lost), session))


@tool(group="python")
async def kernel_reset(tools: ToolContext, ctx: Context, session_id: SessionId = "") -> CallToolResult:
    """A fresh interpreter and browser context in the session; workspace files are kept. Between
    unrelated tasks, or when the browser's state is stale."""
    session = await tools.session(ctx, session_id)
    await session.reset()
    generation, preserved = session.kernel_state(lost=True)
    summary = await tools.off_loop(tools.summary, session)
    reply = json_result({"reset": True, "state_preserved": preserved, **summary})
    reply.meta = {KERNEL_META: {"generation": generation, "state_preserved": preserved}}
    return reply
