"""run_python: the session's persistent kernel (its reset is manage_sessions'; tools/sessions.py)."""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

import time
from typing import Annotated

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult
from pydantic import Field

from coderunner.policy.call_variables import check_variables, parse_variables
from coderunner.sessions.job_runner import Job, attend, duration
from coderunner.sessions.sandbox_options import check_timeout
from coderunner.tools.arguments import DetachAfter, SessionId, VariablesArg
from coderunner.tools.context import ToolContext
from coderunner.tools.jobs import kernel_stamp, python_job_reply
from coderunner.tools.replies import execution_reply


def register(tools: ToolContext) -> None:
    settings = tools.settings
    links = settings.file_links == "resource_link"

    @tools.tool(group="python")  # not closed-world: a session may have network internet
    async def run_python(
        code: str,
        ctx: Context,
        session_id: SessionId = "",
        timeout_s: Annotated[
            float | None,
            Field(ge=1, description=f"Default: the session's ({settings.timeout_s:g})."),
        ] = None,
        variables: VariablesArg = "",
        detach_after_s: DetachAfter = None,
    ) -> CallToolResult:
        """Python in the session's persistent sandboxed Jupyter kernel; charts come back as images."""
        check_timeout(settings, timeout_s)
        values = check_variables(parse_variables(variables), "python")
        session = await tools.session(ctx, session_id)
        async with tools.egress_call(ctx, session) as network:
            job = await session.start_run(code, timeout_s, values)
            limit = timeout_s or session.options.timeout_s

            async def progress(job: Job) -> None:
                assert job.output is not None
                began = job.executing_since
                if began is None or time.monotonic() - began < settings.progress_interval_s:
                    return  # not running yet: a note now would say a cell runs that has not started
                elapsed = job.elapsed_s()
                await ctx.report_progress(elapsed, limit, f"running {duration(elapsed)}: {job.output.tail_text(200)}")

            wait = settings.detach_after_s if detach_after_s is None else detach_after_s
            attended = await attend(job, wait, progress, settings.progress_interval_s)
        if not attended:
            job.detached = True
            return network.noted(python_job_reply(session, job, links))
        session.forget_job(job)  # answered whole: never a job the caller needs to know about
        result = session.job_result(job)
        reply = execution_reply(result, session.session_id, links=links)
        return network.noted(tools.with_export_note(kernel_stamp(reply, session, result.state_lost), session))
