"""Named groups of tools, so a user who wants fewer tools (and a cheaper tools/list) can say which.

Every tool belongs to exactly one group; `get_capabilities` is in none and always offered, since
it is how a model learns what this server can do. A `tools` setting may name groups or single tools.
"""

from __future__ import annotations

from collections.abc import Iterable

TOOL_GROUPS: dict[str, tuple[str, ...]] = {
    "python": ("run_python", "kernel_reset", "install_packages"),
    "sessions": ("create_session", "close_session", "session_status", "list_sessions"),
    "files": ("list_files", "read_file", "write_file", "upload_file", "download_file"),
    "browser": ("browser_navigate", "browser_extract", "browser_screenshot", "browser_interact"),
    "documents": ("pdf_ops", "image_ops"),
    "oneshot": ("execute_code", "validate_code"),
    "jobs": ("wait_job", "cancel_job", "list_jobs"),
    "workspaces": ("list_workspaces", "delete_workspace"),
    "snapshots": ("snapshot_session", "restore_session", "fork_session", "list_snapshots", "delete_snapshot"),
}
ALWAYS = ("get_capabilities",)
ALL = "all"
ALL_TOOLS = frozenset(ALWAYS).union(*TOOL_GROUPS.values())


class ToolsetError(ValueError):
    """A `tools` entry names neither a group nor a tool."""


def check_selection(entries: Iterable[str]) -> list[str]:
    """The entries, stripped, once each; unknown names refused with the valid ones listed."""
    chosen: list[str] = []
    for raw in entries:
        entry = raw.strip()
        if not entry or entry in chosen:
            continue
        if entry != ALL and entry not in TOOL_GROUPS and entry not in ALL_TOOLS:
            groups = ", ".join([ALL, *TOOL_GROUPS])
            raise ToolsetError(f"unknown tool group {entry!r}: use {groups}, or single tool names")
        chosen.append(entry)
    if not chosen:
        raise ToolsetError(f"no tools chosen: use {ALL} or some of {', '.join(TOOL_GROUPS)}")
    return chosen


def selected_tools(entries: Iterable[str]) -> frozenset[str]:
    """The tool names a `tools` setting exposes."""
    names: set[str] = set(ALWAYS)
    for entry in check_selection(entries):
        if entry == ALL:
            return ALL_TOOLS
        names.update(TOOL_GROUPS.get(entry, (entry,)))
    return frozenset(names)
