"""run_python and kernel_reset, the seed's two kernel tools: a session's persistent kernel, and a fresh one.

kernel_reset is also how a stale browser goes: the browser context lives in the kernel, so a new kernel
is a new context. Files in the workspace are kept.
"""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import anyio
from mcp.server.mcpserver import Context
from mcp.types import CallToolResult
from pydantic import Field

from coderunner.config import Settings
from coderunner.errors import SessionError
from coderunner.policy.call_variables import check_variables, parse_variables
from coderunner.sessions.job_runner import CANCEL_MARGIN_S, duration
from coderunner.sessions.job_updates import JobUpdate
from coderunner.sessions.sandbox_options import check_timeout
from coderunner.sessions.seam import SessionHandle
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
    links = settings.file_links == "resource_link"
    session = await tools.session(ctx, session_id, total=timeout_s or settings.timeout_s)
    async with tools.egress_call(ctx, session) as network:
        limit = timeout_s or session.options.timeout_s

        async def progress(update: JobUpdate) -> None:
            since_call = time.monotonic() - called  # progress only grows, whatever the note says
            if update.executing_for_s is None:  # not running yet: say what it waits for, not that a cell runs
                await ctx.report_progress(since_call, limit, f"waiting for the kernel ({since_call:.0f} s)")
            elif update.executing_for_s >= settings.progress_interval_s:
                await ctx.report_progress(since_call, limit, f"running {duration(update.elapsed_s)}: {update.tail}")

        wait = settings.detach_after_s if detach_after_s is None else detach_after_s
        update = await attend_run(session, code, timeout_s, values, wait, settings.progress_interval_s, progress)
        if update.running:  # it goes on as a job: what it printed so far, and its id
            return network.noted(python_job_reply(session, await session.read_job(update.job_id), links))
    if update.failure is not None or update.result is None:
        raise SessionError(update.failure or update.notice or f"job {update.job_id} ended without a result")
    reply = execution_reply(update.result, session.session_id, links=links)
    reply = offline_noted(reply, session.options.network, settings.network_ceiling)
    return network.noted(tools.with_export_note(kernel_stamp(reply, session, update.result.state_lost), session))


async def attend_run(
    session: SessionHandle, code: str, timeout_s: float | None, variables: dict[str, Any] | None, wait_s: float,
    interval_s: float, progress: Callable[[JobUpdate], Awaitable[None]],
) -> JobUpdate:  # fmt: skip
    """Run `code` and wait up to `wait_s` for its end, with `progress` every `interval_s`: its last update.
    A caller cancelled before the end cancels the cell: the session does inside its own waits (start_run,
    wait_job), this between them (while a progress note goes out)."""
    deadline = time.monotonic() + wait_s
    update = await session.start_run(code, timeout_s, variables, min(interval_s, wait_s))
    while update.running and (remaining := deadline - time.monotonic()) > 0:
        try:
            await progress(update)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_MARGIN_S):
                await session.cancel_job(update.job_id)
            raise
        update = await session.wait_job(update.job_id, min(interval_s, remaining))
    return update


@tool(group="python")
async def kernel_reset(tools: ToolContext, ctx: Context, session_id: SessionId = "") -> CallToolResult:
    """A fresh interpreter and browser context in the session; workspace files are kept. Between
    unrelated tasks, or when the browser's state is stale."""
    session = await tools.session(ctx, session_id)
    await session.reset()
    generation, preserved = session.kernel_state(lost=True)
    summary = await tools.summary(session)
    reply = json_result({"reset": True, "state_preserved": preserved, **summary})
    reply.meta = {KERNEL_META: {"generation": generation, "state_preserved": preserved}}
    return reply
