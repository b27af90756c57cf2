"""What a client that calls a tool this server does not offer is told instead of a bare "Unknown tool".

Clients, prompts and skills are written against tool names that outlive any one version: the seed's
six, the names of earlier versions (31 tools before the fold of issue 28, use_browser and document_ops
after it) and what other Python sandboxes call theirs. Each of those names points at what does the job
here; a tool this server has but the `tools` setting leaves out is named with the group that turns it
on; anything else gets the nearest names offered. The same table is what tests read texts against:
no text of ours names a tool in RENAMED.
"""

from __future__ import annotations

import difflib

from coderunner.policy.tool_groups import ALWAYS
from coderunner.policy.tool_mentions import Mentions

#: Names a client may call that are no tool here -> the tools that do their job.
RENAMED: dict[str, tuple[str, ...]] = {
    # The fold of issue 28 (each browser op is again a browser_* tool; the documents again the seed's two).
    "use_browser": ("browser_navigate", "browser_extract", "browser_screenshot", "browser_interact"),
    "document_ops": ("pdf_ops", "image_ops"),
    # The 31 tools before the fold, under the tool that holds them now (as an action or an argument).
    "wait_job": ("manage_jobs",),
    "cancel_job": ("manage_jobs",),
    "list_jobs": ("manage_jobs",),
    "session_status": ("manage_sessions",),
    "close_session": ("manage_sessions",),
    "list_sessions": ("manage_sessions",),
    "snapshot_session": ("manage_snapshots",),
    "restore_session": ("manage_snapshots",),
    "fork_session": ("manage_snapshots",),
    "list_snapshots": ("manage_snapshots",),
    "delete_snapshot": ("manage_snapshots",),
    "list_workspaces": ("manage_workspaces",),
    "delete_workspace": ("manage_workspaces",),
    "upload_file": ("transfer_file",),
    "download_file": ("transfer_file",),
    "list_files": ("read_file",),
    "validate_code": ("execute_code",),
    # What other sandboxes and notebooks call the same jobs.
    "execute_python": ("run_python",),
    "run_code": ("run_python", "execute_code"),
    "python": ("run_python",),
    "reset_kernel": ("kernel_reset",),
    "restart_kernel": ("kernel_reset",),
    "reset_session": ("kernel_reset",),
    "reset": ("kernel_reset",),
}


def unknown_tool(name: str, mentions: Mentions) -> str:
    """The answer to a call of `name`, which this server does not offer: what to use instead."""
    shown = name if len(name) <= 80 and name.isprintable() else repr(name[:80])
    offered = mentions.offered
    if name in mentions.groups.all_tools:
        return f"{shown} is not offered by this server: {turn_on(name, mentions)}"
    instead = RENAMED.get(name, ())
    usable = [tool for tool in instead if tool in offered]
    if usable:
        return f"there is no tool {shown} here; use {' or '.join(usable)}"
    if instead:
        return f"there is no tool {shown} here; {instead[0]} does that job, but {turn_on(instead[0], mentions)}"
    near = difflib.get_close_matches(name, sorted(offered), n=3, cutoff=0.6)
    if near:
        return f"there is no tool {shown} here; did you mean {' or '.join(near)}?"
    return f"there is no tool {shown} here; the tools are {', '.join(sorted(offered))}"


def turn_on(tool: str, mentions: Mentions) -> str:
    """How the user (never the agent) gets `tool`: the group to add to the `tools` setting."""
    groups = [group for group in mentions.groups.of.get(tool, ()) if group != ALWAYS]
    named = " or ".join(repr(group) for group in groups) or repr(tool)
    return (
        f"it is in the tool group {named}, which the user can add to the tools setting "
        "(serve --tools, CODERUNNER_TOOLS or tools in config.toml) and restart"
    )
