"""manage_jobs (wait, cancel, list): runs that went on after their call answered (sessions/job_runner.py).

One tool, not three: the actions share their arguments, and a tools/list entry costs every turn. It is
in the `python` and `oneshot` groups as well as `jobs`, since a run in either may answer with a job id.

Also the reply shapes of a job, shared with run_python and execute_code: a python job's reply is
its new output (text, images, links) plus a status line and the kernel line; a one-shot job's is
the JSON of execute_code. Every reply about a kernel says its generation and whether state
survived, in one line of text and in `_meta` (not in structured content: clients that show a
structured copy would show it instead of the images).
"""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

import time
from dataclasses import asdict
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, ContentBlock, ImageContent, TextContent
from pydantic import Field

from coderunner.config import Settings
from coderunner.edge.callers import client_of_key
from coderunner.errors import SessionError
from coderunner.oneshot.runs import OneShotResult
from coderunner.sessions.job_runner import Job, JobNotFound, JobStatus, attend, cancel, duration
from coderunner.sessions.job_updates import JobUpdate, running_note
from coderunner.sessions.seam import SessionHandle
from coderunner.tools.arguments import Text
from coderunner.tools.context import ToolContext, json_result, tool
from coderunner.tools.file_results import resource_link
from coderunner.tools.session_replies import seconds

#: The `_meta` keys of kernel and job state on a reply.
KERNEL_META = "coderunner/kernel"
JOB_META = "coderunner/job"


def kernel_stamp(reply: CallToolResult, session: SessionHandle, lost: bool = False) -> CallToolResult:
    """Add the kernel's generation and whether state survived: one line of text and `_meta`."""
    new_session = not session.kernel_reported
    generation, preserved = session.kernel_state(lost)
    words = "state kept" if preserved else "new kernel, state lost (variables and imports; files kept)"
    if new_session and preserved:  # nothing was there to keep, unless it was loaded from a snapshot
        words = "new session" if session.seeded is None else "new session, state restored"
    line = f"[kernel {generation}: {words}]"
    first = reply.content[0] if reply.content else None
    if isinstance(first, TextContent):  # the reply's own text: the block types stay as they were
        first.text = f"{first.text}\n{line}" if first.text else line
    else:
        reply.content.insert(0, TextContent(type="text", text=line))
    reply.meta = {**(reply.meta or {}), KERNEL_META: {"generation": generation, "state_preserved": preserved}}
    return reply


def python_job_reply(session: SessionHandle, update: JobUpdate, links: bool) -> CallToolResult:
    """What a read of a python job brought (what is new since the last read), then where the job stands."""
    if update.gone:
        raise JobNotFound(f"job {update.job_id} is no longer known: {update.notice}")
    lines = [update.text.rstrip("\n")] if update.text else []
    if update.saved:
        lines.append("[more images than fit in one reply; saved: " + ", ".join(update.saved) + "]")
    lost = False
    is_error = False
    if update.running:
        lines.append(f"[{running_note(update.job_id, update.elapsed_s)}]")
    else:
        if update.failure is not None or update.result is None:
            raise SessionError(update.failure or update.notice or f"job {update.job_id} ended without a result")
        result = update.result
        lost = result.state_lost
        is_error = update.status != JobStatus.DONE.value
        if result.notice:
            lines.append(f"[{result.notice}]")
        if update.dropped_images:
            lines.append(f"[{update.dropped_images:,} more images were neither shown nor saved]")
        count = result.outcome.execution_count
        cell = f", cell {count}" if count is not None else ""
        lines.append(f"[job {update.job_id} {update.status} after {duration(update.elapsed_s)}{cell}]")
    content: list[ContentBlock] = [TextContent(type="text", text="\n".join(lines))]
    content.extend(ImageContent(type="image", data=i.data_b64, mime_type=i.mime_type) for i in update.images)
    if links:
        saved = [update.spill_path] if update.spill_path else []
        saved += [path for path in update.saved if path.startswith("/")]
        content.extend(resource_link(session.session_id, path) for path in saved)
    reply = CallToolResult(content=content, is_error=is_error)
    reply.meta = {JOB_META: {"job_id": update.job_id, "status": update.status}}
    return kernel_stamp(reply, session, lost)


def oneshot_status(job: Job) -> JobStatus:
    result: OneShotResult = job.result
    if result.success:
        return JobStatus.DONE
    if result.timed_out:
        return JobStatus.INTERRUPTED
    return JobStatus.ERROR if result.exit_code is not None else JobStatus.LOST


def oneshot_payload(result: OneShotResult) -> dict[str, Any]:
    """execute_code's answer, lean: each limit by its value (get_capabilities says how each is held), times
    and MiB as whole numbers, and `truncated` and `exported` only when they say something."""
    payload = asdict(result)
    values = {name: value["value"] if isinstance(value, dict) else value for name, value in result.limits.items()}
    payload["limits"] = {name: value for name, value in values.items() if value is not None}
    payload["limits"]["timeout_s"] = seconds(result.limits["timeout_s"])
    payload["execution_time_ms"] = round(result.execution_time_ms)
    if result.memory_peak_mb is not None:
        payload["memory_peak_mb"] = round(result.memory_peak_mb)
    for quiet in ("truncated", "exported"):
        if not payload[quiet]:
            del payload[quiet]
    return payload


