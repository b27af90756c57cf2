"""execute_code: a whole program once, in a fresh throwaway sandbox; or (check_only) its syntax errors.

The syntax check is an argument, not a tool of its own: it takes the same language and code, and a
tools/list entry costs every turn.
"""

# No `from __future__ import annotations`: the SDK reads tool signatures at runtime.

from typing import Annotated, Any

import anyio
from mcp.server.mcpserver import Context
from mcp.types import CallToolResult
from pydantic import Field

from coderunner.config import MIN_MEMORY_MB, Settings
from coderunner.egress.texts import offline_note
from coderunner.oneshot.runs import OneShotError, OneShotResult
from coderunner.policy.call_variables import check_variables, parse_variables
from coderunner.sessions.job_runner import Job, attend, label_of
from coderunner.tools.arguments import DetachAfter, LanguageArg, MemoryMb, VariablesArg, network_arg
from coderunner.tools.context import ToolContext, json_result, tool
from coderunner.tools.jobs import oneshot_job_reply, oneshot_payload, oneshot_status
from coderunner.vocabulary.network import NetworkMode, more_network
from coderunner.vocabulary.sandbox_request import SandboxRequest

#: execute_code runs one client may have going or waiting for a slot, per slot of its share (each a task).
MAX_JOBS_PER_SHARE = 4
#: Largest stdin execute_code passes on.
MAX_STDIN_CHARS = 4 * 2**20


#: execute_code's run limit (its default is the user's timeout_s).
OneShotLimit = Annotated[float, Field(ge=1)]


def execute_code_settings(settings: Settings) -> dict[str, tuple[Any, Any]]:
    """execute_code's network offers only the modes within the user's ceiling; its defaults are the user's."""
    return {
        "network": (network_arg(settings.network_ceiling), settings.network),
        "memory_mb": (MemoryMb, settings.memory_mb),
        "timeout_s": (OneShotLimit, settings.timeout_s),
    }


async def validate(tools: ToolContext, ctx: Context, language: LanguageArg, code: str) -> CallToolResult:
    """execute_code check_only: the code's syntax errors, with nothing run."""
    options = tools.host.options(SandboxRequest(client=tools.client(ctx)))
    errors = await tools.oneshots.check_code(language, code, options, caller=tools.share(ctx))
    return json_result({"language": language, "valid": not errors, "errors": errors})


@tool(group="oneshot", per_settings=execute_code_settings)  # not closed-world: it may run with network internet
async def execute_code(
    tools: ToolContext,
    language: LanguageArg,
    code: str,
    ctx: Context,
    stdin: str = "",
    variables: VariablesArg = "",
    timeout_s: OneShotLimit = 60.0,
    memory_mb: MemoryMb = MIN_MEMORY_MB,
    network: str = "none",  # the modes within the user's ceiling, and their default (execute_code_settings)
    detach_after_s: DetachAfter = None,
    check_only: Annotated[bool, Field(description="Just report syntax errors.")] = False,
) -> CallToolResult:
    """A program run once in a fresh sandbox, nothing kept: exit_code, stdout, stderr, time, memory."""
    if check_only:
        return await validate(tools, ctx, language, code)
    if len(stdin) > MAX_STDIN_CHARS:
        raise OneShotError(f"stdin is {len(stdin):,} characters; at most {MAX_STDIN_CHARS:,} (use a file)")
    settings, host = tools.settings, tools.host
    values = check_variables(parse_variables(variables), language)
    options = host.options(
        SandboxRequest(network=network, memory_mb=memory_mb, timeout_s=timeout_s, client=tools.client(ctx))
    )
    share = tools.share(ctx)

    async def work(job: Job) -> OneShotResult:
        try:
            return await tools.oneshots.run_oneshot(language, code, options, stdin=stdin.encode(), variables=values,
                                                    caller=share, on_egress=call_network.attach)  # fmt: skip
        except anyio.get_cancelled_exc_class():
            job.notice = "cancelled: its sandbox was killed (a one-shot run keeps nothing)"
            raise

    table = tools.oneshots.oneshot_jobs
    caller = tools.caller(ctx)
    most = MAX_JOBS_PER_SHARE * settings.max_oneshot_runs_per_client
    if table.running_of(caller) >= most:
        raise OneShotError(
            f"this client already has {most} execute_code runs going or waiting for a sandbox: wait for or "
            "cancel one of them with manage_jobs (action 'list' shows them)"
        )
    job = Job(job_id=table.new_id(), kind="execute_code", label=label_of(code), owner=caller)
    wait = settings.detach_after_s if detach_after_s is None else detach_after_s
    with tools.egress_calls.oneshot(ctx) as call_network:
        table.start(job, work, oneshot_status)
        if not await attend(job, wait):
            job.detached = True
            if call_network.egress is not None:
                call_network.egress.set_asker(None)  # this call's client is gone: nobody left to ask
            return oneshot_job_reply(job)
        table.forget(job)
        if job.failure is not None:
            raise job.failure
        if not isinstance(job.result, OneShotResult):
            raise OneShotError(job.notice or "the run ended without a result")
    payload = oneshot_payload(job.result)
    if note := call_network.note():
        payload["network"] = note
    elif options.network == NetworkMode.NONE and not job.result.success:
        output = f"{payload.get('stdout', '')}\n{payload.get('stderr', '')}"
        if note := offline_note(output, more_network(settings.network_ceiling), "this run"):
            payload["network"] = note
    return json_result(payload, is_error=not job.result.success)
