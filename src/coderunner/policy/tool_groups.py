"""Named groups of tools, so a user who wants fewer tools (and a cheaper tools/list) can say which.

Each tool declares its group where it is defined (`@tools.tool(group=...)`, tools/context.py); the
table of which tools a group holds is built from those declarations (ToolGroups), and a tool that
declares none, or a group not named here, stops the server at start. The group NAMES are a constant
here because the settings are checked before any tool is registered; a single tool's name in a setting
is checked where the server is built, against the tools themselves. `get_capabilities` is in the
ALWAYS group: offered whatever the setting says, since it is how a model learns what this server can
do. A `tools` setting may name groups or single tools.

A tool may declare several groups when each needs it: the job tool is in `python` and `oneshot` as well
as `jobs`, since a run in either may answer with a job id, and a group must hold every tool its replies
name (policy/tool_mentions.py rewrites a mention of one the setting leaves out).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

#: The groups a `tools` setting may name, in the order the help lists them.
GROUP_NAMES: tuple[str, ...] = (
    "python", "sessions", "files", "browser", "documents", "oneshot", "jobs", "workspaces", "snapshots",
)  # fmt: skip
#: What each group is for, as get_capabilities tells a model which groups the user could turn on.
GROUP_PURPOSES: dict[str, str] = {
    "python": "code in the session's persistent kernel, its reset, status and packages",
    "sessions": "more kernels, each with its own workspace, limits and network",
    "files": "files in the workspace; in and out of the host through folders the user chose",
    "browser": "a Chromium inside the sandbox",
    "documents": "PDFs and images, parsed inside the sandbox",
    "oneshot": "Python, JavaScript or bash once, in a throwaway sandbox",
    "jobs": "runs that outlive a call (wait, cancel, list)",
    "workspaces": "named workspaces kept across sessions",
    "snapshots": "save and bring back a session's files and variables",
}
#: The same names, under the name config.py reads them by.
TOOL_GROUPS = GROUP_NAMES
#: What a server started with no `tools` setting offers: the seed's six tools (run_python and
#: kernel_reset in python, browser_*, pdf_ops and image_ops) with what their replies lead to (jobs,
#: a session's status, files in and out). tools/list goes to the model on every turn, and these fit
#: its 2,000-token budget (tests/test_tool_schemas.py); sessions, snapshots, oneshot and workspaces
#: are a setting away (get_capabilities says how).
DEFAULT_GROUPS: tuple[str, ...] = ("python", "files", "browser", "documents")
#: The group of tools offered whatever `tools` says (not a name a setting may use).
ALWAYS = "always"
ALL = "all"


class ToolsetError(ValueError):
    """A `tools` entry names neither a group nor a tool; or a tool declares no group, or an unknown one."""


@dataclass(frozen=True)
class ToolGroups:
    """Which groups each registered tool declared: tool name -> its groups (one, or several)."""

    of: Mapping[str, tuple[str, ...]]

    def __post_init__(self) -> None:
        for tool, groups in self.of.items():
            for group in groups or ("",):
                if group != ALWAYS and group not in GROUP_NAMES:
                    raise ToolsetError(
                        f"{tool}: declares tool group {group!r}, which is none of {', '.join(GROUP_NAMES)}"
                    )

    @property
    def all_tools(self) -> frozenset[str]:
        return frozenset(self.of)

    def members(self, group: str) -> tuple[str, ...]:
        """The tools that declared `group`, in the order they were registered."""
        return tuple(tool for tool, declared in self.of.items() if group in declared)

    def selected(self, entries: Iterable[str]) -> frozenset[str]:
        """The tool names a `tools` setting exposes."""
        names: set[str] = set(self.members(ALWAYS))
        for entry in check_selection(entries, self.all_tools):
            if entry == ALL:
                return self.all_tools
            names.update(self.members(entry) if entry in GROUP_NAMES else (entry,))
        return frozenset(names)


#: A single tool's name, as a `tools` entry may give one (checked against the tools where the server is built).
TOOL_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


def check_selection(entries: Iterable[str], tool_names: Collection[str] | None = None) -> list[str]:
    """The entries, stripped, once each; unknown names refused with the valid ones listed.

    `tool_names`: the tools there are. None while the settings load, before any tool is registered: a
    name that is no group is then only checked to be a tool's name in form, and build_server checks it
    against the tools' own declarations (so policy/ imports nothing above it).
    """
    chosen: list[str] = []
    for raw in entries:
        entry = raw.strip()
        if not entry or entry in chosen:
            continue
        if entry != ALL and entry not in GROUP_NAMES:
            known = TOOL_NAME.fullmatch(entry) if tool_names is None else entry in tool_names
            if not known:
                groups = ", ".join([ALL, *GROUP_NAMES])
                raise ToolsetError(f"unknown tool group {entry!r}: use {groups}, or single tool names")
        chosen.append(entry)
    if not chosen:
        raise ToolsetError(f"no tools chosen: use {ALL} or some of {', '.join(GROUP_NAMES)}")
    return chosen