def oneshot_job_reply(job: Job) -> CallToolResult:
    """execute_code's JSON answer with the job's id and status (or only those, while it runs)."""
    head: dict[str, Any] = {"job_id": job.job_id, "status": job.status.value}
    if job.running:
        elapsed = job.elapsed_s()
        return json_result({**head, "elapsed_s": round(elapsed, 1), "note": running_note(job.job_id, elapsed)})
    if isinstance(job.result, OneShotResult):
        return json_result({**head, **oneshot_payload(job.result)}, is_error=not job.result.success)
    return json_result({**head, "note": job.notice or "ended without a result"}, is_error=True)


#: How long manage_jobs waits for new output (its default is the user's detach_after_s).
WaitLimit = Annotated[float, Field(ge=0)]


def manage_jobs_settings(settings: Settings) -> dict[str, tuple[Any, Any]]:
    """manage_jobs waits as long as a run waits before it answers with a job id, by default."""
    return {"timeout_s": (WaitLimit, settings.detach_after_s)}


async def find(tools: ToolContext, ctx: Context, job_id: str) -> Job | SessionHandle:
    """The caller's one-shot job `job_id`, or the session that holds its python job `job_id`."""
    client = client_of_key(tools.caller(ctx))
    job = tools.oneshots.oneshot_jobs.get(job_id)
    if job is not None and client_of_key(job.owner) == client:
        return job
    for session in tools.host.list():
        # Another client's job is unknown here: its session's handle is not told either.
        if client_of_key(session.owner) == client and session.holds_job(job_id):
            return await tools.session(ctx, session.session_id)
    raise JobNotFound(
        f"unknown job_id {job_id!r}: manage_jobs action 'list' shows yours (a job and its result last as long "
        "as its session; finished ones beyond the last few are forgotten)"
    )


async def python_reply(tools: ToolContext, session: SessionHandle, job_id: str) -> CallToolResult:
    """A python job as manage_jobs answers with it: what is new in it (with its export note)."""
    update = await session.read_job(job_id)
    links = tools.settings.file_links == "resource_link"
    return tools.with_export_note(python_job_reply(session, update, links), session)


async def wait(
    tools: ToolContext, found: Job | SessionHandle, job_id: str, ctx: Context, timeout_s: float
) -> CallToolResult:
    """manage_jobs wait: up to timeout_s for the job, with progress, then what it has."""
    wait_s = min(timeout_s, tools.settings.max_timeout_s)
    interval = tools.settings.progress_interval_s

    async def note(elapsed_s: float, tail: str) -> None:
        await ctx.report_progress(elapsed_s, None, f"job {job_id} running {duration(elapsed_s)}: {tail}")

    if isinstance(found, Job):

        async def tick(job: Job) -> None:
            await note(job.elapsed_s(), job.output.tail_text(200) if job.output is not None else "")

        await attend(found, wait_s, tick, interval)
        return oneshot_job_reply(found)
    deadline = time.monotonic() + wait_s
    while (remaining := deadline - time.monotonic()) > 0:
        update = await found.read_job(job_id, min(interval, remaining), take=False)
        if not update.running:
            break
        await note(update.elapsed_s, update.tail)
    return await python_reply(tools, found, job_id)


async def stop(tools: ToolContext, found: Job | SessionHandle, job_id: str) -> CallToolResult:
    """manage_jobs cancel: the cell interrupted (its kernel restarted if it ignores that), or the one-shot
    run's sandbox killed."""
    if isinstance(found, Job):
        await cancel(found, tools.settings.interrupt_grace_s + tools.settings.startup_timeout_s + 5.0)
        return oneshot_job_reply(found)
    await found.cancel_job(job_id)
    return await python_reply(tools, found, job_id)


async def listing(tools: ToolContext, ctx: Context) -> CallToolResult:
    """manage_jobs list: the caller's jobs, in its sessions and its one-shot runs."""
    client = client_of_key(tools.caller(ctx))
    found = [
        described
        for session in tools.host.list()
        if client_of_key(session.owner) == client
        for described in await session.list_jobs()
    ]
    found += [job.describe() for job in tools.oneshots.oneshot_jobs.jobs.values() if client_of_key(job.owner) == client]
    return json_result({"jobs": found})


@tool(group=("python", "oneshot", "jobs"), per_settings=manage_jobs_settings)
async def manage_jobs(
    tools: ToolContext,
    action: Literal["wait", "cancel", "list"],
    ctx: Context,
    job_id: Text = "",
    timeout_s: WaitLimit = 40.0,
) -> CallToolResult:
    """Runs that answered with a job id: wait up to timeout_s for new output, cancel, list."""
    if action == "list":
        return await listing(tools, ctx)
    if not job_id:
        raise JobNotFound(f"manage_jobs action {action!r} needs a job_id (action 'list' shows yours)")
    found = await find(tools, ctx, job_id)
    return await (wait(tools, found, job_id, ctx, timeout_s) if action == "wait" else stop(tools, found, job_id))
